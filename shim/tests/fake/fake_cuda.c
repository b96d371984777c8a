/*
 * A stand-in for libcuda.so.1: enough of the driver API for the shim's tests, the
 * benchmark and the proof kit's own tests.  Memory is bookkeeping only (no real
 * device), but it is booked the way a card books it: contexts, modules, pool and
 * graph reservations and memory the driver takes on its own all use the card, and
 * all of it shows in the state the fake NVML reports (fake.h, struct fake_gpu_state).
 *
 * FAKE_CUDA_MEM_MIB      size of each fake card in MiB (default 16384)
 * FAKE_CUDA_DEVICES      number of physical cards (default 1, at most 4)
 * FAKE_GPU_UUIDS         the physical cards' UUIDs, comma-separated (default: FAKE_UUID_FMT's)
 * CUDA_VISIBLE_DEVICES   as CUDA reads it: full "GPU-..." UUIDs or physical indices, in the
 *                        order that becomes the CUDA ordinals (so CUDA's order can differ
 *                        from NVML's, which is always the physical order)
 * FAKE_CUDA_GPA_ALIASES=1  cuGetProcAddress hands out internal addresses instead of the
 *                        exported ones (as a real driver may), for the hooked entry points
 * FAKE_CUDA_CTX_MIB      card memory a context takes (default 0)
 * FAKE_CUDA_MODULE_MIB   card memory a module or library load takes (default 0)
 * FAKE_CUDA_HIDDEN_MIB   card memory the driver takes at a process's first launch on a card
 *                        without any call saying so, as lazy kernel loading does (default 0)
 * FAKE_CUDA_GRAPH_MIB    graph memory an executable graph reserves at its first launch or
 *                        upload, kept until cuDeviceGraphMemTrim (default 0)
 * FAKE_CUDA_NO_POOL_ATTRS=1  cuMemPoolGetAttribute fails (a driver without pool attributes)
 * FAKE_CUDA_CONCURRENT_MANAGED  what CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS answers (default 1;
 *                        0 = a device that cannot page managed memory on demand)
 *
 * Managed memory (cuMemAllocManaged) may exceed the card, as on a device with concurrent managed
 * access: what fits is booked on the card, the rest counted as spilled to host memory
 * (fake_cuda_stats' spilled_bytes).  fake_cuda_alloc_via(ptr) names the entry point that served
 * each live allocation, so a test can tell a plain allocation from a redirected one.
 * FAKE_KERNEL_US         GPU time of one kernel (for FAKE_GPU_QUEUE and the fake NVML)
 * FAKE_GPU_QUEUE         kernels the card queues before a launch blocks (default 0: launches
 *                        never wait); with it, kernels run one after another on the card and
 *                        synchronising waits for them, so throughput is the card's
 * FAKE_GPU_STATE         file that holds the card state, shared between processes
 */
#include "fake.h"

#include <cuda.h>
#undef cuGetProcAddress
#undef cuDeviceGetUuid /* the fake defines both versions */

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MiB (1ull << 20)
#define POOL_GRANULE (2 * MiB)

static uint64_t card_bytes = 16384ull << 20;
static int physical_count = 1;
static int device_count = 1;
static int phys_of[FAKE_MAX_DEVICES]; /* CUDA ordinal -> physical card */
static int gpa_aliases;
static uint64_t ctx_bytes, module_bytes, hidden_bytes, graph_bytes;
static int no_pool_attrs;
static int concurrent_managed = 1;
static double kernel_us = 100.0;
static int queue_depth;
static struct fake_cuda_stats stats;
static __thread int current_device;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static struct fake_gpu_state local_state;
static struct fake_gpu_state *state = &local_state;
static int shared_state;
static struct fake_proc *me; /* this process's entry; a forked child claims its own */

enum { NO_POOL = -1 };
struct live {
    uint64_t key;
    uint64_t size;    /* of which spilled is in host memory, the rest on the card */
    uint64_t spilled;
    int dev;
    int pool;
    int via;          /* enum fake_via */
};
#define MAX_LIVE 65536
static struct live live[MAX_LIVE];
static int nlive;
static uint64_t next_addr = 0x700000000000ull;

#define MAX_POOLS 16
struct fake_pool {
    int used_slot;
    int dev;
    uint64_t reserved, used, threshold;
};
static struct fake_pool pools[MAX_POOLS]; /* 0..FAKE_MAX_DEVICES-1: each ordinal's default pool */

static int primary_refs[FAKE_MAX_DEVICES];
#define MAX_CTX 64
static struct { uint64_t handle; int dev; } created_ctx[MAX_CTX];
static uint64_t next_ctx = 0x1000;
#define MAX_MODULES 1024
static struct { uint64_t handle; int dev; } modules[MAX_MODULES];
static int nmodules;
static uint64_t next_module = 0x2000;
static int hidden_done[FAKE_MAX_DEVICES];
static uint64_t graph_reserved[FAKE_MAX_DEVICES];
#define MAX_EXECS 64
static struct { uint64_t exec; int dev; } execs[MAX_EXECS];
static int nexecs;

static void forget_entry(void);

#define VALID_DEVICE(d)                             \
    do {                                            \
        if ((d) < 0 || (d) >= device_count)         \
            return CUDA_ERROR_INVALID_DEVICE;       \
    } while (0)

static uint64_t env_mib(const char *name)
{
    const char *s = getenv(name);
    return (s != NULL && *s != '\0') ? strtoull(s, NULL, 10) << 20 : 0;
}

/* CUDA_VISIBLE_DEVICES: entries up to the first one that names no card, as CUDA reads it. */
static void read_visible(void)
{
    for (int i = 0; i < physical_count; i++)
        phys_of[i] = i;
    device_count = physical_count;
    const char *s = getenv("CUDA_VISIBLE_DEVICES");
    if (s == NULL)
        return;
    int n = 0;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *e = strtok_r(buf, ",", &save); e != NULL && n < FAKE_MAX_DEVICES; e = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*e))
            e++;
        int found = -1;
        if (isdigit((unsigned char)*e)) {
            int v = atoi(e);
            found = v < physical_count ? v : -1;
        } else {
            for (int p = 0; p < physical_count; p++) {
                char uuid[64];
                fake_card_uuid(p, uuid, sizeof uuid);
                if (strcasecmp(uuid, e) == 0)
                    found = p;
            }
        }
        if (found < 0)
            break;
        phys_of[n++] = found;
    }
    device_count = n;
}

__attribute__((constructor)) static void fake_init(void)
{
    uint64_t v = env_mib("FAKE_CUDA_MEM_MIB");
    if (v != 0)
        card_bytes = v;
    const char *s = getenv("FAKE_CUDA_DEVICES");
    if (s != NULL && *s != '\0')
        physical_count = atoi(s);
    if (physical_count < 1)
        physical_count = 1;
    if (physical_count > FAKE_MAX_DEVICES)
        physical_count = FAKE_MAX_DEVICES;
    read_visible();
    s = getenv("FAKE_CUDA_GPA_ALIASES");
    gpa_aliases = s != NULL && strcmp(s, "1") == 0;
    ctx_bytes = env_mib("FAKE_CUDA_CTX_MIB");
    module_bytes = env_mib("FAKE_CUDA_MODULE_MIB");
    hidden_bytes = env_mib("FAKE_CUDA_HIDDEN_MIB");
    graph_bytes = env_mib("FAKE_CUDA_GRAPH_MIB");
    s = getenv("FAKE_CUDA_CONCURRENT_MANAGED");
    if (s != NULL && *s != '\0')
        concurrent_managed = atoi(s);
    s = getenv("FAKE_CUDA_NO_POOL_ATTRS");
    no_pool_attrs = s != NULL && strcmp(s, "1") == 0;
    if ((s = getenv("FAKE_KERNEL_US")) != NULL && *s != '\0')
        kernel_us = atof(s);
    if ((s = getenv("FAKE_GPU_QUEUE")) != NULL && *s != '\0')
        queue_depth = atoi(s);
    for (int i = 0; i < FAKE_MAX_DEVICES; i++) {
        pools[i].used_slot = 1;
        pools[i].dev = i;
    }
    pthread_atfork(NULL, NULL, forget_entry);
    s = getenv("FAKE_GPU_STATE");
    if (s != NULL && *s != '\0') {
        int fd = open(s, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd >= 0 && ftruncate(fd, sizeof(struct fake_gpu_state)) == 0) {
            void *m = mmap(NULL, sizeof(struct fake_gpu_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) {
                state = m;
                shared_state = 1;
            }
        }
        if (fd >= 0)
            close(fd);
        if (!shared_state)
            fprintf(stderr, "fake libcuda: FAKE_GPU_STATE=%s cannot be used: %s\n", s, strerror(errno));
    }
}

/* ---- the card state: this process's entry (claimed on first use, again after fork) */

static int alive(uint32_t pid)
{
    return pid != 0 && !(kill((pid_t)pid, 0) != 0 && errno == ESRCH);
}

static void forget_entry(void)
{
    me = NULL;
}

static struct fake_proc *self_entry(void)
{
    if (me != NULL)
        return me;
    pid_t pid = getpid();
    struct fake_proc *found = NULL;
    for (int i = 0; i < FAKE_MAX_PROCS && found == NULL; i++)
        if (__atomic_load_n(&state->procs[i].pid, __ATOMIC_ACQUIRE) == (uint32_t)pid)
            found = &state->procs[i];
    for (int i = 0; i < FAKE_MAX_PROCS && found == NULL; i++) {
        struct fake_proc *p = &state->procs[i];
        uint32_t old = __atomic_load_n(&p->pid, __ATOMIC_ACQUIRE);
        if (alive(old))
            continue;
        if (__atomic_compare_exchange_n(&p->pid, &old, (uint32_t)pid, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            found = p;
    }
    if (found == NULL)
        abort(); /* more fake processes than the fake card holds: a test bug */
    /* A new process (or a forked child, or one after exec): nothing is on the card yet. */
    memset(found->used, 0, sizeof found->used);
    memset(found->launches, 0, sizeof found->launches);
    found->ctx_mask = 0;
    me = found;
    return me;
}

/* What card p gives to everyone (shared state) or to this process (process-local state). */
static uint64_t card_used(int p)
{
    if (!shared_state)
        return self_entry()->used[p];
    uint64_t sum = 0;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        uint32_t pid = __atomic_load_n(&state->procs[i].pid, __ATOMIC_ACQUIRE);
        if (pid != 0 && alive(pid))
            sum += __atomic_load_n(&state->procs[i].used[p], __ATOMIC_ACQUIRE);
    }
    return sum;
}

/* Book delta bytes on CUDA ordinal dev; a positive one fails when the card is full. Lock held. */
static int book(int dev, int64_t delta)
{
    int p = phys_of[dev];
    if (delta > 0 && (uint64_t)delta > card_bytes - card_used(p))
        return -1;
    struct fake_proc *e = self_entry();
    __atomic_add_fetch(&e->used[p], (uint64_t)delta, __ATOMIC_ACQ_REL);
    stats.used_bytes[dev] += (uint64_t)delta;
    return 0;
}

static void set_ctx_bit(int dev, int on)
{
    struct fake_proc *e = self_entry();
    uint32_t bit = 1u << phys_of[dev];
    if (on)
        __atomic_or_fetch(&e->ctx_mask, bit, __ATOMIC_ACQ_REL);
    else
        __atomic_and_fetch(&e->ctx_mask, ~bit, __ATOMIC_ACQ_REL);
}

EXPORT struct fake_gpu_state *fake_cuda_state(void)
{
    return state;
}

/* Allocate bookkeeping; returns the new key or 0 when the card is full.  A managed allocation
 * (via FAKE_VIA_MANAGED) books what fits on the card and spills the rest. */
static uint64_t fake_alloc_in(uint64_t size, int dev, int pool, int via)
{
    uint64_t key = 0, spilled = 0;
    pthread_mutex_lock(&lock);
    stats.alloc_calls++;
    if (via == FAKE_VIA_MANAGED)
        stats.managed_calls++;
    if (dev < 0 || dev >= device_count || nlive == MAX_LIVE)
        goto out;
    if (via == FAKE_VIA_MANAGED) {
        uint64_t room = card_bytes - card_used(phys_of[dev]);
        spilled = size > room ? size - room : 0;
        book(dev, (int64_t)(size - spilled));
        stats.spilled_bytes[dev] += spilled;
    } else if (pool == NO_POOL) {
        if (book(dev, (int64_t)size) != 0)
            goto out;
    } else {
        struct fake_pool *fp = &pools[pool];
        uint64_t cached = fp->reserved - fp->used;
        if (size > cached) {
            uint64_t grow = (size - cached + POOL_GRANULE - 1) / POOL_GRANULE * POOL_GRANULE;
            if (book(fp->dev, (int64_t)grow) != 0)
                goto out;
            fp->reserved += grow;
        }
        fp->used += size;
    }
    key = next_addr;
    next_addr += (size + 511) & ~511ull;
    if (size == 0)
        next_addr += 512;
    live[nlive++] = (struct live){key, size, spilled, dev, pool, via};
out:
    pthread_mutex_unlock(&lock);
    return key;
}

static uint64_t fake_alloc(uint64_t size, int dev)
{
    return fake_alloc_in(size, dev, NO_POOL, FAKE_VIA_OTHER);
}

EXPORT int fake_cuda_alloc_via(uint64_t key)
{
    int via = FAKE_VIA_NONE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nlive; i++)
        if (live[i].key == key)
            via = live[i].via;
    pthread_mutex_unlock(&lock);
    return via;
}

static int fake_free(uint64_t key)
{
    int found = 0;
    pthread_mutex_lock(&lock);
    stats.free_calls++;
    for (int i = nlive - 1; i >= 0; i--)
        if (live[i].key == key) {
            if (live[i].pool == NO_POOL) {
                book(live[i].dev, -(int64_t)(live[i].size - live[i].spilled));
                stats.spilled_bytes[live[i].dev] -= live[i].spilled;
            }
            else
                pools[live[i].pool].used -= live[i].size; /* stays reserved in the pool */
            live[i] = live[--nlive];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&lock);
    return found;
}

/* Give back what a pool holds above max(used, keep). Lock held. */
static void pool_shrink(struct fake_pool *fp, uint64_t keep)
{
    uint64_t floor = fp->used > keep ? fp->used : keep;
    floor = (floor + POOL_GRANULE - 1) / POOL_GRANULE * POOL_GRANULE;
    if (fp->reserved > floor) {
        book(fp->dev, -(int64_t)(fp->reserved - floor));
        fp->reserved = floor;
    }
}

EXPORT void fake_cuda_stats(struct fake_cuda_stats *out)
{
    pthread_mutex_lock(&lock);
    *out = stats;
    out->launches = __atomic_load_n(&stats.launches, __ATOMIC_RELAXED);
    out->ptsz_calls = __atomic_load_n(&stats.ptsz_calls, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lock);
}

static void ptsz(void)
{
    __atomic_add_fetch(&stats.ptsz_calls, 1, __ATOMIC_RELAXED);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ---- init, devices, identity */
EXPORT CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = CUDA_VERSION; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetCount(int *n) { *n = device_count; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    VALID_DEVICE(ordinal);
    *d = ordinal;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice d)
{
    VALID_DEVICE(d);
    /* The 16 bytes the text form spells in hex, dashes skipped. */
    char text[64];
    fake_card_uuid(phys_of[d], text, sizeof text);
    memset(uuid->bytes, 0, sizeof uuid->bytes);
    int nibble = 0;
    for (const char *c = strncasecmp(text, "GPU-", 4) == 0 ? text + 4 : text; *c != '\0' && nibble < 32; c++) {
        if (!isxdigit((unsigned char)*c))
            continue;
        int v = isdigit((unsigned char)*c) ? *c - '0' : (tolower((unsigned char)*c) - 'a' + 10);
        uuid->bytes[nibble / 2] = (char)((unsigned char)uuid->bytes[nibble / 2] | (v << (nibble % 2 ? 0 : 4)));
        nibble++;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d)
{
    if (d < 0 || d >= device_count || len < 13)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(bus, (size_t)len, "0000:%02x:00.0", FAKE_PCI_BUS(phys_of[d]));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    VALID_DEVICE(d);
    *bytes = card_bytes;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    pthread_mutex_lock(&lock);
    *free = card_bytes - card_used(phys_of[current_device]);
    *total = card_bytes;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- contexts: primary ones are (CUcontext)(ordinal + 1), created ones come from a counter */
static int ctx_device(CUcontext ctx)
{
    uint64_t h = (uint64_t)(uintptr_t)ctx;
    if (h >= 1 && h <= FAKE_MAX_DEVICES)
        return (int)h - 1;
    for (int i = 0; i < MAX_CTX; i++)
        if (created_ctx[i].handle == h)
            return created_ctx[i].dev;
    return -1;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d)
{
    VALID_DEVICE(d);
    pthread_mutex_lock(&lock);
    CUresult r = CUDA_SUCCESS;
    if (primary_refs[d] == 0) {
        if (book(d, (int64_t)ctx_bytes) != 0)
            r = CUDA_ERROR_OUT_OF_MEMORY;
        else
            set_ctx_bit(d, 1);
    }
    if (r == CUDA_SUCCESS) {
        primary_refs[d]++;
        *ctx = (CUcontext)(uintptr_t)(d + 1);
    }
    pthread_mutex_unlock(&lock);
    return r;
}
static void primary_gone(int d) /* lock held */
{
    book(d, -(int64_t)ctx_bytes);
    set_ctx_bit(d, 0);
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    VALID_DEVICE(d);
    pthread_mutex_lock(&lock);
    CUresult r = primary_refs[d] > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS && --primary_refs[d] == 0)
        primary_gone(d);
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d)
{
    VALID_DEVICE(d);
    pthread_mutex_lock(&lock);
    if (primary_refs[d] > 0)
        primary_gone(d);
    primary_refs[d] = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active)
{
    VALID_DEVICE(d);
    *flags = 0;
    *active = primary_refs[d] > 0;
    return CUDA_SUCCESS;
}
static CUresult create_ctx(CUcontext *pctx, CUdevice d)
{
    VALID_DEVICE(d);
    pthread_mutex_lock(&lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_CTX; i++)
        if (created_ctx[i].handle == 0) {
            if (book(d, (int64_t)ctx_bytes) != 0)
                break;
            set_ctx_bit(d, 1);
            created_ctx[i].handle = next_ctx++;
            created_ctx[i].dev = d;
            *pctx = (CUcontext)(uintptr_t)created_ctx[i].handle;
            current_device = d;
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    (void)flags;
    return create_ctx(pctx, d);
}
EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned int flags, CUdevice d)
{
    (void)params, (void)n, (void)flags;
    return create_ctx(pctx, d);
}
EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice d)
{
    (void)params, (void)flags;
    return create_ctx(pctx, d);
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    uint64_t h = (uint64_t)(uintptr_t)ctx;
    CUresult r = CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_CTX; i++)
        if (h != 0 && created_ctx[i].handle == h) {
            book(created_ctx[i].dev, -(int64_t)ctx_bytes);
            created_ctx[i].handle = 0;
            r = CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    int d = ctx ? ctx_device(ctx) : 0;
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    current_device = d;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    *ctx = (CUcontext)(uintptr_t)(current_device + 1);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d) { *d = current_device; return CUDA_SUCCESS; }

/* ---- modules and libraries: each load takes FAKE_CUDA_MODULE_MIB on the current device */
static CUresult load_module(uint64_t *handle)
{
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    if (nmodules < MAX_MODULES && book(current_device, (int64_t)module_bytes) == 0) {
        modules[nmodules].handle = next_module++;
        modules[nmodules].dev = current_device;
        *handle = modules[nmodules++].handle;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
static CUresult unload_module(uint64_t handle)
{
    CUresult r = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nmodules; i++)
        if (modules[i].handle == handle) {
            book(modules[i].dev, -(int64_t)module_bytes);
            modules[i] = modules[--nmodules];
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&lock);
    return r;
}
#define MODULE_OUT(type, out)                         \
    uint64_t h_ = 0;                                  \
    CUresult r_ = load_module(&h_);                   \
    if (r_ == CUDA_SUCCESS)                           \
        *(out) = (type)(uintptr_t)h_;                 \
    return r_
EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname) { (void)fname; MODULE_OUT(CUmodule, m); }
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) { (void)image; MODULE_OUT(CUmodule, m); }
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, CUjit_option *o, void **v)
{
    (void)image, (void)n, (void)o, (void)v;
    MODULE_OUT(CUmodule, m);
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) { (void)fatbin; MODULE_OUT(CUmodule, m); }
EXPORT CUresult cuModuleUnload(CUmodule m) { return unload_module((uint64_t)(uintptr_t)m); }
EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *code, CUjit_option *jo, void **jv, unsigned int nj,
                                  CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)code, (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    MODULE_OUT(CUlibrary, l);
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *file, CUjit_option *jo, void **jv, unsigned int nj,
                                      CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)file, (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    MODULE_OUT(CUlibrary, l);
}
EXPORT CUresult cuLibraryUnload(CUlibrary l) { return unload_module((uint64_t)(uintptr_t)l); }

/* ---- linear memory */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    uint64_t k = fake_alloc_in(n, current_device, NO_POOL, FAKE_VIA_ALLOC);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int flags)
{
    if (n == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t k = fake_alloc_in(n, current_device, NO_POOL, FAKE_VIA_MANAGED);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice d)
{
    VALID_DEVICE(d);
    if (pi == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *pi = attrib == CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS ? concurrent_managed : 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int elem)
{
    (void)elem;
    size_t pt = (w + 511) & ~(size_t)511;
    uint64_t k = fake_alloc_in((uint64_t)pt * h, current_device, NO_POOL, FAKE_VIA_PITCH);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    *pitch = pt;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return fake_free(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

/* ---- stream-ordered memory: pools keep what is freed until a synchronisation or a trim */
static int pool_index(CUmemoryPool pool)
{
    uintptr_t i = (uintptr_t)pool;
    if (i < 1 || i > MAX_POOLS || !pools[i - 1].used_slot)
        return -1;
    return (int)i - 1;
}
static CUmemoryPool pool_handle(int i) { return (CUmemoryPool)(uintptr_t)(i + 1); }

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    VALID_DEVICE(d);
    *pool = pool_handle(d);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d) { return cuDeviceGetDefaultMemPool(pool, d); }
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    int d = props->location.id;
    VALID_DEVICE(d);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    for (int i = FAKE_MAX_DEVICES; i < MAX_POOLS; i++)
        if (!pools[i].used_slot) {
            pools[i] = (struct fake_pool){1, d, 0, 0, 0};
            *pool = pool_handle(i);
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    int i = pool_index(pool);
    if (i < FAKE_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    book(pools[i].dev, -(int64_t)pools[i].reserved);
    pools[i].used_slot = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    int i = pool_index(pool);
    if (i < 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    pool_shrink(&pools[i], keep);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    int i = pool_index(pool);
    if (i < 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (no_pool_attrs)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    CUresult r = CUDA_SUCCESS;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
        *(cuuint64_t *)value = pools[i].reserved;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        *(cuuint64_t *)value = pools[i].used;
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        *(cuuint64_t *)value = pools[i].threshold;
        break;
    default:
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    int i = pool_index(pool);
    if (i < 0 || attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        return CUDA_ERROR_INVALID_VALUE;
    pools[i].threshold = *(cuuint64_t *)value;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s)
{
    (void)s;
    uint64_t k = fake_alloc_in(n, current_device, current_device, FAKE_VIA_OTHER);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { ptsz(); return cuMemAllocAsync(p, n, s); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    (void)s;
    int i = pool_index(pool);
    if (i < 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t k = fake_alloc_in(n, pools[i].dev, i, FAKE_VIA_OTHER);
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = k;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)
{
    ptsz();
    return cuMemAllocFromPoolAsync(p, n, pool, s);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; return cuMemFree_v2(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { ptsz(); return cuMemFreeAsync(p, s); }

/* Synchronising waits for the card's queue; then pools give back what exceeds their threshold. */
static void synchronize(void)
{
    if (queue_depth > 0) {
        uint64_t until = __atomic_load_n(&state->busy_until_ns[phys_of[current_device]], __ATOMIC_ACQUIRE);
        uint64_t now = now_ns();
        if (until > now)
            sleep_ns(until - now);
    }
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].used_slot && pools[i].dev == current_device)
            pool_shrink(&pools[i], pools[i].threshold);
    pthread_mutex_unlock(&lock);
}
EXPORT CUresult cuCtxSynchronize(void) { synchronize(); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamSynchronize(CUstream s) { (void)s; synchronize(); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { ptsz(); return cuStreamSynchronize(s); }

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
EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop,
                                              CUmemAllocationGranularity_flags option)
{
    (void)prop, (void)option;
    *g = POOL_GRANULE;
    return CUDA_SUCCESS;
}

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

/* With FAKE_GPU_QUEUE, the kernel joins the card's queue (shared by every process using
 * the card) and the launch waits while the queue is full. */
static void enqueue_kernel(int p)
{
    uint64_t k = (uint64_t)(kernel_us * 1000.0), room = (uint64_t)queue_depth * k;
    for (;;) {
        uint64_t now = now_ns();
        uint64_t until = __atomic_load_n(&state->busy_until_ns[p], __ATOMIC_ACQUIRE);
        uint64_t start = until > now ? until : now;
        if (start - now > room) {
            sleep_ns(start - now - room);
            continue;
        }
        if (__atomic_compare_exchange_n(&state->busy_until_ns[p], &until, start + k, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return;
    }
}

static CUresult launch(void)
{
    int dev = current_device, p = phys_of[dev];
    if (hidden_bytes != 0 && !hidden_done[dev]) {
        pthread_mutex_lock(&lock);
        if (!hidden_done[dev] && book(dev, (int64_t)hidden_bytes) == 0)
            hidden_done[dev] = 1;
        pthread_mutex_unlock(&lock);
    }
    if (queue_depth > 0)
        enqueue_kernel(p);
    __atomic_add_fetch(&stats.launches, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&state->launches[p], 1, __ATOMIC_RELAXED);
    if (shared_state) /* one process alone: its launches are the card's */
        __atomic_add_fetch(&self_entry()->launches[p], 1, __ATOMIC_RELAXED);
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

/* ---- graphs: an executable graph reserves FAKE_CUDA_GRAPH_MIB when first launched or uploaded */
static CUresult graph_reserve(CUgraphExec g)
{
    uint64_t h = (uint64_t)(uintptr_t)g;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&lock);
    int seen = 0;
    for (int i = 0; i < nexecs; i++)
        seen |= execs[i].exec == h;
    if (!seen && graph_bytes != 0) {
        if (nexecs == MAX_EXECS || book(current_device, (int64_t)graph_bytes) != 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            execs[nexecs].exec = h;
            execs[nexecs++].dev = current_device;
            graph_reserved[current_device] += graph_bytes;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    (void)s;
    CUresult r = graph_reserve(g);
    return r == CUDA_SUCCESS ? launch() : r;
}
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { ptsz(); return cuGraphLaunch(g, s); }
EXPORT CUresult cuGraphUpload(CUgraphExec g, CUstream s) { (void)s; return graph_reserve(g); }
EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec g, CUstream s) { ptsz(); return cuGraphUpload(g, s); }
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d)
{
    VALID_DEVICE(d);
    pthread_mutex_lock(&lock);
    book(d, -(int64_t)graph_reserved[d]);
    graph_reserved[d] = 0;
    for (int i = nexecs - 1; i >= 0; i--)
        if (execs[i].dev == d)
            execs[i] = execs[--nexecs];
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice d, CUgraphMem_attribute attr, void *value)
{
    VALID_DEVICE(d);
    pthread_mutex_lock(&lock);
    CUresult r = CUDA_SUCCESS;
    if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)
        *(cuuint64_t *)value = graph_reserved[d];
    else if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)
        *(cuuint64_t *)value = 0; /* the fake's graphs free what they allocate */
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&lock);
    return r;
}

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
static CUresult a_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { return cuDevicePrimaryCtxRetain(c, d); }
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
    E("cuDeviceGetAttribute", cuDeviceGetAttribute, 2000, ANY),
    E("cuDeviceGetUuid", cuDeviceGetUuid, 9020, ANY),
    E("cuDeviceGetUuid", cuDeviceGetUuid_v2, 11040, ANY),
    E("cuDeviceGetPCIBusId", cuDeviceGetPCIBusId, 4010, ANY),
    A("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain, 7000, ANY),
    E("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2, 11000, ANY),
    E("cuDevicePrimaryCtxReset", cuDevicePrimaryCtxReset_v2, 11000, ANY),
    E("cuDevicePrimaryCtxGetState", cuDevicePrimaryCtxGetState, 7000, ANY),
    E("cuCtxCreate", cuCtxCreate_v2, 3020, ANY),
    E("cuCtxCreate", cuCtxCreate_v3, 11040, ANY),
    E("cuCtxCreate", cuCtxCreate_v4, 12050, ANY),
    E("cuCtxDestroy", cuCtxDestroy_v2, 4000, ANY),
    E("cuCtxSetCurrent", cuCtxSetCurrent, 4000, ANY),
    E("cuCtxGetCurrent", cuCtxGetCurrent, 4000, ANY),
    E("cuCtxGetDevice", cuCtxGetDevice, 2000, ANY),
    E("cuCtxSynchronize", cuCtxSynchronize, 2000, ANY),
    E("cuStreamSynchronize", cuStreamSynchronize, 2000, LEGACY),
    E("cuStreamSynchronize", cuStreamSynchronize_ptsz, 7000, PTDS),
    E("cuModuleLoad", cuModuleLoad, 2000, ANY),
    E("cuModuleLoadData", cuModuleLoadData, 2000, ANY),
    E("cuModuleLoadDataEx", cuModuleLoadDataEx, 2010, ANY),
    E("cuModuleLoadFatBinary", cuModuleLoadFatBinary, 2000, ANY),
    E("cuModuleUnload", cuModuleUnload, 2000, ANY),
    E("cuLibraryLoadData", cuLibraryLoadData, 12000, ANY),
    E("cuLibraryLoadFromFile", cuLibraryLoadFromFile, 12000, ANY),
    E("cuLibraryUnload", cuLibraryUnload, 12000, ANY),
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
    E("cuDeviceGetDefaultMemPool", cuDeviceGetDefaultMemPool, 11020, ANY),
    E("cuDeviceGetMemPool", cuDeviceGetMemPool, 11020, ANY),
    E("cuMemPoolCreate", cuMemPoolCreate, 11020, ANY),
    E("cuMemPoolDestroy", cuMemPoolDestroy, 11020, ANY),
    E("cuMemPoolTrimTo", cuMemPoolTrimTo, 11020, ANY),
    E("cuMemPoolGetAttribute", cuMemPoolGetAttribute, 11020, ANY),
    E("cuMemPoolSetAttribute", cuMemPoolSetAttribute, 11020, ANY),
    E("cuMemCreate", cuMemCreate, 10020, ANY),
    E("cuMemRelease", cuMemRelease, 10020, ANY),
    E("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity, 10020, ANY),
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
    E("cuGraphUpload", cuGraphUpload, 11010, LEGACY),
    E("cuGraphUpload", cuGraphUpload_ptsz, 11010, PTDS),
    E("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim, 11040, ANY),
    E("cuDeviceGetGraphMemAttribute", cuDeviceGetGraphMemAttribute, 11040, ANY),
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
