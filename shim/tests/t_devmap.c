/*
 * NVML's devices are matched to CUDA's by identity, not by position.
 *
 *   t_devmap cuda|nvml TOTALS     TOTALS: the memory total (MiB) NVML must report for each
 *                                 NVML index, comma-separated.  "cuda" initialises CUDA
 *                                 first (identities from the driver); "nvml" never does, as
 *                                 nvidia-smi or a launcher that forks later
 *
 * Run with two fake cards listed in CUDA_VISIBLE_DEVICES in the opposite of NVML's
 * (PCI) order and a different limit on each CUDA ordinal: a shim that took NVML's
 * index for the ordinal would report each card with the other's limit.
 */
#include "tcommon.h"

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

typedef nvmlReturn_t (*init_fn)(void);
typedef nvmlReturn_t (*handle_fn)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*mem_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*mem2_fn)(nvmlDevice_t, nvmlMemory_v2_t *);

int main(int argc, char **argv)
{
    CHECK(argc == 3, "usage: %s cuda|nvml TOTALS", argv[0]);
    if (strcmp(argv[1], "cuda") == 0) {
        void *cu = dlopen("libcuda.so.1", RTLD_NOW);
        CHECK(cu != NULL, "dlopen libcuda.so.1: %s", dlerror());
        CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(cu, "cuInit");
        CHECK(init != NULL && init(0) == CUDA_SUCCESS, "cuInit");
    } else {
        CHECK(strcmp(argv[1], "nvml") == 0, "unknown mode %s", argv[1]);
    }
    void *ml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(ml != NULL, "dlopen libnvidia-ml.so.1: %s", dlerror());
    init_fn init = (init_fn)dlsym(ml, "nvmlInit_v2");
    handle_fn by_index = (handle_fn)dlsym(ml, "nvmlDeviceGetHandleByIndex_v2");
    mem_fn mem = (mem_fn)dlsym(ml, "nvmlDeviceGetMemoryInfo");
    mem2_fn mem2 = (mem2_fn)dlsym(ml, "nvmlDeviceGetMemoryInfo_v2");
    CHECK(init && by_index && mem && mem2, "NVML entry points missing");
    CHECK(init() == NVML_SUCCESS, "nvmlInit_v2");
    char buf[256];
    snprintf(buf, sizeof buf, "%s", argv[2]);
    unsigned index = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save), index++) {
        unsigned long long want = strtoull(tok, NULL, 10) * MiB;
        nvmlDevice_t d;
        CHECK(by_index(index, &d) == NVML_SUCCESS, "no NVML device %u", index);
        nvmlMemory_t m;
        CHECK(mem(d, &m) == NVML_SUCCESS, "nvmlDeviceGetMemoryInfo(%u)", index);
        CHECK(m.total == want, "NVML device %u reports %llu MiB, want %llu", index, m.total >> 20, want >> 20);
        nvmlMemory_v2_t m2 = {.version = nvmlMemory_v2};
        CHECK(mem2(d, &m2) == NVML_SUCCESS, "nvmlDeviceGetMemoryInfo_v2(%u)", index);
        CHECK(m2.total == want, "NVML device %u reports %llu MiB (v2), want %llu", index, m2.total >> 20, want >> 20);
    }
    return 0;
}
