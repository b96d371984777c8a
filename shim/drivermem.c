/*
 * The memory a card gives a process beyond what the process asked for: charged to the
 * container's slice, so that the limit holds as the card (and nvidia-smi) counts.
 *
 * A process's charge on a device, in its region slot, is the sum of
 *   allocations  every allocation family, counted by memory.c when asked for;
 *   pools        per stream-ordered pool, the larger of what the pool has reserved
 *                (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: it keeps freed memory cached
 *                until a synchronisation or a trim) and what is allocated from it;
 *   graphs       CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: memory the driver holds for
 *                graph allocation nodes, reserved at launch or upload, kept until
 *                cuDeviceGraphMemTrim;
 *   driver       everything else the card gives the process: contexts (measured as the
 *                card's used memory across the creation), modules and libraries (the
 *                card's free memory across the load), and whatever the driver takes
 *                without a call saying so (lazy kernel loading, local memory, runtime
 *                buffers).  Whenever NVML can name the process, this part is set from
 *                NVML's own per-process figure: driver = NVML used - the other parts
 *                (never below 0), which also corrects the measured estimates.
 *
 * NVML answers with host pids, which a process in a pid namespace does not know.  The
 * process's own pid is used when NVML lists it (no pid namespace); otherwise the one
 * pid that appeared in the card's list across the process's first context creation.
 * If that is ambiguous (another process started at the same instant) the process is
 * never reconciled and keeps the measured estimates.
 *
 * When it runs: pools and graph memory are sampled at each stream-ordered allocation,
 * free and trim, after a launch or upload of an executable graph other than the last
 * one launched, and whenever the process reports memory.  NVML reconciliation (with
 * the pools and graphs) runs after each context creation, when an allocation would be
 * refused, when an allocation brings the container within an eighth of its limit (at
 * most every 2 ms) and when memory is reported (at most every 10 ms).  None of it runs
 * on the allocation path far from the limit, or at all when nothing is limited.
 */
#include "shim.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_POOLS 64
#define MAX_CONTEXTS 64
#define MAX_MODULES 4096
#define MAX_NVML_PROCS 256

struct pool_rec {
    CUmemoryPool pool; /* NULL: free record */
    int dev;
    uint64_t live;    /* bytes allocated from it and not yet freed, as asked for */
    uint64_t charged; /* what this process's slot holds for it */
};

struct handle_rec {
    uint64_t handle; /* 0: free record */
    int dev;
    uint64_t charged;
};

static pthread_mutex_t acct_lock = PTHREAD_MUTEX_INITIALIZER;
static struct pool_rec pools[MAX_POOLS];
static struct handle_rec contexts[MAX_CONTEXTS];
static struct handle_rec modules[MAX_MODULES];
static uint64_t primary_charged[TESSERA_MAX_DEVICES];
static uint64_t driver_bytes[TESSERA_MAX_DEVICES];
static uint64_t graph_bytes[TESSERA_MAX_DEVICES];
static CUgraphExec last_exec[TESSERA_MAX_DEVICES];
static uint64_t last_reconcile_ns[TESSERA_MAX_DEVICES];
static uint32_t host_pid; /* 0: not known */
static bool host_pid_given_up;

uint32_t tessera_host_pid(void)
{
    return __atomic_load_n(&host_pid, __ATOMIC_ACQUIRE);
}

static uint64_t coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static bool limited(int dev)
{
    return tessera_mem_on && tessera_mem_limit(dev) != 0;
}

/* Move one part of dev's charge to `want` bytes, charging or releasing the difference. */
static void set_part(uint64_t *part, int dev, uint64_t want)
{
    if (want > *part)
        tessera_region_charge(dev, want - *part);
    else if (want < *part)
        tessera_region_release(dev, *part - want);
    *part = want;
}

static void add_part(uint64_t *part, int dev, uint64_t bytes)
{
    set_part(part, dev, *part + bytes);
}

static void sub_part(uint64_t *part, int dev, uint64_t bytes)
{
    set_part(part, dev, *part > bytes ? *part - bytes : 0);
}

/* ------------------------------------------------------------- NVML's view */

/* The processes NVML lists on dev; *n in: room, out: how many (0 when NVML cannot say). */
static void nvml_processes(int dev, nvmlProcessInfo_t *out, unsigned *n)
{
    nvmlDevice_t h = tessera_devmap_nvml(dev);
    unsigned room = *n;
    *n = 0;
    if (h == NULL)
        return;
    unsigned got = room;
    if (REAL(nvmlDeviceGetComputeRunningProcesses_v3)(h, &got, out) == NVML_SUCCESS)
        *n = got < room ? got : room;
}

static bool listed(const nvmlProcessInfo_t *p, unsigned n, uint32_t pid, uint64_t *used)
{
    for (unsigned i = 0; i < n; i++)
        if (p[i].pid == pid) {
            if (used != NULL)
                *used = p[i].usedGpuMemory;
            return true;
        }
    return false;
}

/* Driver part = NVML's figure for this process - the parts counted otherwise, less `pending`
 * bytes reserved for an allocation the driver has not made yet.  Lock held. */
static bool reconcile_locked(int dev, uint64_t pending)
{
    uint32_t pid = tessera_host_pid();
    if (pid == 0)
        return false;
    nvmlProcessInfo_t procs[MAX_NVML_PROCS];
    unsigned n = MAX_NVML_PROCS;
    nvml_processes(dev, procs, &n);
    uint64_t used = 0;
    if (!listed(procs, n, pid, &used) || used == (unsigned long long)NVML_VALUE_NOT_AVAILABLE)
        return false;
    uint64_t own = tessera_region_own_used(dev);
    uint64_t rest = own > driver_bytes[dev] + pending ? own - driver_bytes[dev] - pending : 0;
    set_part(&driver_bytes[dev], dev, used > rest ? used - rest : 0);
    TLOG(TLOG_DEBUG, "device %d: NVML counts %llu bytes for host pid %u, the driver's own part is %llu", dev,
         (unsigned long long)used, pid, (unsigned long long)driver_bytes[dev]);
    return true;
}

/* ------------------------------------------------------------------ pools */

/* What a pool holds now: the larger of its reservation and what is allocated from it. */
static void pool_settle_locked(struct pool_rec *p)
{
    cuuint64_t reserved = 0;
    if (REAL(cuMemPoolGetAttribute)(p->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
        reserved = 0; /* no attribute: what is allocated from it is all that is known */
    set_part(&p->charged, p->dev, reserved > p->live ? reserved : p->live);
}

static void pools_settle_dev_locked(int dev)
{
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool != NULL && pools[i].dev == dev)
            pool_settle_locked(&pools[i]);
}

static void graph_settle_locked(int dev)
{
    cuuint64_t reserved = 0;
    if (REAL(cuDeviceGetGraphMemAttribute)((CUdevice)dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) ==
        CUDA_SUCCESS)
        set_part(&graph_bytes[dev], dev, reserved);
}

int tessera_pool_need(int dev, CUmemoryPool pool, uint64_t bytes, uint64_t *need)
{
    int saved = errno;
    if (pool == NULL && REAL(cuDeviceGetMemPool)(&pool, (CUdevice)dev) != CUDA_SUCCESS)
        pool = NULL;
    int idx = -1;
    pthread_mutex_lock(&acct_lock);
    for (int i = 0; i < MAX_POOLS && pool != NULL; i++)
        if (pools[i].pool == pool) {
            idx = i;
            break;
        }
    for (int i = 0; i < MAX_POOLS && idx < 0 && pool != NULL; i++)
        if (pools[i].pool == NULL) {
            pools[i] = (struct pool_rec){pool, dev, 0, 0};
            idx = i;
        }
    if (idx >= 0) {
        struct pool_rec *p = &pools[idx];
        pool_settle_locked(p);
        /* Served from what the pool already holds, an allocation costs the card nothing more. */
        uint64_t after = p->live + bytes;
        *need = after > p->charged ? after - p->charged : 0;
    }
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
    return idx;
}

void tessera_pool_admitted(int idx, uint64_t bytes, uint64_t need)
{
    pthread_mutex_lock(&acct_lock);
    pools[idx].live += bytes;
    pools[idx].charged += need; /* memory.c reserved it in the slot against the limit */
    pthread_mutex_unlock(&acct_lock);
}

void tessera_pool_settle(int idx)
{
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    if (pools[idx].pool != NULL)
        pool_settle_locked(&pools[idx]);
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
}

void tessera_pool_freed(int idx, uint64_t bytes)
{
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    struct pool_rec *p = &pools[idx];
    p->live = p->live > bytes ? p->live - bytes : 0;
    if (p->pool != NULL)
        pool_settle_locked(p);
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
}

CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    CUresult r = REAL(cuMemPoolTrimTo)(pool, minBytesToKeep);
    if (TESSERA_LIKELY(!tessera_mem_on) || r != CUDA_SUCCESS)
        return r;
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool == pool)
            pool_settle_locked(&pools[i]);
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
    return r;
}

CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = REAL(cuMemPoolDestroy)(pool);
    if (TESSERA_LIKELY(!tessera_mem_on) || r != CUDA_SUCCESS)
        return r;
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool == pool) {
            set_part(&pools[i].charged, pools[i].dev, 0);
            pools[i].pool = NULL; /* its live bytes went with it; the pointers' map entries are stale */
        }
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
    return r;
}

/* ------------------------------------------------------------------ graphs */

static void graph_sample(int dev)
{
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    graph_settle_locked(dev);
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
}

/* A graph's memory is reserved at its first launch; launching the same graph again takes no more. */
void tessera_graph_launched(CUgraphExec exec)
{
    int dev = tessera_current_device();
    if (!limited(dev) || __atomic_load_n(&last_exec[dev], __ATOMIC_RELAXED) == exec)
        return;
    __atomic_store_n(&last_exec[dev], exec, __ATOMIC_RELAXED);
    graph_sample(dev);
}

#define GRAPH_UPLOAD_BODY(realfn)                                      \
    CUresult r = realfn(hGraphExec, hStream);                          \
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS) {       \
        int dev = tessera_current_device();                            \
        if (limited(dev))                                              \
            graph_sample(dev);                                         \
    }                                                                  \
    return r

CUresult CUDAAPI cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    GRAPH_UPLOAD_BODY(REAL(cuGraphUpload));
}

CUresult CUDAAPI cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    GRAPH_UPLOAD_BODY(REAL(cuGraphUpload_ptsz));
}

CUresult CUDAAPI cuDeviceGraphMemTrim(CUdevice device)
{
    CUresult r = REAL(cuDeviceGraphMemTrim)(device);
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS && limited((int)device))
        graph_sample((int)device);
    return r;
}

/* ---------------------------------------------------------------- refresh */

/* Only a process whose CUDA went through cuInit can hold driver memory (nvidia-smi cannot). */
static bool counting(int dev)
{
    return limited(dev) && tessera_devmap_cuda_known();
}

void tessera_drivermem_sample(int dev)
{
    if (!counting(dev))
        return;
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    pools_settle_dev_locked(dev);
    graph_settle_locked(dev);
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
}

bool tessera_drivermem_refresh(int dev, uint64_t interval_ns, uint64_t pending)
{
    if (!counting(dev))
        return false;
    int saved = errno;
    bool ran = false;
    pthread_mutex_lock(&acct_lock);
    uint64_t now = coarse_ns();
    if (interval_ns == 0 || now - last_reconcile_ns[dev] >= interval_ns) {
        last_reconcile_ns[dev] = now;
        pools_settle_dev_locked(dev);
        graph_settle_locked(dev);
        reconcile_locked(dev, pending);
        ran = true;
    }
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
    return ran;
}

/* --------------------------------------------------------------- contexts */

struct ctx_probe {
    bool skip;
    bool have_used;
    unsigned long long used_before;
    unsigned npids;
    nvmlProcessInfo_t pids[MAX_NVML_PROCS];
};

/* Whether dev is limited at all: memory or compute (compute needs the host pid too). */
static bool watched(int dev)
{
    return (unsigned)dev < TESSERA_MAX_DEVICES &&
           (limited(dev) || (tessera_core_mask & (1u << (unsigned)dev)) != 0);
}

static void ctx_probe_before(int dev, bool primary, struct ctx_probe *p);

static void ctx_before(int dev, bool primary, struct ctx_probe *p)
{
    int saved = errno;
    ctx_probe_before(dev, primary, p);
    errno = saved;
}

static void ctx_probe_before(int dev, bool primary, struct ctx_probe *p)
{
    p->skip = !watched(dev);
    p->have_used = false;
    p->npids = 0;
    if (p->skip)
        return;
    if (primary) {
        unsigned flags;
        int active = 0;
        if (REAL(cuDevicePrimaryCtxGetState)((CUdevice)dev, &flags, &active) == CUDA_SUCCESS && active) {
            p->skip = true; /* already there: retaining it again costs nothing */
            return;
        }
    }
    nvmlDevice_t h = tessera_devmap_nvml(dev);
    nvmlMemory_t m;
    if (h != NULL && REAL(nvmlDeviceGetMemoryInfo)(h, &m) == NVML_SUCCESS) {
        p->have_used = true;
        p->used_before = m.used;
    }
    if (tessera_host_pid() == 0 && !host_pid_given_up) {
        p->npids = MAX_NVML_PROCS;
        nvml_processes(dev, p->pids, &p->npids);
    }
}

/* Our host pid: among the pids that appeared across our first context, our own pid (no pid
 * namespace) or else the only one. */
static void learn_host_pid(int dev, const struct ctx_probe *p)
{
    nvmlProcessInfo_t now[MAX_NVML_PROCS];
    unsigned n = MAX_NVML_PROCS;
    nvml_processes(dev, now, &n);
    uint32_t self = (uint32_t)getpid(), found = 0;
    unsigned fresh = 0;
    bool self_fresh = false;
    for (unsigned i = 0; i < n; i++)
        if (!listed(p->pids, p->npids, now[i].pid, NULL)) {
            found = now[i].pid;
            fresh++;
            self_fresh |= now[i].pid == self;
        }
    if (self_fresh || fresh == 1) {
        found = self_fresh ? self : found;
        __atomic_store_n(&host_pid, found, __ATOMIC_RELEASE);
        TLOG(TLOG_INFO, "NVML knows this process as pid %u", found);
    } else if (n > 0) {
        host_pid_given_up = true;
        TLOG(TLOG_INFO, "cannot tell which of %u new NVML processes is this one; the driver's own memory "
             "is estimated, not read from NVML", fresh);
    }
}

static void ctx_after(int dev, bool primary, const struct ctx_probe *p, CUcontext ctx)
{
    if (p->skip)
        return;
    int saved = errno;
    uint64_t measured = 0;
    nvmlDevice_t h = p->have_used ? tessera_devmap_nvml(dev) : NULL;
    nvmlMemory_t m;
    if (h != NULL && REAL(nvmlDeviceGetMemoryInfo)(h, &m) == NVML_SUCCESS && m.used > p->used_before)
        measured = m.used - p->used_before;
    pthread_mutex_lock(&acct_lock);
    if (tessera_host_pid() == 0 && !host_pid_given_up)
        learn_host_pid(dev, p);
    if (limited(dev)) {
        add_part(&driver_bytes[dev], dev, measured);
        if (primary) {
            primary_charged[dev] += measured;
        } else {
            for (int i = 0; i < MAX_CONTEXTS; i++)
                if (contexts[i].handle == 0) {
                    contexts[i] = (struct handle_rec){(uint64_t)(uintptr_t)ctx, dev, measured};
                    break;
                }
        }
        last_reconcile_ns[dev] = coarse_ns();
        reconcile_locked(dev, 0);
    }
    pthread_mutex_unlock(&acct_lock);
    TLOG(TLOG_DEBUG, "device %d: a context took %llu bytes", dev, (unsigned long long)measured);
    errno = saved;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    __typeof__(&cuDevicePrimaryCtxRetain) real = REAL(cuDevicePrimaryCtxRetain);
    tessera_ensure_init();
    if (TESSERA_LIKELY(!tessera_mem_on && tessera_core_mask == 0))
        return real(pctx, dev);
    struct ctx_probe probe;
    ctx_before((int)dev, true, &probe);
    CUresult r = real(pctx, dev);
    if (r == CUDA_SUCCESS)
        ctx_after((int)dev, true, &probe, pctx != NULL ? *pctx : NULL);
    return r;
}

/* After a release or reset: if the primary context is gone, so is what it took. */
static void primary_maybe_gone(int dev)
{
    if (!limited(dev))
        return;
    int saved = errno;
    unsigned flags;
    int active = 1;
    if (REAL(cuDevicePrimaryCtxGetState)((CUdevice)dev, &flags, &active) == CUDA_SUCCESS && !active) {
        pthread_mutex_lock(&acct_lock);
        sub_part(&driver_bytes[dev], dev, primary_charged[dev]);
        primary_charged[dev] = 0;
        pthread_mutex_unlock(&acct_lock);
    }
    errno = saved;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUresult r = REAL(cuDevicePrimaryCtxRelease_v2)(dev);
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS)
        primary_maybe_gone((int)dev);
    return r;
}

CUresult CUDAAPI cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    CUresult r = REAL(cuDevicePrimaryCtxReset_v2)(dev);
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS)
        primary_maybe_gone((int)dev);
    return r;
}

#define CTX_CREATE_BODY(realfn, ...)                                   \
    tessera_ensure_init();                                             \
    if (TESSERA_LIKELY(!tessera_mem_on && tessera_core_mask == 0))     \
        return realfn(__VA_ARGS__);                                    \
    struct ctx_probe probe;                                            \
    ctx_before((int)dev, false, &probe);                               \
    CUresult r = realfn(__VA_ARGS__);                                  \
    if (r == CUDA_SUCCESS)                                             \
        ctx_after((int)dev, false, &probe, pctx != NULL ? *pctx : NULL); \
    return r

CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    __typeof__(&cuCtxCreate_v2) real = REAL(cuCtxCreate_v2);
    CTX_CREATE_BODY(real, pctx, flags, dev);
}

CUresult CUDAAPI cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                                CUdevice dev)
{
    __typeof__(&cuCtxCreate_v3) real = REAL(cuCtxCreate_v3);
    CTX_CREATE_BODY(real, pctx, paramsArray, numParams, flags, dev);
}

#if CUDA_VERSION >= 12050
CUresult CUDAAPI cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                CUdevice dev)
{
    __typeof__(&cuCtxCreate_v4) real = REAL(cuCtxCreate_v4);
    CTX_CREATE_BODY(real, pctx, ctxCreateParams, flags, dev);
}
#endif

/* Give back what was charged for handle in table (contexts or modules). */
static void forget_handle(struct handle_rec *table, int size, uint64_t handle)
{
    int saved = errno;
    pthread_mutex_lock(&acct_lock);
    for (int i = 0; i < size; i++)
        if (handle != 0 && table[i].handle == handle) {
            sub_part(&driver_bytes[table[i].dev], table[i].dev, table[i].charged);
            table[i].handle = 0;
            break;
        }
    pthread_mutex_unlock(&acct_lock);
    errno = saved;
}

CUresult CUDAAPI cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult r = REAL(cuCtxDestroy_v2)(ctx);
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS)
        forget_handle(contexts, MAX_CONTEXTS, (uint64_t)(uintptr_t)ctx);
    return r;
}

/* ---------------------------------------------------------------- modules */

struct module_probe {
    int dev;
    size_t free_before;
    bool ok;
};

static void module_before(struct module_probe *p)
{
    p->ok = false;
    if (TESSERA_LIKELY(!tessera_mem_on))
        return;
    int saved = errno;
    p->dev = tessera_current_device();
    size_t total;
    p->ok = limited(p->dev) && REAL(cuMemGetInfo_v2)(&p->free_before, &total) == CUDA_SUCCESS;
    errno = saved;
}

static void module_after(const struct module_probe *p, CUresult r, uint64_t handle)
{
    if (!p->ok || r != CUDA_SUCCESS)
        return;
    int saved = errno;
    size_t free_after = 0, total;
    if (REAL(cuMemGetInfo_v2)(&free_after, &total) == CUDA_SUCCESS && free_after < p->free_before) {
        uint64_t took = p->free_before - free_after;
        pthread_mutex_lock(&acct_lock);
        add_part(&driver_bytes[p->dev], p->dev, took);
        for (int i = 0; i < MAX_MODULES; i++)
            if (modules[i].handle == 0) {
                modules[i] = (struct handle_rec){handle, p->dev, took};
                break;
            }
        pthread_mutex_unlock(&acct_lock);
    }
    errno = saved;
}

#define MODULE_LOAD_BODY(realfn, out, ...)                             \
    struct module_probe probe;                                         \
    module_before(&probe);                                             \
    CUresult r = realfn(__VA_ARGS__);                                  \
    module_after(&probe, r, (out) != NULL ? (uint64_t)(uintptr_t) * (out) : 0); \
    return r

CUresult CUDAAPI cuModuleLoad(CUmodule *module, const char *fname)
{
    MODULE_LOAD_BODY(REAL(cuModuleLoad), module, module, fname);
}

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image)
{
    MODULE_LOAD_BODY(REAL(cuModuleLoadData), module, module, image);
}

CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                    CUjit_option *options, void **optionValues)
{
    MODULE_LOAD_BODY(REAL(cuModuleLoadDataEx), module, module, image, numOptions, options, optionValues);
}

CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    MODULE_LOAD_BODY(REAL(cuModuleLoadFatBinary), module, module, fatCubin);
}

CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                   void **jitOptionsValues, unsigned int numJitOptions,
                                   CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                   unsigned int numLibraryOptions)
{
    MODULE_LOAD_BODY(REAL(cuLibraryLoadData), library, library, code, jitOptions, jitOptionsValues, numJitOptions,
                     libraryOptions, libraryOptionValues, numLibraryOptions);
}

CUresult CUDAAPI cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                       void **jitOptionsValues, unsigned int numJitOptions,
                                       CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                       unsigned int numLibraryOptions)
{
    MODULE_LOAD_BODY(REAL(cuLibraryLoadFromFile), library, library, fileName, jitOptions, jitOptionsValues,
                     numJitOptions, libraryOptions, libraryOptionValues, numLibraryOptions);
}

CUresult CUDAAPI cuModuleUnload(CUmodule hmod)
{
    CUresult r = REAL(cuModuleUnload)(hmod);
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS)
        forget_handle(modules, MAX_MODULES, (uint64_t)(uintptr_t)hmod);
    return r;
}

CUresult CUDAAPI cuLibraryUnload(CUlibrary library)
{
    CUresult r = REAL(cuLibraryUnload)(library);
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS)
        forget_handle(modules, MAX_MODULES, (uint64_t)(uintptr_t)library);
    return r;
}

/* ------------------------------------------------------------------- fork */

void tessera_drivermem_after_fork_child(void)
{
    /* CUDA does not survive fork: the child has no context, pool, module or graph yet. */
    pthread_mutex_init(&acct_lock, NULL);
    memset(pools, 0, sizeof pools);
    memset(contexts, 0, sizeof contexts);
    memset(modules, 0, sizeof modules);
    memset(primary_charged, 0, sizeof primary_charged);
    memset(driver_bytes, 0, sizeof driver_bytes);
    memset(graph_bytes, 0, sizeof graph_bytes);
    memset(last_exec, 0, sizeof last_exec);
    memset(last_reconcile_ns, 0, sizeof last_reconcile_ns);
    host_pid = 0;
    host_pid_given_up = false;
}
