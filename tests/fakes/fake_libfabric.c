/* FAKE libfabric.so.1 for tests/test_envcheck_libfabric.py: the ABI of a tagged libfabric
 * (symbol versions FABRIC_1.0 and FABRIC_1.1, fi_version 2.1) and none of FABRIC_1.10, which
 * NIXL 1.5.1's LIBFABRIC plugin imports fi_getinfo/fi_dupinfo/fi_freeinfo at. It moves
 * nothing: every call fails. Built with a version script that defines only those nodes. */
#include <stddef.h>
#include <stdint.h>

uint32_t fi_version(void) { return (2u << 16) | 1u; }
int fi_getinfo(uint32_t v, const char *node, const char *svc, uint64_t flags, const void *hints,
               void **info) { return -61; /* -FI_ENODATA */ }
void fi_freeinfo(void *info) {}
void *fi_dupinfo(const void *info) { return NULL; }
int fi_fabric(void *attr, void **fabric, void *ctx) { return -38; /* -FI_ENOSYS */ }
const char *fi_strerror(int err) { return "fake libfabric"; }
