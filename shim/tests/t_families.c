/*
 * One allocation family per run: counted against the limit, refused past it
 * without reaching the driver, and given back when freed.
 *
 *   t_families CASE     (linked with -lcuda, run with the shim preloaded)
 * CASE: pitch | managed | async | pool | pool_noattr | vmm | vmm_host | array | array3d |
 *       mipmap | errno | multidev | unknown_free
 * Environment: TESSERA_DEVICE_MEMORY_LIMIT_0=1024 (MiB) unless the case says otherwise.
 */
#include "tcommon.h"

#include <stdint.h>

static unsigned long long limit;

static size_t free_now(void)
{
    size_t f = 0, t = 0;
    CHECK_CU(cuMemGetInfo_v2(&f, &t));
    return f;
}

static void case_pitch(void)
{
    CUdeviceptr p, q;
    size_t pitch = 0, w = 1000, h = 300000; /* the fake pads rows to 512 bytes: pitch 1024 */
    CHECK_CU(cuMemAllocPitch_v2(&p, &pitch, w, h, 4));
    CHECK(pitch == 1024, "pitch %zu", pitch);
    CHECK(free_now() == limit - pitch * h, "counted %llu, want the padded size %zu", limit - free_now(), pitch * h);
    EXPECT_REFUSED(cuMemAllocPitch_v2(&q, &pitch, w, 800000, 4));
    CHECK_CU(cuMemFree_v2(p));
    CHECK(free_now() == limit, "not given back");
}

static void case_managed(void)
{
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocManaged(&p, 700 * MiB, CU_MEM_ATTACH_GLOBAL));
    CHECK(free_now() == limit - 700 * MiB, "managed memory not counted");
    EXPECT_REFUSED(cuMemAllocManaged(&q, 400 * MiB, CU_MEM_ATTACH_GLOBAL));
    CHECK_CU(cuMemFree_v2(p));
    CHECK(free_now() == limit, "not given back");
}

/* The device's pool keeps what is freed until a synchronisation gives it back (threshold 0). */
static void case_async(void)
{
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocAsync(&p, 700 * MiB, NULL));
    CHECK(free_now() == limit - 700 * MiB, "async memory not counted");
    EXPECT_REFUSED(cuMemAllocAsync(&q, 400 * MiB, NULL));
    CHECK_CU(cuMemFreeAsync(p, NULL));
    CHECK(free_now() == limit - 700 * MiB, "the pool still holds 700 MiB but %llu MiB are counted",
          (limit - free_now()) >> 20);
    CHECK_CU(cuStreamSynchronize(NULL));
    CHECK(free_now() == limit, "the pool gave its memory back but %llu MiB are still counted",
          (limit - free_now()) >> 20);
    CHECK_CU(cuMemAllocAsync(&q, 1000 * MiB, NULL));
}

/* An allocation the pool serves from its cache costs nothing more; a trim gives the cache back. */
static void case_pool(void)
{
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUmemoryPool pool;
    CHECK_CU(cuMemPoolCreate(&pool, &props));
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocFromPoolAsync(&p, 700 * MiB, pool, NULL));
    CHECK(free_now() == limit - 700 * MiB, "pool memory not counted");
    EXPECT_REFUSED(cuMemAllocFromPoolAsync(&q, 400 * MiB, pool, NULL));
    CHECK_CU(cuMemFreeAsync(p, NULL));
    CHECK(free_now() == limit - 700 * MiB, "the pool's cache is not counted");
    CHECK_CU(cuMemAllocFromPoolAsync(&q, 400 * MiB, pool, NULL)); /* from the cache: 700 MiB in all still */
    CHECK(free_now() == limit - 700 * MiB, "an allocation from the cache was counted again");
    CHECK_CU(cuMemPoolTrimTo(pool, 0));
    CHECK(free_now() == limit - 400 * MiB, "after the trim %llu MiB counted, want 400", (limit - free_now()) >> 20);
    CHECK_CU(cuMemFreeAsync(q, NULL));
    CHECK_CU(cuMemPoolDestroy(pool));
    CHECK(free_now() == limit, "a destroyed pool is still counted");
}

/* A driver without pool attributes: each allocation is counted by itself, as asked for. */
static void case_pool_noattr(void)
{
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocAsync(&p, 700 * MiB, NULL));
    CHECK(free_now() == limit - 700 * MiB, "async memory not counted");
    EXPECT_REFUSED(cuMemAllocAsync(&q, 400 * MiB, NULL));
    CHECK_CU(cuMemFreeAsync(p, NULL));
    CHECK(free_now() == limit, "not given back");
}

static CUmemAllocationProp prop_at(CUmemLocationType type, int id)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = type;
    prop.location.id = id;
    return prop;
}

static void case_vmm(void)
{
    CUmemAllocationProp prop = prop_at(CU_MEM_LOCATION_TYPE_DEVICE, 0);
    CUmemGenericAllocationHandle a, b;
    CHECK_CU(cuMemCreate(&a, 512 * MiB, &prop, 0));
    CHECK(free_now() == limit - 512 * MiB, "cuMemCreate not counted");
    EXPECT_REFUSED(cuMemCreate(&b, 768 * MiB, &prop, 0));
    CHECK_CU(cuMemRelease(a));
    CHECK(free_now() == limit, "not given back");
    CHECK_CU(cuMemCreate(&b, 768 * MiB, &prop, 0));
}

static void case_vmm_host(void)
{
    CUmemAllocationProp prop = prop_at(CU_MEM_LOCATION_TYPE_HOST, 0);
    CUmemGenericAllocationHandle a;
    CHECK_CU(cuMemCreate(&a, 2048 * MiB, &prop, 0)); /* host memory is not the slice's */
    CHECK(free_now() == limit, "host allocation was counted");
    CHECK_CU(cuMemRelease(a));
}

static void case_array(void)
{
    CUDA_ARRAY_DESCRIPTOR d = {.Width = 4096, .Height = 4096, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CUarray a, b;
    CHECK_CU(cuArrayCreate_v2(&a, &d)); /* 4096 * 4096 * 4 channels * 4 bytes = 256 MiB */
    CHECK(free_now() == limit - 256 * MiB, "array counted as %llu", limit - free_now());
    CUDA_ARRAY_DESCRIPTOR big = {.Width = 8192, .Height = 8192, .Format = CU_AD_FORMAT_UNSIGNED_INT16,
                                 .NumChannels = 4}; /* 512 MiB: fits; then one more does not */
    CHECK_CU(cuArrayCreate_v2(&b, &big));
    CUarray c;
    EXPECT_REFUSED(cuArrayCreate_v2(&c, &big));
    CHECK_CU(cuArrayDestroy(a));
    CHECK_CU(cuArrayDestroy(b));
    CHECK(free_now() == limit, "not given back");
}

static void case_array3d(void)
{
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 512, .Height = 512, .Depth = 512, .Format = CU_AD_FORMAT_UNSIGNED_INT8,
                                 .NumChannels = 2}; /* 256 MiB */
    CUarray a, b, c, e;
    CHECK_CU(cuArray3DCreate_v2(&a, &d));
    CHECK(free_now() == limit - 256 * MiB, "3D array counted as %llu", limit - free_now());
    CHECK_CU(cuArray3DCreate_v2(&b, &d));
    CHECK_CU(cuArray3DCreate_v2(&c, &d));
    CHECK_CU(cuArray3DCreate_v2(&e, &d)); /* exactly the limit */
    CUarray f;
    EXPECT_REFUSED(cuArray3DCreate_v2(&f, &d));
    CHECK_CU(cuArrayDestroy(c));
    CHECK_CU(cuArray3DCreate_v2(&f, &d));
}

static void case_mipmap(void)
{
    /* 4096^2 floats, 3 levels: 64 + 16 + 4 MiB */
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 4096, .Height = 4096, .Depth = 0, .Format = CU_AD_FORMAT_FLOAT,
                                 .NumChannels = 1};
    CUmipmappedArray m, n;
    CHECK_CU(cuMipmappedArrayCreate(&m, &d, 3));
    CHECK(free_now() == limit - 84 * MiB, "mipmapped array counted as %llu", limit - free_now());
    CUDA_ARRAY3D_DESCRIPTOR big = d;
    big.Width = big.Height = 16384; /* 1 GiB at level 0 alone */
    EXPECT_REFUSED(cuMipmappedArrayCreate(&n, &big, 1));
    CHECK_CU(cuMipmappedArrayDestroy(m));
    CHECK(free_now() == limit, "not given back");
}

/* The shim leaves errno as the driver left it, on success and on refusal. */
static void case_errno(void)
{
    CUdeviceptr p, q;
    errno = 4242;
    CHECK_CU(cuMemAlloc_v2(&p, 600 * MiB));
    CHECK(errno == 4242, "errno %d after an allocation", errno);
    CHECK(cuMemAlloc_v2(&q, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "admitted");
    CHECK(errno == 4242, "errno %d after a refusal", errno);
    CHECK_CU(cuMemFree_v2(p));
    CHECK(errno == 4242, "errno %d after a free", errno);
}

/* FAKE_CUDA_DEVICES=2, limit 1024 MiB on device 0, 256 MiB on device 1. */
static void case_multidev(void)
{
    CUcontext c0, c1;
    CHECK_CU(cuDevicePrimaryCtxRetain(&c0, 0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&c1, 1));
    size_t total;
    CHECK_CU(cuDeviceTotalMem_v2(&total, 1));
    CHECK(total == 256 * MiB, "device 1 total %zu", total);
    CHECK_CU(cuCtxSetCurrent(c1));
    size_t f, t;
    CHECK_CU(cuMemGetInfo_v2(&f, &t));
    CHECK(t == 256 * MiB, "device 1 cuMemGetInfo total %zu", t);
    CUdeviceptr p;
    EXPECT_REFUSED(cuMemAlloc_v2(&p, 300 * MiB));
    CHECK_CU(cuCtxSetCurrent(c0));
    CHECK_CU(cuMemAlloc_v2(&p, 300 * MiB)); /* device 0 has its own, larger limit */
    CHECK_CU(cuCtxSetCurrent(c1));
    CHECK_CU(cuMemGetInfo_v2(&f, &t));
    CHECK(f == 256 * MiB, "device 0's allocation was counted on device 1");
}

/* Freeing memory the shim never saw (allocated before the limit applied) is passed through. */
static void case_unknown_free(void)
{
    CHECK(cuMemFree_v2((CUdeviceptr)0x1234) == CUDA_ERROR_INVALID_VALUE, "bogus free not passed through");
    CHECK(free_now() == limit, "bogus free changed the count");
}

int main(int argc, char **argv)
{
    static const struct test_case cases[] = {
        {"pitch", case_pitch},   {"managed", case_managed},   {"async", case_async},
        {"pool", case_pool},     {"pool_noattr", case_pool_noattr}, {"vmm", case_vmm},
        {"vmm_host", case_vmm_host},
        {"array", case_array},   {"array3d", case_array3d},   {"mipmap", case_mipmap},
        {"errno", case_errno},   {"multidev", case_multidev}, {"unknown_free", case_unknown_free},
    };
    return run_case(argc, argv, cases, sizeof cases / sizeof cases[0], &limit);
}
