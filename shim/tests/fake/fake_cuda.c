/*
 * A stand-in for libcuda.so.1: enough of the driver API for the shim's tests
 * and benchmark.  Memory is bookkeeping only (no real device); it tracks what
 * is allocated so tests can tell whether a call reached the driver.
 *
 * FAKE_CUDA_MEM_MIB   size of each fake card in MiB (default 16384)
 * FAKE_CUDA_DEVICES   number of cards (default 1, at most 4)
 * FAKE_CUDA_GPA_ALIASES=1  cuGetProcAddress hands out internal addresses instead of the
 *                     exported ones (as a real driver may), for the hooked entry points
 */
#include "fake.h"

#include <cuda.h>
#undef cuGetProcAddress

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static uint64_t card_bytes = 16384ull << 20;
static int device_count = 1;
static int gpa_aliases;
static struct fake_cuda_stats stats;
static __thread int current_device;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

struct live {
    uint64_t key;
    uint64_t size;
    int dev;
};
#define MAX_LIVE 65536
static struct live live[MAX_LIVE];
static int nlive;
static uint64_t next_addr = 0x700000000000ull;

__attribute__((constructor)) static void fake_init(void)
{
    const char *s = getenv("FAKE_CUDA_MEM_MIB");
    if (s != NULL && *s != '\0')
        card_bytes = strtoull(s, NULL, 10) << 20;
    s = getenv("FAKE_CUDA_DEVICES");
    if (s != NULL && *s != '\0')
        device_count = atoi(s);
    if (device_count < 1)
        device_count = 1;
    if (device_count > FAKE_MAX_DEVICES)
        device_count = FAKE_MAX_DEVICES;
    s = getenv("FAKE_CUDA_GPA_ALIASES");
    gpa_aliases = s != NULL && strcmp(s, "1") == 0;
}

/* Allocate bookkeeping; returns the new key or 0 when the card is full. */
static uint64_t fake_alloc(uint64_t size, int dev)
{
    uint64_t key = 0;
    pthread_mutex_lock(&lock);
    stats.alloc_calls++;
    if (dev < 0 || dev >= device_count || nlive == MAX_LIVE || size > card_bytes - stats.used_bytes[dev])
        goto out;
    key = next_addr;
    next_addr += (size + 511) & ~511ull;
    if (size == 0)
        next_addr += 512;
    live[nlive++] = (struct live){key, size, dev};
    stats.used_bytes[dev] += size;
out:
    pthread_mutex_unlock(&lock);
    return key;
}

static int fake_free(uint64_t key)
{
    int found = 0;
    pthread_mutex_lock(&lock);
    stats.free_calls++;
    for (int i = nlive - 1; i >= 0; i--)
        if (live[i].key == key) {
            stats.used_bytes[live[i].dev] -= live[i].size;
            live[i] = live[--nlive];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&lock);
    return found;
}

EXPORT void fake_cuda_stats(struct fake_cuda_stats *out)
{
    pthread_mutex_lock(&lock);
    *out = stats;
    out->launches = __atomic_load_n(&stats.launches, __ATOMIC_RELAXED);
    out->ptsz_calls = __atomic_load_n(&stats.ptsz_calls, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lock);
}

EXPORT uint64_t fake_cuda_launch_count(void)
{
    return __atomic_load_n(&stats.launches, __ATOMIC_RELAXED);
}

static void ptsz(void)
{
    __atomic_add_fetch(&stats.ptsz_calls, 1, __ATOMIC_RELAXED);
}

/* ---- init, devices, contexts */
EXPORT CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = CUDA_VERSION; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetCount(int *n) { *n = device_count; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (ordinal < 0 || ordinal >= device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    if (d < 0 || d >= device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *ctx = (CUcontext)(uintptr_t)(d + 1);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    current_device = ctx ? (int)(uintptr_t)ctx - 1 : 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d) { *d = current_device; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (d < 0 || d >= device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = card_bytes;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    pthread_mutex_lock(&lock);
    *free = card_bytes - stats.used_bytes[current_device];
    *total = card_bytes;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- linear memory */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    uint64_t k = fake_alloc(n, current_device);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int flags)
{
    (void)flags;
    return cuMemAlloc_v2(p, n);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int elem)
{
    (void)elem;
    size_t pt = (w + 511) & ~(size_t)511;
    uint64_t k = fake_alloc((uint64_t)pt * h, current_device);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    *pitch = pt;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return fake_free(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { (void)s; return cuMemAlloc_v2(p, n); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { ptsz(); return cuMemAllocAsync(p, n, s); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    (void)pool;
    (void)s;
    return cuMemAlloc_v2(p, n);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    ptsz();
    return cuMemAllocFromPoolAsync(p, n, pool, s);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return cuMemFree_v2(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { ptsz(); return cuMemFreeAsync(p, s); }

/* ---- virtual memory */
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    (void)flags;
    int dev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : 0;
    uint64_t k = fake_alloc(n, dev);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *h = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return fake_free(h) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

/* ---- arrays: the fake card charges w*h*d*channels*4 bytes */
static uint64_t dims(size_t w, size_t h, size_t d, unsigned ch)
{
    return (uint64_t)(w ? w : 1) * (h ? h : 1) * (d ? d : 1) * (ch ? ch : 1) * 4;
}
EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    uint64_t k = fake_alloc(dims(d->Width, d->Height, 1, d->NumChannels), current_device);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *a = (CUarray)(uintptr_t)k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    uint64_t k = fake_alloc(dims(d->Width, d->Height, d->Depth, d->NumChannels), current_device);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *a = (CUarray)(uintptr_t)k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return fake_free((uintptr_t)a) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    uint64_t k = fake_alloc(dims(d->Width, d->Height, d->Depth, d->NumChannels) * 2 * (levels ? 1 : 1),
                            current_device);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *a = (CUmipmappedArray)(uintptr_t)k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a)
{
    return fake_free((uintptr_t)a) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- launches */
static CUresult launch(void)
{
    __atomic_add_fetch(&stats.launches, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shm, CUstream s, void **params, void **extra)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shm, (void)s, (void)params,
        (void)extra;
    return launch();
}
EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                    unsigned bz, unsigned shm, CUstream s, void **params, void **extra)
{
    ptsz();
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, s, params, extra);
}
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)c, (void)f, (void)params, (void)extra;
    return launch();
}
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    ptsz();
    return cuLaunchKernelEx(c, f, params, extra);
}
EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                          unsigned by, unsigned bz, unsigned shm, CUstream s, void **params)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shm, (void)s, (void)params;
    return launch();
}
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                               unsigned by, unsigned bz, unsigned shm, CUstream s, void **params)
{
    ptsz();
    return cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shm, s, params);
}
EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { (void)g, (void)s; return launch(); }
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { ptsz(); return cuGraphLaunch(g, s); }

/* ---- cuGetProcAddress: choose the variant like the driver does */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

/* Internal entry points: same behaviour, other addresses (no dynamic symbol). */
static CUresult a_cuInit(unsigned int f) { return cuInit(f); }
static CUresult a_cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
static CUresult a_cuDeviceTotalMem_v2(size_t *b, CUdevice d) { return cuDeviceTotalMem_v2(b, d); }
static CUresult a_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return cuMemAlloc_v2(p, n); }
static CUresult a_cuMemFree_v2(CUdeviceptr p) { return cuMemFree_v2(p); }
static CUresult a_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
static CUresult a_cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync_ptsz(p, n, s); }
static CUresult a_cuMemFreeAsync(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, s); }
static CUresult a_cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync_ptsz(p, s); }
static CUresult a_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shm, CUstream s, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, s, params, extra);
}
static CUresult a_cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                      unsigned by, unsigned bz, unsigned shm, CUstream s, void **params,
                                      void **extra)
{
    return cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shm, s, params, extra);
}
static CUresult a_cuGetProcAddress(const char *sym, void **pfn, int v, cuuint64_t fl)
{
    return cuGetProcAddress(sym, pfn, v, fl);
}
static CUresult a_cuGetProcAddress_v2(const char *sym, void **pfn, int v, cuuint64_t fl,
                                      CUdriverProcAddressQueryResult *st)
{
    return cuGetProcAddress_v2(sym, pfn, v, fl, st);
}

enum { ANY, LEGACY, PTDS };
struct entry {
    const char *base;
    void *fn;
    void *alias; /* what FAKE_CUDA_GPA_ALIASES=1 hands out instead, if set */
    int since;
    int stream;
};
#define E(base, fn, since, stream) {base, (void *)fn, NULL, since, stream}
#define A(base, fn, since, stream) {base, (void *)fn, (void *)a_##fn, since, stream}
static const struct entry table[] = {
    A("cuInit", cuInit, 2000, ANY),
    E("cuDriverGetVersion", cuDriverGetVersion, 2020, ANY),
    E("cuDeviceGet", cuDeviceGet, 2000, ANY),
    E("cuDeviceGetCount", cuDeviceGetCount, 2000, ANY),
    E("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain, 7000, ANY),
    E("cuCtxSetCurrent", cuCtxSetCurrent, 4000, ANY),
    E("cuCtxGetDevice", cuCtxGetDevice, 2000, ANY),
    A("cuDeviceTotalMem", cuDeviceTotalMem_v2, 3020, ANY),
    A("cuMemGetInfo", cuMemGetInfo_v2, 3020, ANY),
    A("cuMemAlloc", cuMemAlloc_v2, 3020, ANY),
    E("cuMemAllocPitch", cuMemAllocPitch_v2, 3020, ANY),
    E("cuMemAllocManaged", cuMemAllocManaged, 6000, ANY),
    A("cuMemFree", cuMemFree_v2, 3020, ANY),
    A("cuMemAllocAsync", cuMemAllocAsync, 11020, LEGACY),
    A("cuMemAllocAsync", cuMemAllocAsync_ptsz, 11020, PTDS),
    E("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync, 11020, LEGACY),
    E("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync_ptsz, 11020, PTDS),
    A("cuMemFreeAsync", cuMemFreeAsync, 11020, LEGACY),
    A("cuMemFreeAsync", cuMemFreeAsync_ptsz, 11020, PTDS),
    E("cuMemCreate", cuMemCreate, 10020, ANY),
    E("cuMemRelease", cuMemRelease, 10020, ANY),
    E("cuArrayCreate", cuArrayCreate_v2, 3020, ANY),
    E("cuArray3DCreate", cuArray3DCreate_v2, 3020, ANY),
    E("cuArrayDestroy", cuArrayDestroy, 2000, ANY),
    E("cuMipmappedArrayCreate", cuMipmappedArrayCreate, 5000, ANY),
    E("cuMipmappedArrayDestroy", cuMipmappedArrayDestroy, 5000, ANY),
    A("cuLaunchKernel", cuLaunchKernel, 4000, LEGACY),
    A("cuLaunchKernel", cuLaunchKernel_ptsz, 7000, PTDS),
    E("cuLaunchKernelEx", cuLaunchKernelEx, 11060, LEGACY),
    E("cuLaunchKernelEx", cuLaunchKernelEx_ptsz, 11060, PTDS),
    E("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel, 9000, LEGACY),
    E("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel_ptsz, 9000, PTDS),
    E("cuGraphLaunch", cuGraphLaunch, 10000, LEGACY),
    E("cuGraphLaunch", cuGraphLaunch_ptsz, 10000, PTDS),
    A("cuGetProcAddress", cuGetProcAddress, 11030, ANY),
    A("cuGetProcAddress", cuGetProcAddress_v2, 12000, ANY),
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    int want = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) ? PTDS : LEGACY;
    const struct entry *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        const struct entry *e = &table[i];
        if (strcmp(e->base, symbol) != 0)
            continue;
        known = 1;
        if (e->since > cudaVersion || (e->stream != ANY && e->stream != want))
            continue;
        if (best == NULL || e->since > best->since)
            best = e;
    }
    *pfn = best ? (gpa_aliases && best->alias ? best->alias : best->fn) : NULL;
    if (status != NULL)
        *status = best ? CU_GET_PROC_ADDRESS_SUCCESS
                       : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
