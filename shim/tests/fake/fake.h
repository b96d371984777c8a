/* What the fake driver lets tests see: whether, and how, the driver was called. */
#ifndef TESSERA_FAKE_H
#define TESSERA_FAKE_H

#include <stdint.h>

#define FAKE_MAX_DEVICES 4
#define FAKE_MAX_PROCS 64

struct fake_cuda_stats {
    uint64_t alloc_calls;  /* allocation entry points that reached the driver */
    uint64_t free_calls;   /* free/destroy/release entry points that reached the driver */
    uint64_t ptsz_calls;   /* calls that reached a _ptsz entry point */
    uint64_t launches;     /* kernel and graph launches, all variants */
    uint64_t used_bytes[FAKE_MAX_DEVICES]; /* what this process has allocated, by CUDA ordinal */
    uint64_t managed_calls;                /* cuMemAllocManaged calls that reached the driver */
    uint64_t spilled_bytes[FAKE_MAX_DEVICES]; /* managed memory that did not fit on the card and lives
                                                 in host memory, by CUDA ordinal */
};

/* Which driver entry point served an allocation (fake_cuda_alloc_via). */
enum fake_via { FAKE_VIA_NONE = 0, FAKE_VIA_ALLOC = 1, FAKE_VIA_MANAGED = 2, FAKE_VIA_PITCH = 3, FAKE_VIA_OTHER = 4 };
typedef int (*fake_cuda_alloc_via_fn)(uint64_t ptr);

/* Exported by the fake libcuda.so.1 (not a CUDA symbol, never hooked). */
typedef void (*fake_cuda_stats_fn)(struct fake_cuda_stats *out);

/*
 * The fake card as the hardware would see it, by physical card (NVML's order, which is
 * PCI order): every process's memory on it and the work launched on it.  Both fake
 * libraries read it; with FAKE_GPU_STATE=<file> it lives in a shared file, so a process
 * can see what others hold (as NVML does on a real machine), else in the fake libcuda's
 * memory.  A process's entry counts everything the card gives it: contexts, modules,
 * allocations, pool and graph reservations.
 */
struct fake_proc {
    uint32_t pid;
    uint32_t ctx_mask;                  /* bit p: the process has a context on card p */
    uint64_t used[FAKE_MAX_DEVICES];    /* bytes, by physical card */
    uint64_t launches[FAKE_MAX_DEVICES];/* kernels this process launched, by physical card (with a
                                           shared state only: alone, the card's count is its own) */
};

struct fake_gpu_state {
    uint64_t launches[FAKE_MAX_DEVICES];      /* kernels launched on each card */
    uint64_t busy_until_ns[FAKE_MAX_DEVICES]; /* CLOCK_MONOTONIC time the card's queue drains */
    struct fake_proc procs[FAKE_MAX_PROCS];
};

typedef struct fake_gpu_state *(*fake_cuda_state_fn)(void);

/* Identity of physical card p, the same in both fakes. */
#define FAKE_UUID_FMT "GPU-7e55e2a0-0000-4000-8000-%012x"
#define FAKE_PCI_BUS(p) (0x1b + 0x20 * (p))

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * The UUID of physical card p: the p-th entry of FAKE_GPU_UUIDS (comma-separated) when it
 * is set, as on a node whose cards have known identities, else FAKE_UUID_FMT's.
 */
static inline void fake_card_uuid(int p, char *out, size_t n)
{
    const char *list = getenv("FAKE_GPU_UUIDS");
    if (list != NULL && *list != '\0') {
        for (int i = 0; i < p && list != NULL; i++) {
            list = strchr(list, ',');
            list = list != NULL ? list + 1 : NULL;
        }
        if (list != NULL) {
            size_t len = strcspn(list, ",");
            if (len > 0 && len < n) {
                memcpy(out, list, len);
                out[len] = '\0';
                return;
            }
        }
    }
    snprintf(out, n, FAKE_UUID_FMT, p);
}

#endif
