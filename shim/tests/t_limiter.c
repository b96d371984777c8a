/*
 * The compute limiter against a model GPU, in virtual time.
 *
 * The model: every launch keeps the GPU busy for kernel_us; utilisation over a
 * sample period is the busy time launched in it (capped at 100 %).  The
 * program launches as fast as the limiter lets it, spending cpu_us per launch.
 *
 *   t_limiter converge TARGET      utilisation settles within 3 points of TARGET
 *   t_limiter light                a program that wants less than its share is never throttled
 *   t_limiter floor                a card kept busy by others never starves us below min_rate
 *   t_limiter burst                no more than the burst passes at once after an idle spell
 */
#include "../limiter.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                   \
            fputc('\n', stderr);                                            \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

struct model {
    uint64_t now_ns;
    double kernel_us;
    double other_util; /* utilisation from other tenants */
    uint64_t launches_since_sample;
    uint64_t last_sample_ns;
};

static uint64_t model_now(void *ctx)
{
    return ((struct model *)ctx)->now_ns;
}

static int model_util(void *ctx, double *pct)
{
    struct model *m = ctx;
    double dt_us = (double)(m->now_ns - m->last_sample_ns) / 1e3;
    double u = dt_us > 0 ? (double)m->launches_since_sample * m->kernel_us / dt_us * 100.0 : 0.0;
    u += m->other_util;
    *pct = u > 100.0 ? 100.0 : u;
    m->launches_since_sample = 0;
    m->last_sample_ns = m->now_ns;
    return 0;
}

/* Run for `seconds` of virtual time; returns the mean utilisation of our launches over the last `tail` s. */
static double simulate(struct tessera_limiter *l, struct model *m, double seconds, double tail, double cpu_us,
                       double *launch_rate_out)
{
    struct tessera_limiter_env env = {model_now, model_util, m};
    const uint64_t poll_ns = 100000000; /* 100 ms, as in the shim */
    uint64_t end = m->now_ns + (uint64_t)(seconds * 1e9), tail_start = end - (uint64_t)(tail * 1e9);
    uint64_t next_poll = m->now_ns + poll_ns, tail_launches = 0;
    while (m->now_ns < end) {
        if (m->now_ns >= next_poll) {
            CHECK(tessera_limiter_poll(l, &env) == 0, "poll failed");
            next_poll += poll_ns;
        }
        uint64_t wait = tessera_limiter_acquire(l, m->now_ns);
        if (wait != 0) {
            uint64_t step = wait < next_poll - m->now_ns ? wait : next_poll - m->now_ns;
            m->now_ns += step ? step : 1;
            continue;
        }
        m->launches_since_sample++;
        if (m->now_ns >= tail_start)
            tail_launches++;
        m->now_ns += (uint64_t)(cpu_us * 1e3);
    }
    if (launch_rate_out)
        *launch_rate_out = (double)tail_launches / tail;
    double u = (double)tail_launches * m->kernel_us / (tail * 1e6) * 100.0;
    return u > 100.0 ? 100.0 : u;
}

int main(int argc, char **argv)
{
    CHECK(argc >= 2, "usage: %s converge TARGET | light | floor | burst", argv[0]);
    struct tessera_limiter l;
    struct model m = {.now_ns = 1000000000ull, .kernel_us = 1000.0, .last_sample_ns = 1000000000ull};
    if (strcmp(argv[1], "converge") == 0 && argc == 3) {
        double target = atof(argv[2]);
        tessera_limiter_init(&l, target, m.now_ns);
        /* 1 ms kernels, 10 us to launch one: unthrottled the program would hold the card at 100 %. */
        double got = simulate(&l, &m, 20.0, 5.0, 10.0, NULL);
        printf("target %.0f%%, held at %.1f%%\n", target, got);
        CHECK(got > target - 3.0 && got < target + 3.0, "utilisation %.1f%%, target %.0f%%", got, target);
        return 0;
    }
    if (strcmp(argv[1], "light") == 0) {
        tessera_limiter_init(&l, 50.0, m.now_ns);
        /* 1 ms of CPU per 100 us kernel: the program wants 10 % on its own. */
        m.kernel_us = 100.0;
        double rate;
        double got = simulate(&l, &m, 10.0, 5.0, 1000.0, &rate);
        CHECK(rate > 990.0, "a 1000 launch/s program was held to %.0f/s (utilisation %.1f%%)", rate, got);
        return 0;
    }
    if (strcmp(argv[1], "floor") == 0) {
        tessera_limiter_init(&l, 30.0, m.now_ns);
        m.other_util = 100.0; /* whole-card utilisation says 100 % whatever we do */
        double rate;
        simulate(&l, &m, 10.0, 5.0, 10.0, &rate);
        CHECK(rate >= l.min_rate * 0.9, "starved: %.1f launches/s, floor %.0f", rate, l.min_rate);
        CHECK(rate < l.min_rate * 3, "not throttled under a busy card: %.1f launches/s", rate);
        return 0;
    }
    if (strcmp(argv[1], "burst") == 0) {
        tessera_limiter_init(&l, 30.0, m.now_ns);
        l.rate = 1000.0; /* as if converged at 1000 launches/s */
        uint64_t t = m.now_ns + 10000000000ull; /* after 10 s idle */
        int passed = 0;
        while (tessera_limiter_acquire(&l, t) == 0)
            passed++;
        CHECK(passed <= (int)(1000.0 * l.burst_s) + 1, "%d launches passed at once", passed);
        uint64_t wait = tessera_limiter_acquire(&l, t);
        CHECK(wait > 0 && wait <= 1000000, "wait %llu ns for the next token at 1000/s", (unsigned long long)wait);
        return 0;
    }
    CHECK(0, "unknown case %s", argv[1]);
}
