/*
 * Memory the card gives a process beyond its allocations is charged to the slice:
 * one behaviour per run.
 *
 *   t_driver CASE     (linked with -lcuda, run with the shim preloaded, limit 1024 MiB)
 * CASE:
 *   context   FAKE_CUDA_CTX_MIB=300: the primary context is charged, what is left of the
 *             slice is refused past it, and the charge goes when the context does
 *   created   FAKE_CUDA_CTX_MIB=300: the same for a context from cuCtxCreate
 *   exact     FAKE_CUDA_CTX_MIB=300, FAKE_NVML_DRIFT_MIB: the card-wide figure drifts while
 *             the context is created; NVML's per-process figure sets the charge exactly
 *   estimate  the same drift with no per-process figures: the charge is the measured
 *             estimate, never less than the truth
 *   module    FAKE_CUDA_MODULE_MIB=100: module and library loads are charged, unloads not
 *   hidden    FAKE_CUDA_HIDDEN_MIB=200: memory the driver takes at the first launch, which
 *             no call reports, is found through NVML before it lets the slice overflow
 *   graph     FAKE_CUDA_GRAPH_MIB=256: graph memory is charged at each new graph's first
 *             launch, not again for the same graph, and given back by a trim
 *   cache_over  FAKE_CUDA_HIDDEN_MIB=400: a container the driver's own memory pushed over its
 *             limit is still given what its pool serves from cache (it costs nothing more)
 */
#include "tcommon.h"

#include <stdint.h>
#include <unistd.h>

static unsigned long long limit;

static unsigned long long used_now(void)
{
    size_t f = 0, t = 0;
    CHECK_CU(cuMemGetInfo_v2(&f, &t));
    CHECK(t == limit, "total %zu, want the limit", t);
    return limit - f;
}

#define EXPECT_USED(mib, what)                                                                  \
    do {                                                                                        \
        unsigned long long u_ = used_now();                                                     \
        CHECK(u_ == (unsigned long long)(mib) * MiB, "%s: %llu MiB counted, want %llu", what, u_ >> 20, \
              (unsigned long long)(mib));                                                       \
    } while (0)

static CUcontext primary(void)
{
    CUcontext c;
    CHECK_CU(cuDevicePrimaryCtxRetain(&c, 0));
    CHECK_CU(cuCtxSetCurrent(c));
    return c;
}

static void case_context(void)
{
    EXPECT_USED(0, "before any context");
    primary();
    EXPECT_USED(300, "with the primary context");
    CUdeviceptr p;
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 725 * MiB));
    CHECK_CU(cuMemAlloc_v2(&p, 724 * MiB)); /* the rest of the slice */
    CHECK_CU(cuMemFree_v2(p));
    CUcontext again;
    CHECK_CU(cuDevicePrimaryCtxRetain(&again, 0)); /* already there: no new charge */
    EXPECT_USED(300, "after retaining it twice");
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0));
    EXPECT_USED(300, "while one reference is held");
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0));
    EXPECT_USED(0, "after the context is gone");
}

static void case_created(void)
{
    CUcontext c;
#if CUDA_VERSION >= 12050
    CHECK_CU(cuCtxCreate_v4(&c, NULL, 0, 0));
#else
    CHECK_CU(cuCtxCreate_v2(&c, 0, 0));
#endif
    EXPECT_USED(300, "with a created context");
    CUdeviceptr p;
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 725 * MiB));
    CHECK_CU(cuCtxDestroy_v2(c));
    EXPECT_USED(0, "after the context is destroyed");
}

static void case_exact(void)
{
    primary();
    EXPECT_USED(300, "a drifting card-wide figure, corrected by the per-process one");
}

static void case_estimate(void)
{
    primary();
    unsigned long long u = used_now();
    CHECK(u > 300 * MiB, "only the card-wide figure is known; %llu MiB counted, want more than 300", u >> 20);
}

static void case_module(void)
{
    primary();
    CUmodule m;
    CUlibrary l;
    CHECK_CU(cuModuleLoadData(&m, "image"));
    EXPECT_USED(100, "after a module load");
    CHECK_CU(cuLibraryLoadData(&l, "code", NULL, NULL, 0, NULL, NULL, 0));
    EXPECT_USED(200, "after a library load");
    CUdeviceptr p;
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 825 * MiB));
    CHECK_CU(cuModuleUnload(m));
    CHECK_CU(cuLibraryUnload(l));
    EXPECT_USED(0, "after both are unloaded");
}

static void case_hidden(void)
{
    primary();
    CHECK_CU(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)); /* the driver takes 200 MiB */
    usleep(30000); /* well past the shim's least time between looks at NVML */
    CUdeviceptr p;
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 900 * MiB));
    CHECK_CU(cuMemAlloc_v2(&p, 824 * MiB));
    EXPECT_USED(1024, "the driver's 200 MiB and the allocation");
    struct fake_cuda_stats s = fake_stats();
    CHECK(s.used_bytes[0] <= limit, "the card gives the process %llu MiB, more than the slice",
          (unsigned long long)s.used_bytes[0] >> 20);
}

static void case_graph(void)
{
    primary();
    CUgraphExec a = (CUgraphExec)(uintptr_t)0xa, b = (CUgraphExec)(uintptr_t)0xb;
    CHECK_CU(cuGraphLaunch(a, NULL));
    EXPECT_USED(256, "after graph a's first launch");
    CHECK_CU(cuGraphLaunch(a, NULL));
    EXPECT_USED(256, "after launching graph a again");
    CHECK_CU(cuGraphLaunch(b, NULL));
    EXPECT_USED(512, "after graph b's first launch");
    CUdeviceptr p;
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 600 * MiB));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    EXPECT_USED(0, "after the trim");
    CHECK_CU(cuMemAlloc_v2(&p, 600 * MiB));
}

static void case_cache_over(void)
{
    primary();
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocAsync(&p, 700 * MiB, NULL));
    CHECK_CU(cuMemFreeAsync(p, NULL)); /* the pool keeps the 700 MiB */
    CHECK_CU(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)); /* the driver takes 400 MiB */
    usleep(30000);
    EXPECT_USED(1024, "over the limit (the report never goes below 0 free)");
    CHECK_CU(cuMemAllocAsync(&q, 400 * MiB, NULL));
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 1 * MiB)); /* anything new is refused */
}

int main(int argc, char **argv)
{
    static const struct test_case cases[] = {
        {"context", case_context}, {"created", case_created}, {"exact", case_exact}, {"estimate", case_estimate},
        {"module", case_module},   {"hidden", case_hidden},   {"graph", case_graph},
        {"cache_over", case_cache_over},
    };
    return run_case(argc, argv, cases, sizeof cases / sizeof cases[0], &limit);
}
