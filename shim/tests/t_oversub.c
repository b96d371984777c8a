/*
 * Virtual device memory: a slice whose resident part is below its limit.  One behaviour per run.
 *
 *   t_oversub CASE     (linked with -lcuda and -lnvidia-ml, run with the shim preloaded)
 * Environment: TESSERA_DEVICE_MEMORY_LIMIT_0=1024, TESSERA_DEVICE_MEMORY_RESIDENT_0=512 (MiB),
 * FAKE_CUDA_MEM_MIB=768 (the slice is larger than the card) unless the case says otherwise.
 * CASE:
 *   plain      below the resident part: plain allocations, served by cuMemAlloc_v2 / cuMemAllocPitch_v2
 *   managed    past it: served by cuMemAllocManaged, counted as spilled in the region
 *   limit      past the limit: refused without reaching the driver, whatever served the rest
 *   on_card    pool, stream-ordered, cuMemCreate and array allocations refused past the resident part
 *   no_access  (FAKE_CUDA_CONCURRENT_MANAGED=0) refused past the resident part, reported as that
 *   totals     cuMemGetInfo, cuDeviceTotalMem and NVML give the limit as total and the same free
 *   free       freeing a managed allocation gives back both counts; what follows is plain again
 *   pitch      a pitched allocation past the resident part: managed, with a pitch cuMemcpy2D takes
 *   second ARG a second process of the container: its allocations past the container's resident
 *              part are managed; ARG = MiB the region must show as resident before it starts
 *   plainall   (a setting that does not oversubscribe) 900 MiB, all of it plain
 *   card       (TESSERA_DEVICE_MEMORY_RESIDENT_0=1000) a resident part above the card is the card
 */
#include "tcommon.h"

#include <fcntl.h>
#include <nvml.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../region_layout.h"

static unsigned long long limit;

static int via(CUdeviceptr p)
{
    static fake_cuda_alloc_via_fn fn;
    if (fn == NULL)
        fn = (fake_cuda_alloc_via_fn)fake_cuda_symbol("fake_cuda_alloc_via");
    return fn((uint64_t)p);
}

/* The container's region as the node plugin reads it: used and spilled on device 0, all slots. */
static void region_counts(unsigned long long *used, unsigned long long *spilled)
{
    const char *path = getenv("TESSERA_SHARED_REGION");
    CHECK(path != NULL, "run with TESSERA_SHARED_REGION");
    int fd = open(path, O_RDONLY);
    CHECK(fd >= 0, "cannot open %s", path);
    struct tessera_region *r = mmap(NULL, sizeof *r, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(r != MAP_FAILED, "cannot map %s", path);
    close(fd);
    CHECK(r->hdr.version == TESSERA_REGION_VERSION, "region version %u", r->hdr.version);
    *used = *spilled = 0;
    for (unsigned i = 0; i < r->hdr.proc_hwm && i < TESSERA_MAX_PROCS; i++) {
        *used += r->proc[i].used[0];
        *spilled += r->proc[i].spilled[0];
    }
    munmap(r, sizeof *r);
}

static void expect_region(unsigned long long used_mib, unsigned long long spilled_mib)
{
    unsigned long long used, spilled;
    region_counts(&used, &spilled);
    CHECK(used == used_mib * MiB && spilled == spilled_mib * MiB,
          "region has %llu MiB used, %llu spilled; want %llu and %llu", used / MiB, spilled / MiB, used_mib,
          spilled_mib);
}

static void mem_info(size_t *f, size_t *t)
{
    CHECK_CU(cuMemGetInfo_v2(f, t));
}

static void case_plain(void)
{
    CUdeviceptr a, b;
    size_t pitch = 0;
    CHECK_CU(cuMemAlloc_v2(&a, 300 * MiB));
    CHECK(via(a) == FAKE_VIA_ALLOC, "served by %d, want cuMemAlloc_v2", via(a));
    CHECK_CU(cuMemAllocPitch_v2(&b, &pitch, 1000, 200 * 1024, 4)); /* 1024 x 200 Ki = 200 MiB */
    CHECK(via(b) == FAKE_VIA_PITCH, "served by %d, want cuMemAllocPitch_v2", via(b));
    CHECK(fake_stats().managed_calls == 0, "a managed call below the resident part");
    expect_region(500, 0);
}

static void case_managed(void)
{
    CUdeviceptr a, b;
    CHECK_CU(cuMemAlloc_v2(&a, 400 * MiB));
    CHECK_CU(cuMemAlloc_v2(&b, 300 * MiB));
    CHECK(via(a) == FAKE_VIA_ALLOC, "the first 400 MiB served by %d, want cuMemAlloc_v2", via(a));
    CHECK(via(b) == FAKE_VIA_MANAGED, "300 MiB past the 512 MiB resident part served by %d, want managed", via(b));
    struct fake_cuda_stats s = fake_stats();
    CHECK(s.managed_calls == 1, "%llu managed calls", (unsigned long long)s.managed_calls);
    /* The card (768 MiB) holds it all for now; the region counts it as past the resident part. */
    expect_region(700, 300);
    /* The application's own managed memory past the resident part is spilled the same way. */
    CUdeviceptr c;
    CHECK_CU(cuMemAllocManaged(&c, 200 * MiB, CU_MEM_ATTACH_GLOBAL));
    expect_region(900, 500);
    CHECK_CU(cuMemFree_v2(c));
    expect_region(700, 300);
}

static void case_limit(void)
{
    CUdeviceptr a, b, c;
    CHECK_CU(cuMemAlloc_v2(&a, 500 * MiB));
    CHECK_CU(cuMemAlloc_v2(&b, 500 * MiB));
    CHECK(via(b) == FAKE_VIA_MANAGED, "served by %d, want managed", via(b));
    /* The card is 768 MiB: 232 MiB of the managed allocation live in host memory. */
    CHECK(fake_stats().spilled_bytes[0] == 232 * MiB, "fake spilled %llu MiB",
          (unsigned long long)(fake_stats().spilled_bytes[0] / MiB));
    EXPECT_REFUSED(cuMemAlloc_v2(&c, 100 * MiB));
    EXPECT_REFUSED(cuMemAllocManaged(&c, 100 * MiB, CU_MEM_ATTACH_GLOBAL));
    CHECK_CU(cuMemAlloc_v2(&c, 24 * MiB)); /* exactly to the limit */
    expect_region(1024, 524);
}

static void case_on_card(void)
{
    CUdeviceptr a, b;
    CHECK_CU(cuMemAlloc_v2(&a, 400 * MiB));
    EXPECT_REFUSED(cuMemAllocAsync(&b, 200 * MiB, NULL));
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    CUmemGenericAllocationHandle h;
    EXPECT_REFUSED(cuMemCreate(&h, 200 * MiB, &prop, 0));
    CUDA_ARRAY_DESCRIPTOR ad = {.Width = 10 * 1024, .Height = 5 * 1024, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    CUarray arr;
    EXPECT_REFUSED(cuArrayCreate_v2(&arr, &ad)); /* 200 MiB */
    expect_region(400, 0);
    /* Within the resident part they are admitted, and held on the card. */
    CHECK_CU(cuMemCreate(&h, 100 * MiB, &prop, 0));
    CHECK_CU(cuMemAllocAsync(&b, 12 * MiB, NULL));
    expect_region(512, 0);
    /* Plain memory still spills past it. */
    CUdeviceptr c;
    CHECK_CU(cuMemAlloc_v2(&c, 200 * MiB));
    CHECK(via(c) == FAKE_VIA_MANAGED, "served by %d, want managed", via(c));
    /* What is on the card is what the budget sees, spilled memory aside: 412 MiB after the
     * free, so 50 MiB more fit. */
    CHECK_CU(cuMemRelease(h));
    CHECK_CU(cuMemCreate(&h, 50 * MiB, &prop, 0));
    expect_region(662, 200);
}

static void case_no_access(void)
{
    CUdeviceptr a, b;
    size_t f, t, total;
    mem_info(&f, &t);
    CUdevice d;
    CHECK_CU(cuDeviceGet(&d, 0));
    CHECK_CU(cuDeviceTotalMem_v2(&total, d));
    CHECK(t == 512 * MiB && total == 512 * MiB, "reported %llu / %llu MiB, want the resident part, 512", t / MiB,
          total / MiB);
    CHECK_CU(cuMemAlloc_v2(&a, 400 * MiB));
    EXPECT_REFUSED(cuMemAlloc_v2(&b, 200 * MiB));
    CHECK(fake_stats().managed_calls == 0, "a managed call on a device without concurrent managed access");
    CHECK_CU(cuMemAlloc_v2(&b, 112 * MiB));
    CHECK(via(b) == FAKE_VIA_ALLOC, "served by %d, want cuMemAlloc_v2", via(b));
}

static void nvml_info(unsigned long long *t, unsigned long long *f, unsigned long long *t2, unsigned long long *f2)
{
    nvmlDevice_t h;
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &h) == NVML_SUCCESS, "handle");
    nvmlMemory_t m;
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    m2.version = nvmlMemory_v2;
    CHECK(nvmlDeviceGetMemoryInfo(h, &m) == NVML_SUCCESS, "nvmlDeviceGetMemoryInfo");
    CHECK(nvmlDeviceGetMemoryInfo_v2(h, &m2) == NVML_SUCCESS, "nvmlDeviceGetMemoryInfo_v2");
    CHECK(m.used == m.total - m.free && m2.used == m2.total - m2.free, "NVML's used is not total - free");
    *t = m.total, *f = m.free, *t2 = m2.total, *f2 = m2.free;
}

static void case_totals(void)
{
    CUdevice d;
    size_t f, t, total;
    unsigned long long nt, nf, nt2, nf2;
    CHECK_CU(cuDeviceGet(&d, 0));
    for (int round = 0; round < 2; round++) {
        mem_info(&f, &t);
        CHECK_CU(cuDeviceTotalMem_v2(&total, d));
        nvml_info(&nt, &nf, &nt2, &nf2);
        CHECK(t == limit && total == limit && nt == limit && nt2 == limit,
              "totals: cuMemGetInfo %llu, cuDeviceTotalMem %llu, NVML %llu / %llu MiB; want the limit, 1024",
              t / MiB, total / MiB, nt / MiB, nt2 / MiB);
        unsigned long long want = round == 0 ? limit : limit - 700 * MiB;
        CHECK(f == want && nf == want && nf2 == want, "free: cuMemGetInfo %llu, NVML %llu / %llu MiB; want %llu",
              f / MiB, nf / MiB, nf2 / MiB, want / MiB);
        if (round == 0) {
            CUdeviceptr a, b;
            CHECK_CU(cuMemAlloc_v2(&a, 400 * MiB));
            CHECK_CU(cuMemAlloc_v2(&b, 300 * MiB));
        }
    }
}

static void case_free(void)
{
    CUdeviceptr a, b, c;
    CHECK_CU(cuMemAlloc_v2(&a, 400 * MiB));
    CHECK_CU(cuMemAlloc_v2(&b, 500 * MiB));
    CHECK(via(b) == FAKE_VIA_MANAGED, "served by %d, want managed", via(b));
    CHECK_CU(cuMemFree_v2(b));
    expect_region(400, 0);
    CHECK(fake_stats().spilled_bytes[0] == 0, "the driver still holds spilled memory");
    size_t f, t;
    mem_info(&f, &t);
    CHECK(f == limit - 400 * MiB, "free %llu MiB after the free, want 624", f / MiB);
    CHECK_CU(cuMemAlloc_v2(&c, 100 * MiB));
    CHECK(via(c) == FAKE_VIA_ALLOC, "within the resident part again, served by %d", via(c));
    CHECK_CU(cuMemFree_v2(a));
    CHECK_CU(cuMemFree_v2(c));
    expect_region(0, 0);
    CHECK_CU(cuMemAlloc_v2(&a, 1024 * MiB)); /* the whole slice once more: 512 plain would not do */
    CHECK(via(a) == FAKE_VIA_MANAGED, "served by %d, want managed", via(a));
}

static void case_pitch(void)
{
    CUdeviceptr a, b;
    size_t pitch = 0;
    CHECK_CU(cuMemAlloc_v2(&a, 400 * MiB));
    CHECK_CU(cuMemAllocPitch_v2(&b, &pitch, 1000, 200 * 1024, 8));
    CHECK(via(b) == FAKE_VIA_MANAGED, "served by %d, want managed", via(b));
    CHECK(pitch == 1024, "pitch %zu, want 1000 rounded up to 512", pitch);
    expect_region(600, 200);
    CUdeviceptr c;
    CHECK(cuMemAllocPitch_v2(&c, &pitch, 1000, 200 * 1024, 3) == CUDA_ERROR_INVALID_VALUE, "element size 3 taken");
    expect_region(600, 200);
    CHECK_CU(cuMemFree_v2(b));
    expect_region(400, 0);
}

static void case_second(const char *resident_before)
{
    unsigned long long used, spilled, want = strtoull(resident_before, NULL, 10) * MiB;
    region_counts(&used, &spilled);
    CHECK(used - spilled == want, "another process of the container holds %llu MiB, want %llu",
          (used - spilled) / MiB, want / MiB);
    CUdeviceptr a, b;
    CHECK_CU(cuMemAlloc_v2(&a, 100 * MiB));
    CHECK(via(a) == FAKE_VIA_ALLOC, "served by %d, want cuMemAlloc_v2", via(a));
    CHECK_CU(cuMemAlloc_v2(&b, 300 * MiB));
    CHECK(via(b) == FAKE_VIA_MANAGED, "past the container's resident part, served by %d", via(b));
    region_counts(&used, &spilled);
    CHECK(used == want + 400 * MiB && spilled == 300 * MiB, "region: %llu used, %llu spilled", used / MiB,
          spilled / MiB);
    size_t f, t;
    mem_info(&f, &t);
    CHECK(f == limit - used, "free %llu MiB, want the limit less both processes' %llu", f / MiB, used / MiB);
    EXPECT_REFUSED(cuMemAlloc_v2(&b, f + MiB));
}

static void case_plainall(void)
{
    CUdeviceptr a;
    CHECK_CU(cuMemAlloc_v2(&a, 900 * MiB));
    CHECK(via(a) == FAKE_VIA_ALLOC, "served by %d, want cuMemAlloc_v2", via(a));
    expect_region(900, 0);
}

static void case_card(void)
{
    CUdeviceptr a, b;
    CHECK_CU(cuMemAlloc_v2(&a, 700 * MiB));
    CHECK(via(a) == FAKE_VIA_ALLOC, "served by %d, want cuMemAlloc_v2", via(a));
    CHECK_CU(cuMemAlloc_v2(&b, 100 * MiB));
    CHECK(via(b) == FAKE_VIA_MANAGED, "past the card's 768 MiB, served by %d, want managed", via(b));
}

static const char *second_arg;
static void case_second_run(void)
{
    case_second(second_arg);
}

int main(int argc, char **argv)
{
    static const struct test_case cases[] = {
        {"plain", case_plain},   {"managed", case_managed},     {"limit", case_limit},
        {"on_card", case_on_card}, {"no_access", case_no_access}, {"totals", case_totals},
        {"free", case_free},     {"pitch", case_pitch},         {"second", case_second_run},
        {"plainall", case_plainall}, {"card", case_card},
    };
    if (argc == 3) {
        second_arg = argv[2];
        argc = 2;
    }
    return run_case(argc, argv, cases, sizeof cases / sizeof cases[0], &limit);
}
