/*
 * A stand-in for libnvidia-ml.so.1: what pynvml and the shim call.
 *
 * FAKE_CUDA_MEM_MIB   card size in MiB (default 16384), shared with the fake libcuda
 * FAKE_CUDA_DEVICES   number of cards (default 1)
 * FAKE_NVML_USED_MIB  memory the card reports as used (default 0)
 * FAKE_NVML_UTIL      GPU utilisation: a percentage, or "model": utilisation
 *                     follows the fake libcuda's launches in this process, each
 *                     launch keeping the GPU busy FAKE_KERNEL_US microseconds
 */
#include "fake.h"

#define NVML_NO_UNVERSIONED_FUNC_DEFS /* name every versioned entry point explicitly */
#include <nvml.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

struct fake_dev {
    unsigned index;
};
static struct fake_dev devs[FAKE_MAX_DEVICES];
static unsigned count = 1;
static unsigned long long card_bytes = 16384ull << 20;
static unsigned long long used_bytes;
static int util_model;
static unsigned util_fixed;
static double kernel_us = 100.0;

__attribute__((constructor)) static void fake_init(void)
{
    const char *s;
    if ((s = getenv("FAKE_CUDA_MEM_MIB")) && *s)
        card_bytes = strtoull(s, NULL, 10) << 20;
    if ((s = getenv("FAKE_CUDA_DEVICES")) && *s)
        count = (unsigned)atoi(s);
    if (count < 1 || count > FAKE_MAX_DEVICES)
        count = 1;
    if ((s = getenv("FAKE_NVML_USED_MIB")) && *s)
        used_bytes = strtoull(s, NULL, 10) << 20;
    if ((s = getenv("FAKE_NVML_UTIL")) && *s) {
        if (strcmp(s, "model") == 0)
            util_model = 1;
        else
            util_fixed = (unsigned)atoi(s);
    }
    if ((s = getenv("FAKE_KERNEL_US")) && *s)
        kernel_us = atof(s);
    for (unsigned i = 0; i < FAKE_MAX_DEVICES; i++)
        devs[i].index = i;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlInit(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
EXPORT const char *nvmlErrorString(nvmlReturn_t r) { return r == NVML_SUCCESS ? "Success" : "Fake NVML error"; }
EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int n)
{
    snprintf(v, n, "999.99");
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { *n = count; return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (i >= count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)&devs[i];
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *i)
{
    *i = ((struct fake_dev *)d)->index;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int n)
{
    snprintf(name, n, "Fake GPU %u", ((struct fake_dev *)d)->index);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    (void)d;
    m->total = card_bytes;
    m->used = used_bytes;
    m->free = card_bytes - used_bytes;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    (void)d;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = card_bytes;
    m->reserved = 300ull << 20;
    m->used = used_bytes;
    m->free = card_bytes - used_bytes - m->reserved;
    return NVML_SUCCESS;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    (void)d;
    u->memory = 0;
    if (!util_model) {
        u->gpu = util_fixed;
        return NVML_SUCCESS;
    }
    static fake_cuda_launch_count_fn launches;
    static uint64_t last_count;
    static double last_us;
    if (launches == NULL)
        launches = (fake_cuda_launch_count_fn)dlsym(RTLD_DEFAULT, "fake_cuda_launch_count");
    if (launches == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    uint64_t c = launches();
    double t = now_us();
    double busy = last_us > 0 ? (double)(c - last_count) * kernel_us / (t - last_us) * 100.0 : 0.0;
    last_count = c;
    last_us = t;
    u->gpu = busy > 100.0 ? 100u : (unsigned)(busy + 0.5);
    return NVML_SUCCESS;
}
