/*
 * One memory behaviour through one interposition path.
 *
 *   t_mem_linked linked CASE          the program calls the driver API it linked with -lcuda
 *   t_mem_dl     dlsym|gpa1|gpa2|gpa2_ptds|gpa_chain CASE
 *                                     dlopen("libcuda.so.1") + dlsym, or cuGetProcAddress
 *                                     (v1, v2, v2 asking for per-thread-stream variants, or v2
 *                                     fetched through cuGetProcAddress itself, as the runtime does)
 * CASE: report | refuse | realloc | async | variants
 *
 * Environment: TESSERA_DEVICE_MEMORY_LIMIT_0 (MiB) is the limit the case expects.
 */
#include "tcommon.h"

#include <stdint.h>

typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

static struct {
    CUresult (*init)(unsigned);
    CUresult (*get_info)(size_t *, size_t *);
    CUresult (*total_mem)(size_t *, CUdevice);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_async)(CUdeviceptr, CUstream);
    launch_fn launch;
} api;

static void *lib;
static const char *mode;
static gpa1_fn gpa1;
static gpa2_fn gpa2;
static cuuint64_t gpa_flags;

static void *lookup(const char *base, int version)
{
    void *p = NULL;
    CUresult r;
    if (gpa1 != NULL) {
        r = gpa1(base, &p, version, gpa_flags);
    } else {
        CUdriverProcAddressQueryResult st;
        r = gpa2(base, &p, version, gpa_flags, &st);
        if (r == CUDA_SUCCESS)
            CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS, "status %d for %s", (int)st, base);
    }
    return r == CUDA_SUCCESS ? p : NULL;
}

static void load(void)
{
#ifdef LINKED
    CHECK(strcmp(mode, "linked") == 0, "this build only runs the linked path");
    api.init = cuInit;
    api.get_info = cuMemGetInfo_v2;
    api.total_mem = cuDeviceTotalMem_v2;
    api.alloc = cuMemAlloc_v2;
    api.free = cuMemFree_v2;
    api.alloc_async = cuMemAllocAsync;
    api.free_async = cuMemFreeAsync;
    api.launch = cuLaunchKernel;
    lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
#else
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen libcuda.so.1: %s", dlerror());
    if (strcmp(mode, "dlsym") == 0) {
        api.init = (__typeof__(api.init))dlsym(lib, "cuInit");
        api.get_info = (__typeof__(api.get_info))dlsym(lib, "cuMemGetInfo_v2");
        api.total_mem = (__typeof__(api.total_mem))dlsym(lib, "cuDeviceTotalMem_v2");
        api.alloc = (__typeof__(api.alloc))dlsym(lib, "cuMemAlloc_v2");
        api.free = (__typeof__(api.free))dlsym(lib, "cuMemFree_v2");
        api.alloc_async = (__typeof__(api.alloc_async))dlsym(lib, "cuMemAllocAsync");
        api.free_async = (__typeof__(api.free_async))dlsym(lib, "cuMemFreeAsync");
        api.launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    } else {
        if (strcmp(mode, "gpa1") == 0) {
            gpa1 = (gpa1_fn)dlsym(lib, "cuGetProcAddress");
        } else {
            gpa2 = (gpa2_fn)dlsym(lib, "cuGetProcAddress_v2");
            CHECK(gpa2 != NULL, "no cuGetProcAddress_v2");
            if (strcmp(mode, "gpa2_ptds") == 0)
                gpa_flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
            else if (strcmp(mode, "gpa_chain") == 0)
                gpa2 = (gpa2_fn)lookup("cuGetProcAddress", 12000);
            else
                CHECK(strcmp(mode, "gpa2") == 0, "unknown mode %s", mode);
        }
        CHECK(gpa1 != NULL || gpa2 != NULL, "no cuGetProcAddress");
        api.init = (__typeof__(api.init))lookup("cuInit", 12000);
        api.get_info = (__typeof__(api.get_info))lookup("cuMemGetInfo", 12000);
        api.total_mem = (__typeof__(api.total_mem))lookup("cuDeviceTotalMem", 12000);
        api.alloc = (__typeof__(api.alloc))lookup("cuMemAlloc", 12000);
        api.free = (__typeof__(api.free))lookup("cuMemFree", 12000);
        api.alloc_async = (__typeof__(api.alloc_async))lookup("cuMemAllocAsync", 12000);
        api.free_async = (__typeof__(api.free_async))lookup("cuMemFreeAsync", 12000);
        api.launch = (launch_fn)lookup("cuLaunchKernel", 12000);
    }
#endif
    CHECK(api.init && api.get_info && api.total_mem && api.alloc && api.free && api.alloc_async &&
              api.free_async && api.launch,
          "an entry point is missing in mode %s", mode);
    CHECK_CU(api.init(0));
}

static unsigned long long limit;

static void case_report(void)
{
    size_t free = 0, total = 0, dev_total = 0;
    CHECK_CU(api.get_info(&free, &total));
    CHECK(total == limit, "cuMemGetInfo total %zu, want limit %llu", total, limit);
    CHECK(free == limit, "cuMemGetInfo free %zu, want %llu", free, limit);
    CHECK_CU(api.total_mem(&dev_total, 0));
    CHECK(dev_total == limit, "cuDeviceTotalMem %zu, want %llu", dev_total, limit);
}

static void case_refuse(void)
{
    CUdeviceptr a = 0, b = 0;
    size_t part = (size_t)(limit * 6 / 10);
    CHECK_CU(api.alloc(&a, part));
    struct fake_cuda_stats before = fake_stats();
    CUresult r = api.alloc(&b, part);
    struct fake_cuda_stats after = fake_stats();
    CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "allocation past the limit returned %d", (int)r);
    CHECK(after.alloc_calls == before.alloc_calls, "the refused allocation reached the driver");
    CHECK(after.used_bytes[0] == part, "driver holds %llu bytes, want %zu",
          (unsigned long long)after.used_bytes[0], part);
}

static void case_realloc(void)
{
    CUdeviceptr a = 0, b = 0;
    size_t part = (size_t)(limit * 6 / 10);
    CHECK_CU(api.alloc(&a, part));
    CHECK(api.alloc(&b, part) == CUDA_ERROR_OUT_OF_MEMORY, "second allocation admitted");
    CHECK_CU(api.free(a));
    CHECK_CU(api.alloc(&b, part));
    size_t free = 0, total = 0;
    CHECK_CU(api.get_info(&free, &total));
    CHECK(free == limit - part, "free %zu after free+alloc, want %llu", free, limit - part);
    CHECK_CU(api.free(b));
    CHECK_CU(api.get_info(&free, &total));
    CHECK(free == limit, "free %zu after freeing everything, want %llu", free, limit);
}

/* Stream-ordered allocation and a launch through the variant the mode asked for. */
static void case_async(void)
{
    int want_ptsz = gpa_flags != 0;
    CUdeviceptr a = 0, b = 0;
    size_t part = (size_t)(limit * 6 / 10);
    struct fake_cuda_stats s0 = fake_stats();
    CHECK_CU(api.alloc_async(&a, part, NULL));
    struct fake_cuda_stats s1 = fake_stats();
    CHECK((s1.ptsz_calls - s0.ptsz_calls) == (uint64_t)want_ptsz, "ptsz calls %llu, want %d",
          (unsigned long long)(s1.ptsz_calls - s0.ptsz_calls), want_ptsz);
    CHECK(api.alloc_async(&b, part, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "async allocation past the limit admitted");
    struct fake_cuda_stats s2 = fake_stats();
    CHECK(s2.alloc_calls == s1.alloc_calls, "refused async allocation reached the driver");
    CHECK_CU(api.free_async(a, NULL));
    CHECK_CU(api.alloc_async(&b, part, NULL));
    CHECK_CU(api.launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    struct fake_cuda_stats s3 = fake_stats();
    CHECK(s3.launches == s0.launches + 1, "launch did not reach the driver");
    CHECK((s3.ptsz_calls - s0.ptsz_calls) == (uint64_t)(4 * want_ptsz), "ptsz calls %llu, want %d",
          (unsigned long long)(s3.ptsz_calls - s0.ptsz_calls), 4 * want_ptsz);
}

/* Which symbol, in which library, cuGetProcAddress handed out. */
static void expect_variant(const char *base, int version, cuuint64_t flags, const char *want_sym,
                           const char *want_lib)
{
    cuuint64_t saved = gpa_flags;
    gpa_flags = flags;
    void *p = lookup(base, version);
    gpa_flags = saved;
    if (want_sym == NULL) {
        CHECK(p == NULL, "%s at %d should not be found", base, version);
        return;
    }
    CHECK(p != NULL, "%s at %d not found", base, version);
    Dl_info info;
    CHECK(dladdr(p, &info) && info.dli_sname != NULL, "no symbol for %s", base);
    CHECK(strcmp(info.dli_sname, want_sym) == 0, "%s at %d flags %llu gave %s, want %s", base, version,
          (unsigned long long)flags, info.dli_sname, want_sym);
    CHECK(strstr(info.dli_fname, want_lib) != NULL, "%s came from %s, want %s", base, info.dli_fname, want_lib);
}

static void case_variants(void)
{
    CHECK(gpa1 != NULL || gpa2 != NULL, "variants needs a cuGetProcAddress mode");
    const cuuint64_t P = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, L = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
    expect_variant("cuMemAlloc", 12000, 0, "cuMemAlloc_v2", "libtessera");
    expect_variant("cuLaunchKernel", 12000, L, "cuLaunchKernel", "libtessera");
    expect_variant("cuLaunchKernel", 12000, P, "cuLaunchKernel_ptsz", "libtessera");
    expect_variant("cuLaunchKernelEx", 12000, P, "cuLaunchKernelEx_ptsz", "libtessera");
    expect_variant("cuLaunchCooperativeKernel", 12000, P, "cuLaunchCooperativeKernel_ptsz", "libtessera");
    expect_variant("cuGraphLaunch", 12000, P, "cuGraphLaunch_ptsz", "libtessera");
    expect_variant("cuMemAllocAsync", 12000, P, "cuMemAllocAsync_ptsz", "libtessera");
    expect_variant("cuMemFreeAsync", 12000, 0, "cuMemFreeAsync", "libtessera");
    expect_variant("cuMemAllocFromPoolAsync", 12000, P, "cuMemAllocFromPoolAsync_ptsz", "libtessera");
    expect_variant("cuGetProcAddress", 11030, 0, "cuGetProcAddress", "libtessera");
    expect_variant("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", "libtessera");
    expect_variant("cuMemAllocAsync", 11000, 0, NULL, NULL);           /* older than the API: driver says no */
    expect_variant("cuDriverGetVersion", 12000, 0, "cuDriverGetVersion", "libcuda"); /* not hooked */
}

int main(int argc, char **argv)
{
    CHECK(argc == 3, "usage: %s MODE CASE", argv[0]);
    mode = argv[1];
    limit = env_mib("TESSERA_DEVICE_MEMORY_LIMIT_0", 0) * MiB;
    CHECK(limit != 0, "set TESSERA_DEVICE_MEMORY_LIMIT_0");
    load();
    const char *c = argv[2];
    if (strcmp(c, "report") == 0)
        case_report();
    else if (strcmp(c, "refuse") == 0)
        case_refuse();
    else if (strcmp(c, "realloc") == 0)
        case_realloc();
    else if (strcmp(c, "async") == 0)
        case_async();
    else if (strcmp(c, "variants") == 0)
        case_variants();
    else
        CHECK(0, "unknown case %s", c);
    return 0;
}
