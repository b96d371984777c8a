/* Compute limiter (see limiter.h).  Pure arithmetic on caller-supplied time and utilisation. */
#include "limiter.h"

#define NS_PER_S 1e9

void tessera_limiter_init(struct tessera_limiter *l, double target_pct, uint64_t now_ns)
{
    l->target_pct = target_pct;
    l->max_rate = 1e7;
    l->min_rate = 10.0;
    l->rate = l->max_rate; /* start open: nothing is known until the first sample */
    l->burst_s = 0.02;
    l->gain = 0.5;
    l->tokens = 1.0;
    l->last_ns = now_ns;
    l->window_start_ns = now_ns;
    l->window_launches = 0;
}

uint64_t tessera_limiter_acquire(struct tessera_limiter *l, uint64_t now_ns)
{
    if (now_ns > l->last_ns) {
        double cap = l->rate * l->burst_s;
        if (cap < 1.0)
            cap = 1.0;
        l->tokens += l->rate * (double)(now_ns - l->last_ns) / NS_PER_S;
        if (l->tokens > cap)
            l->tokens = cap;
        l->last_ns = now_ns;
    }
    if (l->tokens >= 1.0) {
        l->tokens -= 1.0;
        l->window_launches++;
        return 0;
    }
    double wait = (1.0 - l->tokens) / l->rate * NS_PER_S;
    return wait < 1.0 ? 1 : (uint64_t)wait;
}

/*
 * The launch rate that would have given the target is observed * target / util
 * (utilisation is taken as proportional to the launch rate).  Move part of the
 * way there (gain) to ride out noise and the lag of the utilisation sample.
 * Under the target the rate only loosens and over it only tightens, so a
 * process that launches less than it may is not pinned to its own pace.  A
 * saturated card says nothing about how far over we are: take the full step.
 */
void tessera_limiter_update(struct tessera_limiter *l, double util_pct, uint64_t now_ns)
{
    if (now_ns <= l->window_start_ns)
        return;
    double dt = (double)(now_ns - l->window_start_ns) / NS_PER_S;
    double observed = (double)l->window_launches / dt;
    l->window_start_ns = now_ns;
    l->window_launches = 0;
    if (util_pct < 0.0)
        util_pct = 0.0;

    double rate = l->rate;
    if (observed <= 0.0) {
        if (util_pct < l->target_pct)
            rate *= 2.0; /* idle or starved: open up */
    } else if (util_pct < 0.5) {
        rate *= 4.0;
    } else {
        double ratio = l->target_pct / util_pct;
        if (ratio > 4.0)
            ratio = 4.0;
        double gain = util_pct >= 98.0 ? 1.0 : l->gain;
        double desired = observed * (1.0 + gain * (ratio - 1.0));
        if (util_pct <= l->target_pct) {
            if (desired > rate)
                rate = desired;
        } else if (desired < rate) {
            rate = desired;
        }
    }
    if (rate < l->min_rate)
        rate = l->min_rate;
    if (rate > l->max_rate)
        rate = l->max_rate;
    l->rate = rate;
}

int tessera_limiter_poll(struct tessera_limiter *l, const struct tessera_limiter_env *env)
{
    double util;
    if (env->utilisation(env->ctx, &util) != 0)
        return -1;
    tessera_limiter_update(l, util, env->now_ns(env->ctx));
    return 0;
}
