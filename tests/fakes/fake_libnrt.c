/*
 * A fake libnrt for CPU CI: same C signatures as nrt/nrt.h for the calls kvferry binds.
 *
 * "Device" memory is page-aligned host memory and its address is reported as the VA, so
 * the real NIXL agents in the tests can register and move it as DRAM. Lifecycle checks
 * (NRT_UNINITIALIZED / NRT_CLOSED), bounds checks (NRT_INVALID) and an allocation limit
 * (NRT_RESOURCE) mimic the real runtime's status codes so error mapping is testable.
 *
 * Knobs (environment, read at call time):
 *   FAKE_NRT_MAX_BYTES   largest single allocation (default 1 GiB) -> NRT_RESOURCE above
 *   FAKE_NRT_FAIL_EFA=1  nrt_get_attached_efa_bdf returns NRT_FAILURE
 *   FAKE_NRT_FAIL_INIT=N nrt_init returns status N
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int NRT_STATUS;
enum { NRT_SUCCESS = 0, NRT_FAILURE = 1, NRT_INVALID = 2, NRT_INVALID_HANDLE = 3,
       NRT_RESOURCE = 4, NRT_UNINITIALIZED = 13, NRT_CLOSED = 14 };
typedef enum { NRT_TENSOR_PLACEMENT_DEVICE, NRT_TENSOR_PLACEMENT_HOST,
               NRT_TENSOR_PLACEMENT_VIRTUAL } nrt_tensor_placement_t;
typedef int nrt_framework_type_t;

typedef struct nrt_tensor {
    void *data;
    size_t size;
    int vnc;
    int placement;
    struct nrt_tensor *next;
} nrt_tensor_t;

static int state; /* 0 start, 1 init, 2 closed */
static nrt_tensor_t *live;

static NRT_STATUS gate(void) {
    return state == 1 ? NRT_SUCCESS : state == 2 ? NRT_CLOSED : NRT_UNINITIALIZED;
}

static size_t env_size(const char *name, size_t dflt) {
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}

NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    (void)fw_version; (void)fal_version;
    size_t forced = env_size("FAKE_NRT_FAIL_INIT", 0);
    if (forced) return (NRT_STATUS)forced;
    if (framework != 1 /* NRT_FRAMEWORK_TYPE_NO_FW */ && framework != 3) return NRT_INVALID;
    state = 1;
    return NRT_SUCCESS;
}

void nrt_close(void) { state = 2; }

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size,
                               const char *name, nrt_tensor_t **tensor) {
    (void)name;
    NRT_STATUS s = gate();
    if (s) return s;
    if (!tensor || size == 0) return NRT_INVALID;
    if (placement == NRT_TENSOR_PLACEMENT_DEVICE && vnc < 0) return NRT_INVALID;
    if (size > env_size("FAKE_NRT_MAX_BYTES", (size_t)1 << 30)) return NRT_RESOURCE;
    nrt_tensor_t *t = calloc(1, sizeof(*t));
    if (!t) return NRT_RESOURCE;
    if (posix_memalign(&t->data, 4096, size)) { free(t); return NRT_RESOURCE; }
    memset(t->data, 0, size);
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

void *nrt_tensor_get_va(const nrt_tensor_t *tensor) { return tensor ? tensor->data : NULL; }

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
    if (getenv("FAKE_NRT_FAIL_EFA") && *getenv("FAKE_NRT_FAIL_EFA") == '1') return NRT_FAILURE;
    if (!efa_bdf || !len) return NRT_INVALID;
    const char *p = va;
    for (nrt_tensor_t *t = live; t; t = t->next) {
        const char *b = t->data;
        if (p >= b && p < b + t->size) {
            char tmp[32];
            int n = snprintf(tmp, sizeof(tmp), "0000:%02x:1c.0", 0x10 + t->vnc / 4);
            if ((size_t)n + 1 > *len) { *len = (size_t)n; return NRT_RESOURCE; }
            memcpy(efa_bdf, tmp, (size_t)n + 1);
            *len = (size_t)n;
            return NRT_SUCCESS;
        }
    }
    return NRT_INVALID; /* not Neuron memory */
}

/* Test helper, not in nrt.h: how many tensors are still allocated. */
int fake_nrt_live_tensors(void) {
    int n = 0;
    for (nrt_tensor_t *t = live; t; t = t->next) n++;
    return n;
}
