/*
 * A stand-in for libnvidia-ml.so.1: what pynvml, the shim and the proof kit call.
 * NVML's devices are the physical cards in PCI order; what is on them comes from the
 * card state the fake libcuda keeps (fake.h): in FAKE_GPU_STATE when set, else in the
 * libcuda.so.1 loaded in this process (none loaded: the cards are empty).
 *
 * FAKE_CUDA_MEM_MIB   card size in MiB (default 16384), shared with the fake libcuda
 * FAKE_CUDA_DEVICES   number of cards (default 1)
 * FAKE_GPU_UUIDS      the cards' UUIDs, comma-separated, shared with the fake libcuda
 * FAKE_NVML_USED_MIB  memory other tenants use on every card (default 0)
 * FAKE_NVML_UTIL      GPU utilisation: a percentage, or "model": utilisation follows the
 *                     kernels launched on the card, each keeping it busy FAKE_KERNEL_US
 *                     microseconds (per-process samples follow each process's kernels)
 * FAKE_NVML_PID_OFFSET  added to every pid NVML reports, as when the caller is in a pid
 *                     namespace and NVML answers with host pids (default 0)
 * FAKE_NVML_NO_UUID=1 nvmlDeviceGetUUID is not supported (identity by PCI bus id only)
 * FAKE_NVML_NO_PROCESSES=1  the process list is not supported (no per-process figures)
 * FAKE_NVML_DRIFT_MIB  another tenant that takes this much more of every card each time
 *                     the card's memory is asked for (noise in card-wide figures)
 */
#include "fake.h"

#define NVML_NO_UNVERSIONED_FUNC_DEFS /* name every versioned entry point explicitly */
#include <nvml.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

struct fake_dev {
    unsigned index;
};
static struct fake_dev devs[FAKE_MAX_DEVICES];
static unsigned count = 1;
static unsigned long long card_bytes = 16384ull << 20;
static unsigned long long other_bytes;
static int util_model;
static unsigned util_fixed;
static double kernel_us = 100.0;
static unsigned pid_offset;
static int no_uuid;
static int no_processes;
static unsigned long long drift_bytes, drifted;
static struct fake_gpu_state empty_state;
static struct fake_gpu_state *file_state;

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
        other_bytes = strtoull(s, NULL, 10) << 20;
    if ((s = getenv("FAKE_NVML_UTIL")) && *s) {
        if (strcmp(s, "model") == 0)
            util_model = 1;
        else
            util_fixed = (unsigned)atoi(s);
    }
    if ((s = getenv("FAKE_KERNEL_US")) && *s)
        kernel_us = atof(s);
    if ((s = getenv("FAKE_NVML_PID_OFFSET")) && *s)
        pid_offset = (unsigned)strtoul(s, NULL, 10);
    no_uuid = (s = getenv("FAKE_NVML_NO_UUID")) != NULL && strcmp(s, "1") == 0;
    no_processes = (s = getenv("FAKE_NVML_NO_PROCESSES")) != NULL && strcmp(s, "1") == 0;
    if ((s = getenv("FAKE_NVML_DRIFT_MIB")) && *s)
        drift_bytes = strtoull(s, NULL, 10) << 20;
    for (unsigned i = 0; i < FAKE_MAX_DEVICES; i++)
        devs[i].index = i;
    if ((s = getenv("FAKE_GPU_STATE")) && *s) {
        int fd = open(s, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd >= 0 && ftruncate(fd, sizeof(struct fake_gpu_state)) == 0) {
            void *m = mmap(NULL, sizeof(struct fake_gpu_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED)
                file_state = m;
        }
        if (fd >= 0)
            close(fd);
    }
}

static struct fake_gpu_state *gpu(void)
{
    if (file_state != NULL)
        return file_state;
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    fake_cuda_state_fn fn = h ? (fake_cuda_state_fn)dlsym(h, "fake_cuda_state") : NULL;
    return fn ? fn() : &empty_state;
}

static int alive(uint32_t pid)
{
    return pid != 0 && !(kill((pid_t)pid, 0) != 0 && errno == ESRCH);
}

/* A process is on card p while it has a context or memory there. */
static int on_card(const struct fake_proc *pr, unsigned p)
{
    return alive(pr->pid) && ((pr->ctx_mask & (1u << p)) || pr->used[p] != 0);
}

static unsigned long long card_used(unsigned p)
{
    struct fake_gpu_state *st = gpu();
    unsigned long long sum = other_bytes;
    for (int i = 0; i < FAKE_MAX_PROCS; i++)
        if (on_card(&st->procs[i], p))
            sum += st->procs[i].used[p];
    return sum;
}

static unsigned dev_index(nvmlDevice_t d)
{
    return ((struct fake_dev *)d)->index;
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
    *i = dev_index(d);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int n)
{
    snprintf(name, n, "Fake GPU %u", dev_index(d));
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int n)
{
    if (no_uuid)
        return NVML_ERROR_NOT_SUPPORTED;
    if (n < NVML_DEVICE_UUID_BUFFER_SIZE)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    fake_card_uuid((int)dev_index(d), uuid, n);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d)
{
    for (unsigned i = 0; i < count && !no_uuid; i++) {
        char mine[NVML_DEVICE_UUID_BUFFER_SIZE];
        fake_card_uuid((int)i, mine, sizeof mine);
        if (strcasecmp(mine, uuid) == 0) {
            *d = (nvmlDevice_t)&devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci)
{
    unsigned i = dev_index(d);
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = FAKE_PCI_BUS(i);
    pci->device = 0;
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *d)
{
    unsigned dom, b, dv, fn;
    if (sscanf(bus, "%x:%x:%x.%x", &dom, &b, &dv, &fn) != 4)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < count; i++)
        if (dom == 0 && b == (unsigned)FAKE_PCI_BUS(i) && dv == 0) {
            *d = (nvmlDevice_t)&devs[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    drifted += drift_bytes;
    unsigned long long used = card_used(dev_index(d)) + drifted;
    m->total = card_bytes;
    m->used = used;
    m->free = card_bytes - used;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    drifted += drift_bytes;
    unsigned long long used = card_used(dev_index(d)) + drifted;
    m->total = card_bytes;
    m->reserved = 300ull << 20;
    m->used = used;
    m->free = card_bytes - used - m->reserved;
    return NVML_SUCCESS;
}

/* Every process with a context or memory on the card, with the pid NVML would report. */
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *infos)
{
    if (no_processes)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned p = dev_index(d), found = 0;
    struct fake_gpu_state *st = gpu();
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        const struct fake_proc *pr = &st->procs[i];
        if (!on_card(pr, p))
            continue;
        if (infos != NULL && found < *n)
            infos[found] = (nvmlProcessInfo_t){pr->pid + pid_offset, pr->used[p], 0xFFFFFFFFu, 0xFFFFFFFFu};
        found++;
    }
    nvmlReturn_t r = infos == NULL || found > *n ? (found ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS)
                                                 : NVML_SUCCESS;
    *n = found;
    return r;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static unsigned busy_pct(uint64_t launches, double dt_us)
{
    double busy = dt_us > 0 ? (double)launches * kernel_us / dt_us * 100.0 : 0.0;
    return busy > 100.0 ? 100u : (unsigned)(busy + 0.5);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    u->memory = 0;
    if (!util_model) {
        u->gpu = util_fixed;
        return NVML_SUCCESS;
    }
    static uint64_t last_count[FAKE_MAX_DEVICES];
    static double last_us[FAKE_MAX_DEVICES];
    unsigned p = dev_index(d);
    uint64_t c = __atomic_load_n(&gpu()->launches[p], __ATOMIC_RELAXED);
    double t = now_us();
    u->gpu = last_us[p] > 0 ? busy_pct(c - last_count[p], t - last_us[p]) : 0;
    last_count[p] = c;
    last_us[p] = t;
    return NVML_SUCCESS;
}

/* One sample per process on the card: its own kernels' share of the time since the last call. */
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *samples,
                                                    unsigned int *n, unsigned long long last_seen)
{
    (void)last_seen;
    if (!util_model)
        return NVML_ERROR_NOT_SUPPORTED;
    static struct {
        uint32_t pid;
        uint64_t launches;
        double us;
    } seen[FAKE_MAX_DEVICES][FAKE_MAX_PROCS];
    unsigned p = dev_index(d), found = 0;
    struct fake_gpu_state *st = gpu();
    double t = now_us();
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        const struct fake_proc *pr = &st->procs[i];
        if (!on_card(pr, p))
            continue;
        if (samples == NULL) { /* a size query takes no sample */
            found++;
            continue;
        }
        /* Without a shared card state the one process's launches are the card's. */
        uint64_t c = __atomic_load_n(file_state ? &pr->launches[p] : &st->launches[p], __ATOMIC_RELAXED);
        if (seen[p][i].pid != pr->pid) {
            seen[p][i].pid = pr->pid;
            seen[p][i].launches = c;
            seen[p][i].us = t;
            continue; /* no sample yet for a process just seen */
        }
        if (found < *n)
            samples[found] = (nvmlProcessUtilizationSample_t){
                pr->pid + pid_offset, (unsigned long long)t, busy_pct(c - seen[p][i].launches, t - seen[p][i].us),
                0, 0, 0};
        seen[p][i].launches = c;
        seen[p][i].us = t;
        found++;
    }
    if (found == 0)
        return NVML_ERROR_NOT_FOUND;
    nvmlReturn_t r = samples == NULL || found > *n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    *n = found;
    return r;
}
