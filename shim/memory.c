/*
 * Memory hooks: count every device allocation against the container's limit
 * and report the slice instead of the card.
 *
 * Order matters: room is reserved in the shared region before the driver is
 * called (so a refusal never reaches the driver) and given back when the
 * driver fails; an allocation leaves the local map before the driver frees it
 * (so an address the driver hands out again cannot be confused with it).
 *
 * Virtual device memory: on a device whose resident part is below its limit, a plain
 * allocation that would take the container's memory on the card past the resident part is
 * served by cuMemAllocManaged instead (the driver may then page it out to host memory) and
 * counted as spilled; families that cannot be made managed are refused past the resident part.
 */
#include "shim.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------ local map of allocations */

enum alloc_kind { KIND_EMPTY = 0, KIND_PTR = 1, KIND_ARRAY = 2, KIND_MIPMAP = 3, KIND_VMM = 4, KIND_TOMB = 255 };

struct alloc_entry {
    uint64_t key;
    uint64_t size;
    uint32_t dev;
    uint32_t kind;
    int32_t pool; /* drivermem.c's record of the pool it came from, -1: counted by itself */
    uint32_t spilled; /* 1: served as managed memory past the resident part, counted as spilled */
};

/* A spinlock: the critical sections are a few loads and stores, and an uncontended
 * acquire/release pair costs one atomic exchange instead of a mutex's two RMWs. */
static int map_lock;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline void map_lock_acquire(void)
{
    while (__atomic_exchange_n(&map_lock, 1, __ATOMIC_ACQUIRE) != 0) {
        for (int spins = 0; __atomic_load_n(&map_lock, __ATOMIC_RELAXED) != 0; spins++)
            if (spins > 64)
                sched_yield();
            else
                cpu_relax();
    }
}

static inline void map_lock_release(void)
{
    __atomic_store_n(&map_lock, 0, __ATOMIC_RELEASE);
}
static struct alloc_entry *map_slots;
static size_t map_cap;   /* power of two */
static size_t map_used;  /* live + tombstones */
static size_t map_live;

static inline size_t map_hash(uint64_t key, uint32_t kind)
{
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17);
}

static int map_grow(void)
{
    size_t ncap = map_cap ? (map_live * 4 > map_cap ? map_cap * 2 : map_cap) : 1024;
    struct alloc_entry *n = calloc(ncap, sizeof *n);
    if (n == NULL)
        return -1;
    for (size_t i = 0; i < map_cap; i++) {
        struct alloc_entry *e = &map_slots[i];
        if (e->kind == KIND_EMPTY || e->kind == KIND_TOMB)
            continue;
        size_t j = map_hash(e->key, e->kind) & (ncap - 1);
        while (n[j].kind != KIND_EMPTY)
            j = (j + 1) & (ncap - 1);
        n[j] = *e;
    }
    free(map_slots);
    map_slots = n;
    map_cap = ncap;
    map_used = map_live;
    return 0;
}

static void give_back(const struct alloc_entry *e);

/* Returns -1 when memory for the map itself cannot be had. */
static int map_put(const struct alloc_entry *in)
{
    uint32_t kind = in->kind;
    uint64_t key = in->key;
    int saved = errno;
    int rc = 0;
    map_lock_acquire();
    if ((map_used + 1) * 2 > map_cap && map_grow() != 0) {
        rc = -1;
        goto out;
    }
    size_t mask = map_cap - 1, i = map_hash(key, kind) & mask, tomb = SIZE_MAX;
    for (;; i = (i + 1) & mask) {
        struct alloc_entry *e = &map_slots[i];
        if (e->kind == KIND_EMPTY)
            break;
        if (e->kind == KIND_TOMB) {
            if (tomb == SIZE_MAX)
                tomb = i;
        } else if (e->kind == kind && e->key == key) {
            /* The driver handed out a key we still track: it was freed behind our back. */
            if (e->pool < 0)
                give_back(e);
            *e = *in;
            goto out;
        }
    }
    if (tomb != SIZE_MAX)
        i = tomb;
    else
        map_used++;
    map_slots[i] = *in;
    map_live++;
out:
    map_lock_release();
    errno = saved;
    return rc;
}

static bool map_take(uint32_t kind, uint64_t key, struct alloc_entry *out)
{
    bool found = false;
    map_lock_acquire();
    if (map_cap != 0) {
        size_t mask = map_cap - 1;
        for (size_t i = map_hash(key, kind) & mask;; i = (i + 1) & mask) {
            struct alloc_entry *e = &map_slots[i];
            if (e->kind == KIND_EMPTY)
                break;
            if (e->kind == kind && e->key == key) {
                *out = *e;
                e->kind = KIND_TOMB;
                map_live--;
                found = true;
                break;
            }
        }
    }
    map_lock_release();
    return found;
}

void tessera_memory_after_fork_child(void)
{
    /* The child inherits no device memory; forget the parent's (leaking the old table is fine). */
    map_lock = 0;
    map_slots = NULL;
    map_cap = map_used = map_live = 0;
}

/* --------------------------------------------------------------- helpers */

uint64_t tessera_mem_limit(int dev)
{
    if ((unsigned)dev >= TESSERA_MAX_DEVICES)
        return 0;
    return __atomic_load_n(&tessera_cfg.mem_limit[dev], __ATOMIC_RELAXED);
}

int tessera_current_device(void)
{
    CUdevice d = 0;
    if (REAL(cuCtxGetDevice)(&d) != CUDA_SUCCESS)
        return 0; /* no context: the driver will refuse the call itself */
    return (int)d;
}

/* Within an eighth of the limit the driver's own memory, which grows without a call saying
 * so, decides what is left: look at it again, at most this often. */
#define NEAR_LIMIT_REFRESH_NS 2000000u
#define REPORT_REFRESH_NS 10000000u

static bool reserve_slow(int dev, uint64_t bytes, uint64_t limit, bool admitted);

/* Room for bytes on dev, or false (logged at info level) when the limit says no. */
static inline bool reserve(int dev, uint64_t bytes)
{
    uint64_t limit = tessera_mem_limit(dev), total;
    bool ok = tessera_region_reserve(dev, bytes, limit, &total);
    if (TESSERA_LIKELY(ok && total <= limit - (limit >> 3)))
        return true;
    return reserve_slow(dev, bytes, limit, ok);
}

static bool reserve_slow(int dev, uint64_t bytes, uint64_t limit, bool admitted)
{
    uint64_t total;
    if (admitted) {
        if (!tessera_drivermem_refresh(dev, NEAR_LIMIT_REFRESH_NS, bytes) || tessera_region_used(dev) <= limit)
            return true;
        tessera_region_release(dev, bytes); /* the driver's own memory grew: there is no room after all */
    }
    /* A stale pool cache or estimate may be all that stands in the way. */
    if (tessera_drivermem_refresh(dev, 0, 0) && tessera_region_reserve(dev, bytes, limit, &total))
        return true;
    TLOG(TLOG_INFO, "refused %llu bytes on device %d: limit %llu, in use %llu", (unsigned long long)bytes, dev,
         (unsigned long long)limit, (unsigned long long)tessera_region_used(dev));
    return false;
}

/* What freeing e gives back: its own count (and its spilled mark), or its share of the pool it came from. */
static inline void give_back(const struct alloc_entry *e)
{
    if (TESSERA_LIKELY(e->pool < 0 && !e->spilled))
        tessera_region_release((int)e->dev, e->size);
    else if (e->pool < 0)
        tessera_region_release_spilled((int)e->dev, e->size);
    else
        tessera_pool_freed(e->pool, e->size);
}

static inline void track_entry(const struct alloc_entry *e)
{
    if (map_put(e) != 0) {
        /* Cannot remember it, so cannot uncount it later: uncount now rather than leak the limit. */
        give_back(e);
        TLOG(TLOG_WARN, "out of host memory for bookkeeping; an allocation of %llu bytes is not counted",
             (unsigned long long)e->size);
    }
}

static inline void track_in(uint32_t kind, uint64_t key, uint64_t bytes, int dev, int pool)
{
    struct alloc_entry e = {key, bytes, (uint32_t)dev, kind, pool, 0};
    track_entry(&e);
}

static inline void track(uint32_t kind, uint64_t key, uint64_t bytes, int dev)
{
    track_in(kind, key, bytes, dev, -1);
}

/* Give an entry back to the map when the driver refused to free it. */
static inline void retrack(const struct alloc_entry *e)
{
    (void)map_put(e);
}

/* ------------------------------------------------- virtual device memory */

/* After bytes were reserved on oversubscribed dev: when the container's memory on the card now
 * passes the resident part, mark them spilled (to be served managed) and say so. */
static bool spill_if_past_resident(int dev, uint64_t bytes)
{
    if (tessera_region_resident(dev) <= __atomic_load_n(&tessera_cfg.mem_resident[dev], __ATOMIC_RELAXED))
        return false;
    tessera_region_spill(dev, bytes);
    return true;
}

/* Undo a reservation of bytes, spilled or not, when the driver did not make the allocation. */
static void unreserve(int dev, uint64_t bytes, bool spilled)
{
    if (spilled)
        tessera_region_release_spilled(dev, bytes);
    else
        tessera_region_release(dev, bytes);
}

/* Room for bytes that must stay on the card (pools, virtual memory, arrays): within the limit,
 * and on an oversubscribed device within the resident part too. */
static bool reserve_on_card(int dev, uint64_t bytes)
{
    if (!reserve(dev, bytes))
        return false;
    if (TESSERA_LIKELY(!tessera_oversubscribed(dev)))
        return true;
    uint64_t resident = __atomic_load_n(&tessera_cfg.mem_resident[dev], __ATOMIC_RELAXED);
    if (tessera_region_resident(dev) <= resident)
        return true;
    tessera_region_release(dev, bytes);
    TLOG(TLOG_INFO, "refused %llu bytes on device %d: this kind of allocation cannot spill to host memory and "
         "the resident part, %llu bytes, is in use", (unsigned long long)bytes, dev, (unsigned long long)resident);
    return false;
}

#define OFF_OR_UNLIMITED(dev) (!tessera_mem_on || tessera_mem_limit(dev) == 0)

/* ----------------------------------------------------- linear allocations */

CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    __typeof__(&cuMemAlloc_v2) real = REAL(cuMemAlloc_v2);
    tessera_ensure_init();
    if (TESSERA_LIKELY(!tessera_mem_on))
        return real(dptr, bytesize);
    int dev = tessera_current_device();
    if (tessera_mem_limit(dev) == 0)
        return real(dptr, bytesize);
    if (!reserve(dev, bytesize))
        return CUDA_ERROR_OUT_OF_MEMORY;
    bool spilled = tessera_oversubscribed(dev) && spill_if_past_resident(dev, bytesize);
    CUresult r = spilled ? REAL(cuMemAllocManaged)(dptr, bytesize, CU_MEM_ATTACH_GLOBAL) : real(dptr, bytesize);
    if (r != CUDA_SUCCESS || dptr == NULL) {
        unreserve(dev, bytesize, spilled);
        return r;
    }
    struct alloc_entry e = {(uint64_t)*dptr, bytesize, (uint32_t)dev, KIND_PTR, -1, spilled};
    track_entry(&e);
    return r;
}

CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    __typeof__(&cuMemAllocManaged) real = REAL(cuMemAllocManaged);
    tessera_ensure_init();
    if (TESSERA_LIKELY(!tessera_mem_on))
        return real(dptr, bytesize, flags);
    /* Counted in full on the current device: pages may all migrate there.  Past the resident
     * part of an oversubscribed device it is spilled, as a redirected allocation is. */
    int dev = tessera_current_device();
    if (tessera_mem_limit(dev) == 0)
        return real(dptr, bytesize, flags);
    if (!reserve(dev, bytesize))
        return CUDA_ERROR_OUT_OF_MEMORY;
    bool spilled = tessera_oversubscribed(dev) && spill_if_past_resident(dev, bytesize);
    CUresult r = real(dptr, bytesize, flags);
    if (r != CUDA_SUCCESS || dptr == NULL) {
        unreserve(dev, bytesize, spilled);
        return r;
    }
    struct alloc_entry e = {(uint64_t)*dptr, bytesize, (uint32_t)dev, KIND_PTR, -1, spilled};
    track_entry(&e);
    return r;
}

/*
 * A pitched allocation past the resident part, served as managed memory: the shim picks the pitch
 * (the width rounded up to PITCH_ALIGN, which suits every element size cuMemAllocPitch takes and
 * cuMemcpy2D's alignment rules), reserves what that adds to the est already reserved, and asks
 * the driver's own question of the arguments first.
 */
#define PITCH_ALIGN 512u
static CUresult pitch_managed(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height, unsigned elem, int dev,
                              uint64_t est)
{
    if (dptr == NULL || pPitch == NULL || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16)) {
        tessera_region_release(dev, est);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t pitch = ((uint64_t)width + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN, bytes;
    if (__builtin_mul_overflow(pitch, (uint64_t)height, &bytes) || (bytes > est && !reserve(dev, bytes - est))) {
        tessera_region_release(dev, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    tessera_region_spill(dev, bytes);
    CUresult r = REAL(cuMemAllocManaged)(dptr, (size_t)bytes, CU_MEM_ATTACH_GLOBAL);
    if (r != CUDA_SUCCESS) {
        tessera_region_release_spilled(dev, bytes);
        return r;
    }
    *pPitch = (size_t)pitch;
    struct alloc_entry e = {(uint64_t)*dptr, bytes, (uint32_t)dev, KIND_PTR, -1, 1};
    track_entry(&e);
    return r;
}

CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                    unsigned int ElementSizeBytes)
{
    __typeof__(&cuMemAllocPitch_v2) real = REAL(cuMemAllocPitch_v2);
    tessera_ensure_init();
    if (TESSERA_LIKELY(!tessera_mem_on))
        return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    int dev = tessera_current_device();
    if (tessera_mem_limit(dev) == 0)
        return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* The pitch is chosen by the driver: reserve the lower bound, then settle the difference. */
    uint64_t est = (uint64_t)WidthInBytes * Height;
    if (Height != 0 && est / Height != WidthInBytes)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!reserve(dev, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (tessera_oversubscribed(dev) &&
        tessera_region_resident(dev) > __atomic_load_n(&tessera_cfg.mem_resident[dev], __ATOMIC_RELAXED))
        return pitch_managed(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, dev, est);
    CUresult r = real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS || dptr == NULL || pPitch == NULL) {
        tessera_region_release(dev, est);
        return r;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > est && !reserve(dev, actual - est)) {
        REAL(cuMemFree_v2)(*dptr);
        tessera_region_release(dev, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < est)
        tessera_region_release(dev, est - actual);
    track(KIND_PTR, (uint64_t)*dptr, actual, dev);
    return r;
}

CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr)
{
    __typeof__(&cuMemFree_v2) real = REAL(cuMemFree_v2);
    if (TESSERA_LIKELY(!tessera_mem_on))
        return real(dptr);
    struct alloc_entry e;
    bool had = map_take(KIND_PTR, (uint64_t)dptr, &e);
    CUresult r = real(dptr);
    if (!had)
        return r;
    if (r == CUDA_SUCCESS)
        give_back(&e);
    else
        retrack(&e);
    return r;
}

/* --------------------------------------------------- stream-ordered (async) */

/*
 * Stream-ordered allocations come from a pool, which keeps what is freed for reuse until
 * a synchronisation or a trim.  The pool is charged as a whole (drivermem.c): an
 * allocation the pool can serve from what it holds costs nothing more; one it cannot is
 * refused when the growth would pass the limit.  Without a pool record (table full), the
 * allocation is counted by itself, from the call until its free is enqueued.
 */
#define ASYNC_ALLOC_BODY(realfn, pool, ...)                               \
    tessera_ensure_init();                                                \
    if (TESSERA_LIKELY(!tessera_mem_on))                                  \
        return realfn(__VA_ARGS__);                                       \
    int dev = tessera_current_device();                                   \
    if (tessera_mem_limit(dev) == 0)                                      \
        return realfn(__VA_ARGS__);                                       \
    uint64_t need = bytesize;                                             \
    int pi = tessera_pool_need(dev, (pool), bytesize, &need);             \
    if (need != 0 && !reserve_on_card(dev, need)) /* from the cache: costs nothing */ \
        return CUDA_ERROR_OUT_OF_MEMORY;                                  \
    if (pi >= 0)                                                          \
        tessera_pool_admitted(pi, bytesize, need);                        \
    CUresult r = realfn(__VA_ARGS__);                                     \
    if (r != CUDA_SUCCESS || dptr == NULL) {                              \
        struct alloc_entry undo = {0, pi >= 0 ? bytesize : need, (uint32_t)dev, KIND_PTR, pi, 0}; \
        give_back(&undo);                                                 \
        return r;                                                         \
    }                                                                     \
    track_in(KIND_PTR, (uint64_t)*dptr, bytesize, dev, pi);               \
    if (pi >= 0)                                                          \
        tessera_pool_settle(pi); /* the pool's growth may differ from the estimate */ \
    return r

CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    __typeof__(&cuMemAllocAsync) real = REAL(cuMemAllocAsync);
    ASYNC_ALLOC_BODY(real, NULL, dptr, bytesize, hStream);
}

CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    __typeof__(&cuMemAllocAsync_ptsz) real = REAL(cuMemAllocAsync_ptsz);
    ASYNC_ALLOC_BODY(real, NULL, dptr, bytesize, hStream);
}

CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    __typeof__(&cuMemAllocFromPoolAsync) real = REAL(cuMemAllocFromPoolAsync);
    ASYNC_ALLOC_BODY(real, pool, dptr, bytesize, pool, hStream);
}

CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                              CUstream hStream)
{
    __typeof__(&cuMemAllocFromPoolAsync_ptsz) real = REAL(cuMemAllocFromPoolAsync_ptsz);
    ASYNC_ALLOC_BODY(real, pool, dptr, bytesize, pool, hStream);
}

#define FREE_BODY(realfn, kind, key, ...)                                 \
    if (TESSERA_LIKELY(!tessera_mem_on))                                  \
        return realfn(__VA_ARGS__);                                       \
    struct alloc_entry e;                                                 \
    bool had = map_take((kind), (uint64_t)(key), &e);                     \
    CUresult r = realfn(__VA_ARGS__);                                     \
    if (had) {                                                            \
        if (r == CUDA_SUCCESS)                                            \
            give_back(&e);                                                \
        else                                                              \
            retrack(&e);                                                  \
    }                                                                     \
    return r

CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    __typeof__(&cuMemFreeAsync) real = REAL(cuMemFreeAsync);
    FREE_BODY(real, KIND_PTR, dptr, dptr, hStream);
}

CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    __typeof__(&cuMemFreeAsync_ptsz) real = REAL(cuMemFreeAsync_ptsz);
    FREE_BODY(real, KIND_PTR, dptr, dptr, hStream);
}

/* ---------------------------------------------------------- virtual memory */

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags)
{
    __typeof__(&cuMemCreate) real = REAL(cuMemCreate);
    tessera_ensure_init();
    /* Only physical memory on a device counts; host and host-NUMA locations do not. */
    if (TESSERA_LIKELY(!tessera_mem_on) || prop == NULL || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(handle, size, prop, flags);
    int dev = prop->location.id;
    if (tessera_mem_limit(dev) == 0)
        return real(handle, size, prop, flags);
    if (!reserve_on_card(dev, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(handle, size, prop, flags);
    if (r != CUDA_SUCCESS || handle == NULL) {
        tessera_region_release(dev, size);
        return r;
    }
    track(KIND_VMM, (uint64_t)*handle, size, dev);
    return r;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
    __typeof__(&cuMemRelease) real = REAL(cuMemRelease);
    FREE_BODY(real, KIND_VMM, handle, handle);
}

/* ------------------------------------------------------------------ arrays */

static uint64_t format_bytes(CUarray_format f)
{
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
    case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X1:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
    case CU_AD_FORMAT_UNORM_INT8X2:
    case CU_AD_FORMAT_SNORM_INT8X2:
    case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
    case CU_AD_FORMAT_UNORM_INT8X4:
    case CU_AD_FORMAT_SNORM_INT8X4:
    case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X2:
        return 4;
    case CU_AD_FORMAT_UNORM_INT16X4:
    case CU_AD_FORMAT_SNORM_INT16X4:
        return 8;
    default:
        return 4; /* packed, planar and block-compressed formats: at most 4 bytes per element and channel */
    }
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, unsigned channels, CUarray_format f)
{
    uint64_t n = mul_sat(mul_sat(w ? w : 1, h ? h : 1), d ? d : 1);
    return mul_sat(n, mul_sat(channels ? channels : 1, format_bytes(f)));
}

#define ARRAY_CREATE_BODY(realfn, kind, bytes, ...)                       \
    tessera_ensure_init();                                                \
    if (TESSERA_LIKELY(!tessera_mem_on) || pHandle == NULL || desc == NULL) \
        return realfn(__VA_ARGS__);                                       \
    int dev = tessera_current_device();                                   \
    if (tessera_mem_limit(dev) == 0)                                      \
        return realfn(__VA_ARGS__);                                       \
    uint64_t need = (bytes);                                              \
    if (!reserve_on_card(dev, need))                                      \
        return CUDA_ERROR_OUT_OF_MEMORY;                                  \
    CUresult r = realfn(__VA_ARGS__);                                     \
    if (r != CUDA_SUCCESS) {                                              \
        tessera_region_release(dev, need);                                \
        return r;                                                         \
    }                                                                     \
    track((kind), (uint64_t)(uintptr_t)*pHandle, need, dev);              \
    return r

CUresult CUDAAPI cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    __typeof__(&cuArrayCreate_v2) real = REAL(cuArrayCreate_v2);
    const CUDA_ARRAY_DESCRIPTOR *desc = pAllocateArray;
    ARRAY_CREATE_BODY(real, KIND_ARRAY, array_bytes(desc->Width, desc->Height, 1, desc->NumChannels, desc->Format),
                      pHandle, pAllocateArray);
}

CUresult CUDAAPI cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    __typeof__(&cuArray3DCreate_v2) real = REAL(cuArray3DCreate_v2);
    const CUDA_ARRAY3D_DESCRIPTOR *desc = pAllocateArray;
    ARRAY_CREATE_BODY(real, KIND_ARRAY,
                      array_bytes(desc->Width, desc->Height, desc->Depth, desc->NumChannels, desc->Format),
                      pHandle, pAllocateArray);
}

/* Levels halve width, height and (unless layered) depth, never below 1. */
static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    uint64_t total = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    bool layered = (d->Flags & CUDA_ARRAY3D_LAYERED) != 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t add = array_bytes(w, h, z, d->NumChannels, d->Format);
        total = total + add < total ? UINT64_MAX : total + add;
        w = w > 1 ? w / 2 : w;
        h = h > 1 ? h / 2 : h;
        if (!layered)
            z = z > 1 ? z / 2 : z;
    }
    return total;
}

CUresult CUDAAPI cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                        unsigned int numMipmapLevels)
{
    __typeof__(&cuMipmappedArrayCreate) real = REAL(cuMipmappedArrayCreate);
    const CUDA_ARRAY3D_DESCRIPTOR *desc = pMipmappedArrayDesc;
    ARRAY_CREATE_BODY(real, KIND_MIPMAP, mipmap_bytes(desc, numMipmapLevels), pHandle, pMipmappedArrayDesc,
                      numMipmapLevels);
}

CUresult CUDAAPI cuArrayDestroy(CUarray hArray)
{
    __typeof__(&cuArrayDestroy) real = REAL(cuArrayDestroy);
    FREE_BODY(real, KIND_ARRAY, (uintptr_t)hArray, hArray);
}

CUresult CUDAAPI cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    __typeof__(&cuMipmappedArrayDestroy) real = REAL(cuMipmappedArrayDestroy);
    FREE_BODY(real, KIND_MIPMAP, (uintptr_t)hMipmappedArray, hMipmappedArray);
}

/* --------------------------------------------------------------- reporting */

/* total = min(limit, card); free = min(total - used, card free), never negative.  An
 * oversubscribed device: total = the limit, which may pass the card (what does not fit spills to
 * host memory), and free = total - used, never negative. */
static void clamp_report(int dev, uint64_t limit, uint64_t used, uint64_t card_total, uint64_t card_free,
                         uint64_t *total_out, uint64_t *free_out)
{
    bool over = tessera_oversubscribed(dev);
    uint64_t total = limit < card_total || over ? limit : card_total;
    uint64_t free = used < total ? total - used : 0;
    if (free > card_free && !over)
        free = card_free;
    *total_out = total;
    *free_out = free;
}

CUresult CUDAAPI cuMemGetInfo_v2(size_t *free, size_t *total)
{
    __typeof__(&cuMemGetInfo_v2) real = REAL(cuMemGetInfo_v2);
    tessera_ensure_init();
    CUresult r = real(free, total);
    if (TESSERA_LIKELY(!tessera_mem_on) || r != CUDA_SUCCESS || free == NULL || total == NULL)
        return r;
    int dev = tessera_current_device();
    uint64_t limit = tessera_mem_limit(dev);
    if (limit == 0)
        return r;
    uint64_t t, f;
    tessera_region_reap_if_due();
    tessera_drivermem_sample(dev);
    tessera_drivermem_refresh(dev, REPORT_REFRESH_NS, 0);
    clamp_report(dev, limit, tessera_region_used(dev), *total, *free, &t, &f);
    *total = (size_t)t;
    *free = (size_t)f;
    return r;
}

CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    __typeof__(&cuDeviceTotalMem_v2) real = REAL(cuDeviceTotalMem_v2);
    tessera_ensure_init();
    CUresult r = real(bytes, dev);
    if (TESSERA_LIKELY(!tessera_mem_on) || r != CUDA_SUCCESS || bytes == NULL)
        return r;
    uint64_t limit = tessera_mem_limit((int)dev);
    if (limit != 0 && (limit < *bytes || tessera_oversubscribed((int)dev)))
        *bytes = (size_t)limit;
    return r;
}

/* The slice as NVML should report it for `device` whose card holds `total` bytes: true and
 * t and f filled when the device is limited, false to leave the driver's answer alone. */
static bool nvml_slice(nvmlDevice_t device, uint64_t total, uint64_t *t, uint64_t *f)
{
    int dev = tessera_devmap_ordinal(device); /* by the card's identity: NVML's order is not CUDA's */
    uint64_t limit = tessera_mem_limit(dev);
    if (dev < 0 || limit == 0)
        return false;
    tessera_region_reap_if_due();
    tessera_drivermem_sample(dev);
    tessera_drivermem_refresh(dev, REPORT_REFRESH_NS, 0);
    clamp_report(dev, limit, tessera_region_used(dev), total, UINT64_MAX, t, f);
    return true;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo) real = REAL(nvmlDeviceGetMemoryInfo);
    tessera_ensure_init();
    nvmlReturn_t r = real(device, memory);
    uint64_t t, f;
    if (TESSERA_LIKELY(!tessera_mem_on) || r != NVML_SUCCESS || memory == NULL ||
        !nvml_slice(device, memory->total, &t, &f))
        return r;
    memory->total = t;
    memory->free = f;
    memory->used = t - f;
    return r;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) real = REAL(nvmlDeviceGetMemoryInfo_v2);
    tessera_ensure_init();
    nvmlReturn_t r = real(device, memory);
    uint64_t t, f;
    if (TESSERA_LIKELY(!tessera_mem_on) || r != NVML_SUCCESS || memory == NULL ||
        !nvml_slice(device, memory->total, &t, &f))
        return r;
    memory->total = t;
    memory->reserved = 0; /* the driver's reservation is outside the slice */
    memory->free = f;
    memory->used = t - f;
    return r;
}
