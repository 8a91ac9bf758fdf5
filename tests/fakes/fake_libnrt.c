/*
 * FAKE libnrt for CPU CI: same C signatures as nrt/nrt.h (aws-neuron/aws-neuron-sdk
 * src/libnrt/include/nrt/nrt.h) for the calls kvferry and the tests bind. No Neuron
 * device exists here; this library stands in for the runtime and is as strict as the
 * real one where kvferry could otherwise get away with a mistake:
 *
 *  - Device VAs are not host memory. nrt_tensor_get_va returns an address inside a
 *    PROT_NONE reservation: touching it from the host faults, as touching unmapped HBM
 *    would. The bytes live in a separate backing store reached only through
 *    nrt_tensor_read / nrt_tensor_write.
 *  - Unless NEURON_RT_MAP_HBM=1 was set when nrt_init ran: then, like the runtime that
 *    maps HBM into the host address space (what vllm-neuron's worker and AWS's
 *    disagg_serve_vllm sample set for NIXL), the VA is the host-mapped backing store.
 *  - nrt_get_attached_efa_bdf returns NRT_FAILURE for an address that is not Neuron
 *    memory (nrt.h: "NRT_FAILURE for other errors"), NRT_RESOURCE for a short buffer.
 *  - A second nrt_init is refused (NRT_FAILURE). The framework (libtorch-neuronx)
 *    starts the runtime; what a second init from a connector does is undocumented, so
 *    the fake makes it an error a test sees. fake_nrt_init_calls() counts the calls.
 *  - nrt_get_total_nc_count / nrt_get_visible_nc_count work before nrt_init (nrt.h:
 *    "This API can be called before nrt_init()"); tensor calls need an initialised
 *    runtime (NRT_UNINITIALIZED before, NRT_CLOSED after nrt_close).
 *
 * Knobs (environment, read at call time unless noted):
 *   FAKE_NRT_MAX_BYTES   largest single allocation (default 1 GiB) -> NRT_RESOURCE above
 *   FAKE_NRT_FAIL_EFA=1  nrt_get_attached_efa_bdf returns NRT_FAILURE
 *   FAKE_NRT_FAIL_INIT=N nrt_init returns status N
 *   FAKE_NRT_NC_COUNT    NeuronCores on the "instance" (default 64: trn2.48xlarge, LNC=2)
 *   NEURON_RT_MAP_HBM=1  read by nrt_init: VAs are host-mapped
 *   NEURON_RT_VISIBLE_CORES read by nrt_get_visible_nc_count ("a-b" or "a,b,c")
 *
 * Test helpers (not in nrt.h): fake_nrt_reset(), fake_nrt_init_calls(),
 * fake_nrt_live_tensors(), fake_nrt_hbm_mapped().
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int NRT_STATUS;
enum { NRT_SUCCESS = 0, NRT_FAILURE = 1, NRT_INVALID = 2, NRT_INVALID_HANDLE = 3,
       NRT_RESOURCE = 4, NRT_UNINITIALIZED = 13, NRT_CLOSED = 14 };
typedef enum { NRT_TENSOR_PLACEMENT_DEVICE, NRT_TENSOR_PLACEMENT_HOST,
               NRT_TENSOR_PLACEMENT_VIRTUAL } nrt_tensor_placement_t;
typedef int nrt_framework_type_t;

typedef struct nrt_tensor {
    void *data;     /* backing store (host memory, never handed out unless mapped) */
    char *va;       /* what nrt_tensor_get_va reports */
    size_t size;
    int vnc;
    int placement;
    struct nrt_tensor *next;
} nrt_tensor_t;

#define VA_SPACE ((size_t)1 << 36) /* 64 GiB of address space reserved, never backed */
#define VA_ALIGN ((size_t)1 << 16)

static int state; /* 0 start, 1 init, 2 closed */
static int init_calls;
static int hbm_mapped;
static nrt_tensor_t *live;
static char *va_base;
static size_t va_next;

static NRT_STATUS gate(void) {
    return state == 1 ? NRT_SUCCESS : state == 2 ? NRT_CLOSED : NRT_UNINITIALIZED;
}

static size_t env_size(const char *name, size_t dflt) {
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}

static int env_is_1(const char *name) {
    const char *v = getenv(name);
    return v && v[0] == '1' && v[1] == 0;
}

NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    (void)fw_version; (void)fal_version;
    init_calls++;
    size_t forced = env_size("FAKE_NRT_FAIL_INIT", 0);
    if (forced) return (NRT_STATUS)forced;
    if (state != 0) return NRT_FAILURE; /* already initialised (or closed): refused */
    if (framework < 1 || framework > 5) return NRT_INVALID;
    if (!va_base) {
        void *p = mmap(NULL, VA_SPACE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return NRT_RESOURCE;
        va_base = p;
    }
    hbm_mapped = env_is_1("NEURON_RT_MAP_HBM");
    state = 1;
    return NRT_SUCCESS;
}

void nrt_close(void) { state = 2; }

static int count_cores(const char *spec) {
    int n = 0;
    const char *p = spec;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end == p) return -1;
        if (*end == '-') { p = end + 1; b = strtol(p, &end, 10); if (end == p || b < a) return -1; }
        n += (int)(b - a + 1);
        if (*end == ',') end++;
        else if (*end) return -1;
        p = end;
    }
    return n;
}

NRT_STATUS nrt_get_total_nc_count(uint32_t *nc_count) {
    if (!nc_count) return NRT_INVALID;
    *nc_count = (uint32_t)env_size("FAKE_NRT_NC_COUNT", 64);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_visible_nc_count(uint32_t *nc_count) {
    if (!nc_count) return NRT_INVALID;
    const char *v = getenv("NEURON_RT_VISIBLE_CORES");
    int n = v && *v ? count_cores(v) : (int)env_size("FAKE_NRT_NC_COUNT", 64);
    if (n < 0) return NRT_INVALID;
    *nc_count = (uint32_t)n;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size,
                               const char *name, nrt_tensor_t **tensor) {
    (void)name;
    NRT_STATUS s = gate();
    if (s) return s;
    if (!tensor || size == 0) return NRT_INVALID;
    if (placement == NRT_TENSOR_PLACEMENT_DEVICE && vnc < 0) return NRT_INVALID;
    if (size > env_size("FAKE_NRT_MAX_BYTES", (size_t)1 << 30)) return NRT_RESOURCE;
    size_t span = (size + VA_ALIGN - 1) / VA_ALIGN * VA_ALIGN;
    if (!hbm_mapped && va_next + span > VA_SPACE) return NRT_RESOURCE;
    nrt_tensor_t *t = calloc(1, sizeof(*t));
    if (!t) return NRT_RESOURCE;
    if (posix_memalign(&t->data, 4096, size)) { free(t); return NRT_RESOURCE; }
    memset(t->data, 0, size);
    if (hbm_mapped) {
        t->va = t->data;
    } else {
        t->va = va_base + va_next;
        va_next += span;
    }
    t->size = size;
    t->vnc = vnc;
    t->placement = placement;
    t->next = live;
    live = t;
    *tensor = t;
    return NRT_SUCCESS;
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (!tensor || !*tensor) return;
    for (nrt_tensor_t **p = &live; *p; p = &(*p)->next) {
        if (*p == *tensor) { *p = (*p)->next; break; }
    }
    free((*tensor)->data);
    free(*tensor);
    *tensor = NULL;
}

void *nrt_tensor_get_va(const nrt_tensor_t *tensor) { return tensor ? tensor->va : NULL; }

size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) { return tensor ? tensor->size : 0; }

NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    NRT_STATUS s = gate();
    if (s) return s;
    if (!tensor || !buf || offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    memcpy(buf, (const char *)tensor->data + offset, size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    NRT_STATUS s = gate();
    if (s) return s;
    if (!tensor || !buf || offset > tensor->size || size > tensor->size - offset) return NRT_INVALID;
    memcpy((char *)tensor->data + offset, buf, size);
    return NRT_SUCCESS;
}

/* trn2.48xlarge-like topology: 4 NeuronCores share one EFA rail, rails on buses 0x10.. */
NRT_STATUS nrt_get_attached_efa_bdf(const void *va, char *efa_bdf, size_t *len) {
    NRT_STATUS s = gate();
    if (s) return s;
    if (env_is_1("FAKE_NRT_FAIL_EFA")) return NRT_FAILURE;
    if (!efa_bdf || !len) return NRT_INVALID;
    const char *p = va;
    for (nrt_tensor_t *t = live; t; t = t->next) {
        if (t->placement != NRT_TENSOR_PLACEMENT_DEVICE) continue;
        if (p >= t->va && p < t->va + t->size) {
            char tmp[32];
            int n = snprintf(tmp, sizeof(tmp), "0000:%02x:1c.0", 0x10 + t->vnc / 4);
            if ((size_t)n + 1 > *len) { *len = (size_t)n; return NRT_RESOURCE; }
            memcpy(efa_bdf, tmp, (size_t)n + 1);
            *len = (size_t)n;
            return NRT_SUCCESS;
        }
    }
    return NRT_FAILURE; /* not Neuron HBM */
}

/* -- test helpers, not in nrt.h ------------------------------------------------------- */

/* Back to a fresh process's state (a module-scoped library is shared by many tests). */
void fake_nrt_reset(void) {
    while (live) {
        nrt_tensor_t *t = live;
        nrt_tensor_free(&t);
    }
    state = 0;
    init_calls = 0;
    hbm_mapped = 0;
    va_next = 0;
}

int fake_nrt_init_calls(void) { return init_calls; }

int fake_nrt_hbm_mapped(void) { return hbm_mapped; }

int fake_nrt_live_tensors(void) {
    int n = 0;
    for (nrt_tensor_t *t = live; t; t = t->next) n++;
    return n;
}
