/*
 * Launch hooks: hold each device to TESSERA_DEVICE_CORE_LIMIT_<i> percent.
 *
 * With neither a compute limit nor a task priority a launch costs one
 * well-predicted branch on tessera_launch_on.  A priority may hold the launch
 * first (priority.c).  With a compute limit, each launch takes a token from
 * the device's limiter (limiter.c); a background thread, started on the first
 * limited launch, samples NVML utilisation every TESSERA_POLL_MS and adjusts
 * the refill rate.  The sample is this process's own share of the card when NVML
 * can name the process (per-process samples, drivermem.c learns the host pid),
 * so other tenants' work does not count against it; else the whole card's.
 */
#include "limiter.h"
#include "shim.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>

#define TESSERA_POLL_MS 100

static struct tessera_limiter limiters[TESSERA_MAX_DEVICES];
static pthread_mutex_t limiter_lock = PTHREAD_MUTEX_INITIALIZER;
static int poller_started;
static nvmlDevice_t nvml_devices[TESSERA_MAX_DEVICES];
static unsigned long long last_sample_us[TESSERA_MAX_DEVICES];
static bool per_process_unsupported;

static uint64_t monotonic_ns(void *ctx)
{
    (void)ctx;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#define MAX_SAMPLES 128

/* Mean SM utilisation of this process's samples newer than the last ones seen; -1 when there
 * are none (a sample may lag the work: better no update than a wrong one). */
static int own_utilisation(unsigned dev, uint32_t pid, double *percent)
{
    nvmlProcessUtilizationSample_t s[MAX_SAMPLES];
    unsigned n = MAX_SAMPLES;
    nvmlReturn_t r = REAL(nvmlDeviceGetProcessUtilization)(nvml_devices[dev], s, &n, last_sample_us[dev]);
    if (r == NVML_ERROR_NOT_SUPPORTED || r == NVML_ERROR_FUNCTION_NOT_FOUND) {
        per_process_unsupported = true;
        TLOG(TLOG_INFO, "NVML has no per-process utilisation here; the whole card's is used");
        return 1;
    }
    if (r != NVML_SUCCESS)
        return -1;
    double sum = 0.0;
    unsigned mine = 0;
    unsigned long long newest = last_sample_us[dev];
    for (unsigned i = 0; i < n && i < MAX_SAMPLES; i++) {
        if (s[i].pid != pid || s[i].timeStamp <= last_sample_us[dev])
            continue;
        sum += (double)s[i].smUtil;
        mine++;
        if (s[i].timeStamp > newest)
            newest = s[i].timeStamp;
    }
    last_sample_us[dev] = newest;
    if (mine == 0)
        return -1;
    *percent = sum / mine;
    return 0;
}

static int nvml_utilisation(void *ctx, double *percent)
{
    unsigned dev = (unsigned)(uintptr_t)ctx;
    uint32_t pid = tessera_host_pid();
    if (pid != 0 && !per_process_unsupported) {
        int r = own_utilisation(dev, pid, percent);
        if (r <= 0)
            return r;
    }
    nvmlUtilization_t u;
    if (REAL(nvmlDeviceGetUtilizationRates)(nvml_devices[dev], &u) != NVML_SUCCESS)
        return -1;
    *percent = (double)u.gpu;
    return 0;
}

void tessera_compute_init(void)
{
    uint64_t now = monotonic_ns(NULL);
    for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++)
        if (tessera_core_mask & (1u << i))
            tessera_limiter_init(&limiters[i], (double)tessera_cfg.core_limit[i], now);
}

static void *poller_main(void *arg)
{
    (void)arg;
    if (!tessera_nvml_ready()) {
        TLOG(TLOG_ERROR, "NVML cannot be initialised; compute limits cannot be measured and are NOT enforced");
        return NULL;
    }
    uint32_t mask = 0;
    for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++) {
        if (!(tessera_core_mask & (1u << i)))
            continue;
        /* The card itself, found by identity: NVML's index i may be another card. */
        if ((nvml_devices[i] = tessera_devmap_nvml((int)i)) != NULL)
            mask |= 1u << i;
        else
            TLOG(TLOG_ERROR, "NVML has no device that is CUDA device %u; its compute limit is NOT enforced", i);
    }
    struct tessera_limiter_env env = {monotonic_ns, nvml_utilisation, NULL};
    for (;;) {
        struct timespec ts = {0, TESSERA_POLL_MS * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
        for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++) {
            if (!(mask & (1u << i)))
                continue;
            env.ctx = (void *)(uintptr_t)i;
            double util;
            if (env.utilisation(env.ctx, &util) != 0)
                continue; /* no sample: the window runs on until the next one */
            pthread_mutex_lock(&limiter_lock);
            tessera_limiter_update(&limiters[i], util, env.now_ns(NULL));
            pthread_mutex_unlock(&limiter_lock);
            TLOG(TLOG_DEBUG, "device %u: utilisation %.0f%%, rate %.0f launches/s", i, util, limiters[i].rate);
        }
    }
    return NULL;
}

static void start_poller(void)
{
    int expected = 0;
    if (!__atomic_compare_exchange_n(&poller_started, &expected, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    /* The thread must never take the program's signals. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, poller_main, NULL) != 0)
        TLOG(TLOG_ERROR, "cannot start the utilisation thread; compute limits are NOT enforced");
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void throttle(int dev)
{
    if (TESSERA_UNLIKELY(!__atomic_load_n(&poller_started, __ATOMIC_ACQUIRE)))
        start_poller();
    for (;;) {
        pthread_mutex_lock(&limiter_lock);
        uint64_t wait = tessera_limiter_acquire(&limiters[dev], monotonic_ns(NULL));
        pthread_mutex_unlock(&limiter_lock);
        if (wait == 0)
            break;
        struct timespec ts = {(time_t)(wait / 1000000000u), (long)(wait % 1000000000u)};
        nanosleep(&ts, NULL);
    }
}

int tessera_launch_quick;

/* A held launch waits before it takes a token: a token spent while held would be lost. */
void tessera_launch_slow(void)
{
    int saved = errno;
    int dev = tessera_current_device();
    if ((unsigned)dev < TESSERA_MAX_DEVICES) {
        if (tessera_task_priority >= 0)
            tessera_priority_launch(dev);
        if (tessera_core_mask & (1u << dev))
            throttle(dev);
    }
    errno = saved;
}

void tessera_compute_after_fork_child(void)
{
    pthread_mutex_init(&limiter_lock, NULL);
    memset(last_sample_us, 0, sizeof last_sample_us);
    __atomic_store_n(&poller_started, 0, __ATOMIC_RELEASE); /* the thread did not come along */
}

#define THROTTLE()                                                      \
    do {                                                                \
        if (TESSERA_UNLIKELY(tessera_launch_on)) {                      \
            if (__atomic_load_n(&tessera_launch_quick, __ATOMIC_RELAXED)) \
                tessera_priority_launch(0);                             \
            else                                                        \
                tessera_launch_slow();                                  \
        }                                                               \
    } while (0)

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    THROTTLE();
    return REAL(cuLaunchKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                                hStream, kernelParams, extra);
}

CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                     unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                     unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                     void **kernelParams, void **extra)
{
    THROTTLE();
    return REAL(cuLaunchKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                     sharedMemBytes, hStream, kernelParams, extra);
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    THROTTLE();
    return REAL(cuLaunchKernelEx)(config, f, kernelParams, extra);
}

CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                       void **extra)
{
    THROTTLE();
    return REAL(cuLaunchKernelEx_ptsz)(config, f, kernelParams, extra);
}

CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                           unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                           unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                           void **kernelParams)
{
    THROTTLE();
    return REAL(cuLaunchCooperativeKernel)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                           sharedMemBytes, hStream, kernelParams);
}

CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                unsigned int gridDimZ, unsigned int blockDimX,
                                                unsigned int blockDimY, unsigned int blockDimZ,
                                                unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    THROTTLE();
    return REAL(cuLaunchCooperativeKernel_ptsz)(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                                sharedMemBytes, hStream, kernelParams);
}

/* A graph's memory nodes take their memory at launch: drivermem.c counts it after. */
#define GRAPH_LAUNCH_BODY(realfn)                                 \
    THROTTLE();                                                   \
    CUresult r = realfn(hGraphExec, hStream);                     \
    if (TESSERA_UNLIKELY(tessera_mem_on) && r == CUDA_SUCCESS)    \
        tessera_graph_launched(hGraphExec);                       \
    return r

CUresult CUDAAPI cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    GRAPH_LAUNCH_BODY(REAL(cuGraphLaunch));
}

CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    GRAPH_LAUNCH_BODY(REAL(cuGraphLaunch_ptsz));
}
