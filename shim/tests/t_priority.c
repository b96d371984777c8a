/*
 * Task priority inside one container: the launch count the shim keeps in the region, and
 * how a launch honours the hold the node plugin writes there.  The test plays the plugin:
 * it maps its own region (TESSERA_SHARED_REGION) and writes hold_mask / hold_until_ns, as
 * the plugin does from outside.  Run with TESSERA_TASK_PRIORITY as the case needs.
 *
 *   t_priority count          launches are counted per device (FAKE_CUDA_DEVICES=2)
 *   t_priority uncounted      no priority: nothing counted, a hold changes nothing
 *   t_priority held           a launch waits while held and goes when the hold is lifted;
 *                             errno is the caller's, though a signal broke the wait
 *   t_priority stale          a hold whose lease runs out (the plugin is gone) stops holding
 *   t_priority expired        a hold whose lease has already run out holds nothing
 *   t_priority bogus          a lease further ahead than the plugin ever gives holds nothing
 *   t_priority top            priority 0 is never held, and still counted
 *   t_priority other_device   a hold on device 1 leaves launches on device 0 alone
 *
 * A launch held when it must not be would wait for seconds: alarm() ends the run first.
 */
#include "tcommon.h"

#include "region_layout.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MS 1000000ull

static struct tessera_region *region;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void map_region(void)
{
    const char *path = getenv("TESSERA_SHARED_REGION");
    CHECK(path != NULL, "run with TESSERA_SHARED_REGION");
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0, "open %s: %s", path, strerror(errno));
    void *m = mmap(NULL, sizeof *region, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(m != MAP_FAILED, "mmap: %s", strerror(errno));
    close(fd);
    region = m;
    CHECK(region->hdr.version == TESSERA_REGION_VERSION, "region version %u", region->hdr.version);
}

/* What the plugin writes: the lease first, then the mask. */
static void set_hold(uint32_t mask, int64_t lease_ms)
{
    __atomic_store_n(&region->hdr.hold_until_ns, (uint64_t)((int64_t)now_ns() + lease_ms * (int64_t)MS),
                     __ATOMIC_RELEASE);
    __atomic_store_n(&region->hdr.hold_mask, mask, __ATOMIC_RELEASE);
}

static uint64_t launches(int dev)
{
    return __atomic_load_n(&region->dev[dev].launches, __ATOMIC_ACQUIRE);
}

static void launch(void)
{
    CHECK_CU(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
}

/* Milliseconds n launches take. */
static double time_launches(int n)
{
    uint64_t t0 = now_ns();
    for (int i = 0; i < n; i++)
        launch();
    return (double)(now_ns() - t0) / (double)MS;
}

static void use_device(int dev)
{
    CUcontext c;
    CHECK_CU(cuDevicePrimaryCtxRetain(&c, dev));
    CHECK_CU(cuCtxSetCurrent(c));
}

static pthread_t launcher;

static void on_signal(int sig)
{
    (void)sig;
}

/* Keep interrupting the held launch's sleep (so errno changes under it), then lift the hold. */
static void *lift_after(void *arg)
{
    uint64_t lift = now_ns() + (uintptr_t)arg * MS;
    while (now_ns() < lift) {
        struct timespec ts = {0, (long)(20 * MS)};
        nanosleep(&ts, NULL);
        pthread_kill(launcher, SIGUSR1);
    }
    __atomic_store_n(&region->hdr.hold_mask, 0, __ATOMIC_RELEASE);
    return NULL;
}

static pthread_t lift_in(unsigned ms)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: the sleep fails with EINTR */
    sigaction(SIGUSR1, &sa, NULL);
    launcher = pthread_self();
    pthread_t t;
    CHECK(pthread_create(&t, NULL, lift_after, (void *)(uintptr_t)ms) == 0, "pthread_create");
    return t;
}

static void not_held(const char *what)
{
    double ms = time_launches(1000);
    CHECK(ms < 500, "%s: 1000 launches took %.0f ms: they were held", what, ms);
}

static void case_count(void)
{
    use_device(0);
    time_launches(1000);
    CHECK(launches(0) == 1000, "device 0 counted %llu of 1000", (unsigned long long)launches(0));
    use_device(1);
    time_launches(300);
    CHECK(launches(1) == 300, "device 1 counted %llu of 300", (unsigned long long)launches(1));
    CHECK(launches(0) == 1000, "device 1's launches were counted on device 0 too");
}

static void case_uncounted(void)
{
    set_hold(1, 5000);
    not_held("no priority");
    for (int d = 0; d < (int)TESSERA_MAX_DEVICES; d++)
        CHECK(launches(d) == 0, "device %d counted %llu launches without a priority", d,
              (unsigned long long)launches(d));
}

static void case_held(void)
{
    set_hold(1, 5000);
    pthread_t t = lift_in(300);
    errno = EDOM;
    uint64_t t0 = now_ns();
    launch();
    double ms = (double)(now_ns() - t0) / (double)MS;
    CHECK(errno == EDOM, "errno %d after a held launch, want the caller's EDOM", errno);
    pthread_join(t, NULL);
    CHECK(ms >= 250 && ms < 2000, "the held launch went after %.0f ms; the hold was lifted at 300 ms", ms);
    not_held("after the hold was lifted");
    CHECK(launches(0) == 1001, "counted %llu of 1001", (unsigned long long)launches(0));
}

static void case_stale(void)
{
    set_hold(1, 400);
    uint64_t t0 = now_ns();
    launch();
    double ms = (double)(now_ns() - t0) / (double)MS;
    CHECK(ms >= 300 && ms < 2000, "held %.0f ms by a 400 ms lease nobody renewed", ms);
    CHECK(__atomic_load_n(&region->hdr.hold_mask, __ATOMIC_ACQUIRE) == 1, "the mask is the plugin's");
    not_held("once the lease ran out");
}

static void case_expired(void)
{
    set_hold(1, -1000);
    not_held("a lease that ran out a second ago");
}

static void case_bogus(void)
{
    set_hold(1, 3600 * 1000);
    not_held("a lease an hour ahead");
}

static void case_top(void)
{
    set_hold(1, 5000);
    not_held("priority 0");
    CHECK(launches(0) == 1000, "priority 0 counted %llu of 1000", (unsigned long long)launches(0));
}

static void case_other_device(void)
{
    use_device(0);
    set_hold(2, 5000);
    not_held("device 0 while device 1 is held");
    use_device(1);
    pthread_t t = lift_in(300);
    uint64_t t0 = now_ns();
    launch();
    double ms = (double)(now_ns() - t0) / (double)MS;
    pthread_join(t, NULL);
    CHECK(ms >= 250, "device 1's launch was not held (%.0f ms)", ms);
}

int main(int argc, char **argv)
{
    static const struct test_case cases[] = {
        {"count", case_count},     {"uncounted", case_uncounted}, {"held", case_held},
        {"stale", case_stale},     {"expired", case_expired},     {"bogus", case_bogus},
        {"top", case_top},         {"other_device", case_other_device},
    };
    CHECK(argc == 2, "usage: %s CASE", argv[0]);
    alarm(10);
    CHECK_CU(cuInit(0));
    map_region();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (strcmp(argv[1], cases[i].name) == 0) {
            cases[i].fn();
            return 0;
        }
    CHECK(0, "unknown case %s", argv[1]);
    return 1;
}
