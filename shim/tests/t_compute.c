/*
 * The compute limit end to end: the shim's limiter, its NVML polling thread and
 * the fake NVML whose utilisation follows this process's launches
 * (FAKE_NVML_UTIL=model, each launch FAKE_KERNEL_US of GPU time).
 *
 *   t_compute TARGET SECONDS [ctx]
 *                              launch flat out; over the last second the GPU
 *                              time launched must be TARGET +- 6 % of the card
 *                              (TARGET 0: no limit, the card must be saturated).
 *                              ctx: on the device's primary context, so the shim
 *                              can learn the host pid and use per-process samples
 */
#include "tcommon.h"

#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    CHECK(argc == 3 || (argc == 4 && strcmp(argv[3], "ctx") == 0), "usage: %s TARGET SECONDS [ctx]", argv[0]);
    double target = atof(argv[1]), seconds = atof(argv[2]);
    double kernel_us = (double)env_mib("FAKE_KERNEL_US", 100);
    CHECK_CU(cuInit(0));
    if (argc == 4) {
        CUcontext c;
        CHECK_CU(cuDevicePrimaryCtxRetain(&c, 0));
        CHECK_CU(cuCtxSetCurrent(c));
    }
    double start = now_s(), tail_from = start + seconds - 1.0;
    unsigned long long tail = 0;
    for (double t = start; t < start + seconds; t = now_s()) {
        CHECK_CU(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        if (t >= tail_from)
            tail++;
    }
    double util = (double)tail * kernel_us / 1e6 * 100.0;
    printf("target %.0f%%: launched %.1f%% of the card in the last second (%llu launches)\n", target,
           util > 100 ? 100 : util, tail);
    if (target == 0)
        CHECK(util >= 100.0, "unlimited launches held to %.1f%%", util);
    else
        CHECK(util > target - 6.0 && util < target + 6.0, "held at %.1f%%, target %.0f%%", util, target);
    return 0;
}
