/* Internal interface between the shim's source files.  Nothing here is exported. */
#ifndef TESSERA_SHIM_H
#define TESSERA_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>
/* cuda.h maps cuGetProcAddress to cuGetProcAddress_v2; the shim defines both. */
#undef cuGetProcAddress
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* name every versioned entry point explicitly */
#include <nvml.h>

#include "region_layout.h"

#define TESSERA_EXPORT __attribute__((visibility("default")))
#define TESSERA_LIKELY(x) __builtin_expect(!!(x), 1)
#define TESSERA_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* Declarations of every hook (exported) and of the real entry points we call. */
CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
#define CU_HOOK(symbol, base, since, stream, params, args) TESSERA_EXPORT CUresult CUDAAPI symbol params;
#define NVML_HOOK(symbol, params, args) TESSERA_EXPORT nvmlReturn_t DECLDIR symbol params;
#define CU_REAL(symbol, params) CUresult CUDAAPI symbol params;
#define NVML_REAL(symbol, params) nvmlReturn_t DECLDIR symbol params;
#include "hooks.def"

enum tessera_hook_id {
#define CU_HOOK(symbol, base, since, stream, params, args) TESSERA_ID_##symbol,
#define NVML_HOOK(symbol, params, args) TESSERA_ID_##symbol,
#define CU_REAL(symbol, params) TESSERA_ID_##symbol,
#define NVML_REAL(symbol, params) TESSERA_ID_##symbol,
#include "hooks.def"
    TESSERA_ID_COUNT
};

/* Real entry points, resolved on first use (see shim.c). */
extern void *tessera_real_table[TESSERA_ID_COUNT];
void *tessera_resolve(enum tessera_hook_id id);

static inline void *tessera_real(enum tessera_hook_id id)
{
    void *fn = __atomic_load_n(&tessera_real_table[id], __ATOMIC_ACQUIRE);
    if (TESSERA_UNLIKELY(fn == NULL))
        fn = tessera_resolve(id);
    return fn;
}
#define REAL(symbol) ((__typeof__(&symbol))tessera_real(TESSERA_ID_##symbol))

/* ---- settings (read once, at load) ---- */
enum { TLOG_OFF = 0, TLOG_ERROR = 1, TLOG_WARN = 2, TLOG_INFO = 3, TLOG_DEBUG = 4 };
extern int tessera_log_level;
void tessera_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define TLOG(level, ...)                                                   \
    do {                                                                   \
        if (TESSERA_UNLIKELY(tessera_log_level >= (level)))                \
            tessera_log((level), __VA_ARGS__);                             \
    } while (0)

struct tessera_settings {
    uint64_t mem_limit[TESSERA_MAX_DEVICES];  /* bytes, 0 = none */
    uint64_t mem_resident[TESSERA_MAX_DEVICES]; /* bytes held on the card, below mem_limit when the device
                                                   is oversubscribed; else equal to it (or 0) */
    uint32_t core_limit[TESSERA_MAX_DEVICES]; /* percent, 0 = none */
};
extern struct tessera_settings tessera_cfg;
/* Non-zero once any memory limit is set: the only thing memory hooks test when off. */
extern int tessera_mem_on;
/* Bit i set = device i is oversubscribed: plain allocations past its resident part are served as
 * managed memory.  Cleared at cuInit for a device without concurrent managed access. */
extern uint32_t tessera_oversub_mask;
/* Bit i set = device i has a compute limit. */
extern uint32_t tessera_core_mask;
/* TESSERA_TASK_PRIORITY (0 = high, 1 = low), -1 = none: the container takes no part in priorities. */
extern int tessera_task_priority;
/* Non-zero when launches have anything to do (a compute limit or a priority): the only
 * thing launch hooks test when off. */
extern int tessera_launch_on;

extern int tessera_init_done;
void tessera_init_slow(void);
static inline void tessera_ensure_init(void)
{
    if (TESSERA_UNLIKELY(!__atomic_load_n(&tessera_init_done, __ATOMIC_ACQUIRE)))
        tessera_init_slow();
}

/* ---- shared region (region.c) ---- */
/* Open or create the region at path; NULL path or any problem → process-local region.
 * Returns 0 when the shared file is in use, -1 on fallback (message already logged). */
int tessera_region_setup(const char *path);
bool tessera_region_shared(void);
/* The region in use (the shared file's mapping, or the process-local stand-in). */
struct tessera_region *tessera_region_map(void);
/* Add bytes to this process's count on dev unless the container would pass limit; *total is
 * then the container's usage including them (0 when limit is 0). */
bool tessera_region_reserve(int dev, uint64_t bytes, uint64_t limit, uint64_t *total);
void tessera_region_charge(int dev, uint64_t bytes);
void tessera_region_release(int dev, uint64_t bytes);
uint64_t tessera_region_own_used(int dev);
/* Virtual device memory: mark reserved bytes as spilled (served managed past the resident
 * part); release spilled bytes from both counts; the container's spilled and resident sums. */
void tessera_region_spill(int dev, uint64_t bytes);
void tessera_region_release_spilled(int dev, uint64_t bytes);
uint64_t tessera_region_spilled(int dev);
uint64_t tessera_region_resident(int dev);
uint64_t tessera_region_used(int dev);
void tessera_region_publish_device(int dev, uint64_t limit, uint64_t card_total, uint32_t core_pct);
int tessera_region_reap(void);
void tessera_region_reap_if_due(void);
void tessera_region_after_fork_child(void);
void tessera_region_at_exit(void);

/* ---- memory (memory.c) ---- */
void tessera_memory_after_fork_child(void);
/* Effective limit for dev (bytes), 0 = none.  Clamped to the card once known. */
uint64_t tessera_mem_limit(int dev);
static inline bool tessera_oversubscribed(int dev)
{
    return TESSERA_UNLIKELY((__atomic_load_n(&tessera_oversub_mask, __ATOMIC_RELAXED) >> (dev & 31)) & 1u);
}
int tessera_current_device(void);

/* ---- which NVML device is which CUDA device (devmap.c) ---- */
void tessera_devmap_read_env(const char *cuda_visible_devices);
void tessera_devmap_cuda_ready(void);      /* after a successful cuInit */
bool tessera_devmap_cuda_known(void);      /* CUDA's own identities are in use */
bool tessera_nvml_ready(void);             /* nvmlInit, once */
int tessera_devmap_ordinal(nvmlDevice_t device); /* CUDA ordinal, -1 for none */
nvmlDevice_t tessera_devmap_nvml(int ordinal);   /* NULL when NVML has no such card */

/* ---- the driver's own memory, pools and graphs (drivermem.c) ---- */
void tessera_drivermem_sample(int dev);    /* pools and graph memory, now */
/* Pools, graphs and NVML's per-process figure, unless done less than interval_ns ago (0: now);
 * `pending`: bytes this thread reserved that the driver has not allocated yet.  True when it ran. */
bool tessera_drivermem_refresh(int dev, uint64_t interval_ns, uint64_t pending);
/* Stream-ordered allocations: the pool's record (-1: not tracked, count bytes plainly) and
 * the growth *need the allocation may cost; then admitted (need reserved in the slot) or
 * undone, settled after the driver answered, and freed. */
int tessera_pool_need(int dev, CUmemoryPool pool, uint64_t bytes, uint64_t *need);
void tessera_pool_admitted(int pool, uint64_t bytes, uint64_t need);
void tessera_pool_settle(int pool);
void tessera_pool_freed(int pool, uint64_t bytes);
void tessera_graph_launched(CUgraphExec exec);
uint32_t tessera_host_pid(void);           /* this process as NVML knows it, 0 = not known */
void tessera_drivermem_after_fork_child(void);

/* ---- task priority (priority.c) ---- */
void tessera_priority_init(void);          /* after the region is set up */
extern struct tessera_region *tessera_priority_region; /* the region in use */
void tessera_priority_hold(int dev);       /* wait while the node plugin holds dev (errno kept) */

/* Count the launch for the node plugin; hold it while the plugin says so.  Inline: a launch
 * with a priority and nothing else to do calls nothing unless it is held. */
static inline void tessera_priority_launch(int dev)
{
    /* A plain load and store, not a locked add: the plugin only asks whether the count
     * moved, which a count lost between two threads launching at once never hides. */
    uint64_t *n = &tessera_priority_region->dev[dev].launches;
    __atomic_store_n(n, __atomic_load_n(n, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    if (tessera_task_priority > 0 &&
        TESSERA_UNLIKELY(__atomic_load_n(&tessera_priority_region->hdr.hold_mask, __ATOMIC_ACQUIRE) &
                         (1u << dev)))
        tessera_priority_hold(dev);
}

/* ---- launches: priority, then compute (compute.c) ---- */
void tessera_launch_slow(void);
/* Set at cuInit for a process with a priority, no compute limit and one device: its launches
 * are on ordinal 0 and need no more than tessera_priority_launch(0). */
extern int tessera_launch_quick;
void tessera_compute_after_fork_child(void);
void tessera_compute_init(void);

/* ---- cuGetProcAddress (shim.c) ---- */
void *tessera_proc_address_substitute(const char *symbol, void *fn, int cuda_version, cuuint64_t flags);

#endif
