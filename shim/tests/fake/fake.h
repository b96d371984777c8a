/* What the fake driver lets tests see: whether, and how, the driver was called. */
#ifndef TESSERA_FAKE_H
#define TESSERA_FAKE_H

#include <stdint.h>

#define FAKE_MAX_DEVICES 4

struct fake_cuda_stats {
    uint64_t alloc_calls;  /* allocation entry points that reached the driver */
    uint64_t free_calls;   /* free/destroy/release entry points that reached the driver */
    uint64_t ptsz_calls;   /* calls that reached a _ptsz entry point */
    uint64_t launches;     /* kernel and graph launches, all variants */
    uint64_t used_bytes[FAKE_MAX_DEVICES]; /* what the fake card really has allocated */
};

/* Exported by the fake libcuda.so.1 (not a CUDA symbol, never hooked). */
typedef void (*fake_cuda_stats_fn)(struct fake_cuda_stats *out);
typedef uint64_t (*fake_cuda_launch_count_fn)(void);

#endif
