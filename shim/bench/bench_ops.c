/*
 * Nanoseconds per cuMemAlloc_v2 + cuMemFree_v2 pair and per cuLaunchKernel,
 * against the fake driver; median over RUNS runs of ITERS calls.  Run once
 * plain and once with the shim preloaded (bench.sh does both).
 * Output: "alloc_free_ns <median>" and "launch_ns <median>".
 */
#include <cuda.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define RUNS 21
#define ITERS 200000

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[n / 2];
}

int main(void)
{
    if (cuInit(0) != CUDA_SUCCESS)
        return 1;
    double alloc[RUNS], launch[RUNS];
    CUdeviceptr p;
    for (int r = 0; r < RUNS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < ITERS; i++) {
            if (cuMemAlloc_v2(&p, 1 << 20) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS)
                return 1;
        }
        double t1 = now_ns();
        for (int i = 0; i < ITERS; i++)
            if (cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
                return 1;
        double t2 = now_ns();
        alloc[r] = (t1 - t0) / ITERS;
        launch[r] = (t2 - t1) / ITERS;
    }
    printf("alloc_free_ns %.1f\nlaunch_ns %.2f\n", median(alloc, RUNS), median(launch, RUNS));
    return 0;
}
