/*
 * Compute limiter: a token bucket whose refill rate (kernel launches per
 * second) is steered by measured GPU utilisation towards a target share.
 *
 * Pure: no clock, no NVML, no threads.  The caller passes the time and the
 * utilisation in (tessera_limiter_env), so tests drive it with a virtual
 * clock and a model of the GPU.  Not thread-safe; the shim holds a mutex.
 */
#ifndef TESSERA_LIMITER_H
#define TESSERA_LIMITER_H

#include <stdint.h>

struct tessera_limiter_env {
    uint64_t (*now_ns)(void *ctx);
    /* Utilisation of the card over the last sample period, percent; non-zero return = unavailable. */
    int (*utilisation)(void *ctx, double *percent);
    void *ctx;
};

struct tessera_limiter {
    double target_pct;   /* share to hold, 1..99 */
    double rate;         /* tokens (launches) per second */
    double min_rate;     /* never throttle below this: a starved process cannot be measured */
    double max_rate;     /* "unlimited" */
    double burst_s;      /* bucket holds rate * burst_s tokens (at least 1) */
    double gain;         /* 0..1: fraction of the correction applied per update */
    double tokens;
    uint64_t last_ns;        /* last refill */
    uint64_t window_start_ns;
    uint64_t window_launches; /* launches admitted since window_start_ns */
};

void tessera_limiter_init(struct tessera_limiter *l, double target_pct, uint64_t now_ns);

/* 0: launch now (a token was taken).  Otherwise: nanoseconds to wait before asking again. */
uint64_t tessera_limiter_acquire(struct tessera_limiter *l, uint64_t now_ns);

/* Feed one utilisation sample taken at now_ns; adjusts the rate. */
void tessera_limiter_update(struct tessera_limiter *l, double util_pct, uint64_t now_ns);

/* Read the clock and the utilisation source and update; returns -1 when no sample was had. */
int tessera_limiter_poll(struct tessera_limiter *l, const struct tessera_limiter_env *env);

#endif
