/*
 * The shared region: one file per container, mmap'd MAP_SHARED by every
 * process of the container.  Layout in region_layout.h, described in README.md.
 *
 * No lock is held across anything a process can die in: creation is done
 * under flock() (dropped by the kernel when the holder dies) and counters are
 * lock-free atomics.  A process counts its bytes in its own slot; the usage of
 * a device is the sum over slots.  Reserving adds to the own slot first and
 * then sums, so two processes racing for the last bytes can both be refused
 * but never both admitted.  A slot whose owner died (kill(pid, 0) fails, the
 * process is a zombie, or its start time differs: the pid was reused) is
 * reclaimed by whoever next needs room.
 */
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static struct tessera_region local_region;
static struct tessera_region *region = &local_region;
static bool region_is_shared;
static struct tessera_region_proc *my_slot;
static uint32_t my_pid;
static pthread_mutex_t claim_lock = PTHREAD_MUTEX_INITIALIZER;

static void fill_header(struct tessera_region *r)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r->hdr.version = TESSERA_REGION_VERSION;
    r->hdr.header_size = sizeof(struct tessera_region_header);
    r->hdr.region_size = sizeof(struct tessera_region);
    r->hdr.max_devices = TESSERA_MAX_DEVICES;
    r->hdr.max_procs = TESSERA_MAX_PROCS;
    r->hdr.created_unix_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    __atomic_store_n(&r->hdr.magic, TESSERA_REGION_MAGIC, __ATOMIC_RELEASE);
}

static const char *fallback_note =
    "memory is counted per process, so the processes of this container together may exceed the limit";

static int setup_file(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s cannot be opened for writing (%s); %s", path,
             strerror(errno), fallback_note);
        return -1;
    }
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR)
        ;
    int rc = -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s is not a regular file; %s", path, fallback_note);
        goto out;
    }
    bool fresh = st.st_size == 0;
    if ((uint64_t)st.st_size == sizeof(struct tessera_region)) {
        /* Right size but no magic: a creator died between sizing and writing the header
         * (the magic goes in last, and we hold the creation lock): finish its job. */
        uint64_t magic = 1;
        if (pread(fd, &magic, sizeof magic, 0) == (ssize_t)sizeof magic && magic == 0)
            fresh = true;
    }
    if (st.st_size == 0) {
        if (ftruncate(fd, sizeof(struct tessera_region)) != 0) {
            TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s cannot be sized (%s); %s", path, strerror(errno),
                 fallback_note);
            goto out;
        }
        (void)fchmod(fd, 0666); /* every user of the container shares it */
    } else if ((uint64_t)st.st_size != sizeof(struct tessera_region)) {
        struct tessera_region_header h;
        memset(&h, 0, sizeof h);
        ssize_t got = pread(fd, &h, sizeof h, 0);
        if (got >= 16 && h.magic == TESSERA_REGION_MAGIC)
            TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s is a version %u region of %lld bytes, this shim "
                 "uses version %u (%zu bytes); it is left as it is and %s", path, h.version,
                 (long long)st.st_size, TESSERA_REGION_VERSION, sizeof(struct tessera_region), fallback_note);
        else
            TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s is not a Tessera region (%lld bytes); it is left as "
                 "it is and %s", path, (long long)st.st_size, fallback_note);
        goto out;
    }
    void *map = mmap(NULL, sizeof(struct tessera_region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s cannot be mapped (%s); %s", path, strerror(errno),
             fallback_note);
        goto out;
    }
    struct tessera_region *r = map;
    if (fresh) {
        fill_header(r);
    } else if (r->hdr.magic != TESSERA_REGION_MAGIC || r->hdr.version != TESSERA_REGION_VERSION ||
               r->hdr.header_size != sizeof(struct tessera_region_header) ||
               r->hdr.region_size != sizeof(struct tessera_region) ||
               r->hdr.max_devices != TESSERA_MAX_DEVICES || r->hdr.max_procs != TESSERA_MAX_PROCS) {
        if (r->hdr.magic == TESSERA_REGION_MAGIC)
            TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s is a version %u region, this shim uses version %u; "
                 "it is left as it is and %s", path, r->hdr.version, TESSERA_REGION_VERSION, fallback_note);
        else
            TLOG(TLOG_ERROR, "TESSERA_SHARED_REGION=%s is not a Tessera region; it is left as it is and %s",
                 path, fallback_note);
        munmap(map, sizeof(struct tessera_region));
        goto out;
    }
    region = r;
    region_is_shared = true;
    rc = 0;
out:
    flock(fd, LOCK_UN);
    close(fd);
    return rc;
}

int tessera_region_setup(const char *path)
{
    fill_header(&local_region);
    my_pid = (uint32_t)getpid();
    if (path == NULL || *path == '\0')
        return -1;
    return setup_file(path);
}

bool tessera_region_shared(void)
{
    return region_is_shared;
}

struct tessera_region *tessera_region_map(void)
{
    return region;
}

/* Field 22 of /proc/<pid>/stat (start time in clock ticks) and the state letter. */
static int read_proc_stat(uint32_t pid, uint64_t *start, char *state)
{
    char path[48], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and ')' */
    if (p == NULL || p[1] != ' ')
        return -1;
    p += 2;
    *state = *p;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (p == NULL)
            return -1;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 0;
}

/* A slot's counts as a process that holds nothing has them: spilled first, so that no reader
 * sees more spilled than used.  A release its owner died in the middle of ends here too, so
 * readers stop waiting for it. */
static void zero_counts(struct tessera_region_proc *p)
{
    for (unsigned d = 0; d < TESSERA_MAX_DEVICES; d++) {
        __atomic_store_n(&p->spilled[d], 0, __ATOMIC_RELEASE);
        __atomic_store_n(&p->used[d], 0, __ATOMIC_RELEASE);
    }
    __atomic_add_fetch(&p->spill_gen, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->spill_busy, 0, __ATOMIC_SEQ_CST);
}

static bool process_alive(uint32_t pid, uint64_t start_time)
{
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return false;
    uint64_t now_start;
    char state;
    if (read_proc_stat(pid, &now_start, &state) != 0)
        return true; /* cannot tell (no /proc): trust kill() */
    if (state == 'Z' || state == 'X')
        return false; /* exited, not yet waited for: its memory is already gone */
    return start_time == 0 || now_start == start_time;
}

int tessera_region_reap(void)
{
    if (!region_is_shared)
        return 0;
    int saved = errno;
    int reaped = 0;
    uint32_t hwm = __atomic_load_n(&region->hdr.proc_hwm, __ATOMIC_ACQUIRE);
    if (hwm > TESSERA_MAX_PROCS)
        hwm = TESSERA_MAX_PROCS;
    for (uint32_t i = 0; i < hwm; i++) {
        struct tessera_region_proc *p = &region->proc[i];
        uint32_t pid = __atomic_load_n(&p->pid, __ATOMIC_ACQUIRE);
        if (pid == 0 || pid == my_pid)
            continue;
        if (process_alive(pid, __atomic_load_n(&p->start_time, __ATOMIC_ACQUIRE)))
            continue;
        uint32_t reaper = __atomic_load_n(&p->reaper, __ATOMIC_ACQUIRE);
        if (reaper != 0 && process_alive(reaper, 0))
            continue; /* someone else is on it */
        if (!__atomic_compare_exchange_n(&p->reaper, &reaper, my_pid, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        if (__atomic_load_n(&p->pid, __ATOMIC_ACQUIRE) == pid) {
            zero_counts(p);
            __atomic_store_n(&p->start_time, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&p->pid, 0, __ATOMIC_RELEASE);
            reaped++;
            TLOG(TLOG_INFO, "reclaimed the memory of exited process %u", pid);
        }
        __atomic_store_n(&p->reaper, 0, __ATOMIC_RELEASE);
    }
    errno = saved;
    return reaped;
}

/* Reporting paths drop the dead before summing, at most every 50 ms. */
void tessera_region_reap_if_due(void)
{
    static uint64_t last_ns;
    if (!region_is_shared)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    uint64_t last = __atomic_load_n(&last_ns, __ATOMIC_RELAXED);
    if (last != 0 && now - last < 50000000u)
        return;
    __atomic_store_n(&last_ns, now, __ATOMIC_RELAXED);
    tessera_region_reap();
}

static struct tessera_region_proc *claim_slot(void)
{
    pthread_mutex_lock(&claim_lock);
    struct tessera_region_proc *slot = my_slot;
    if (slot != NULL)
        goto out;
    int saved = errno;
    uint64_t start = 0;
    char state;
    if (region_is_shared)
        (void)read_proc_stat(my_pid, &start, &state);
    /* A slot already under our pid and start time is our own from before an exec(): the
     * old image's device memory went with it, so its counts are stale.  Take it over. */
    if (region_is_shared) {
        uint32_t hwm = __atomic_load_n(&region->hdr.proc_hwm, __ATOMIC_ACQUIRE);
        for (uint32_t i = 0; i < hwm && i < TESSERA_MAX_PROCS && slot == NULL; i++) {
            struct tessera_region_proc *p = &region->proc[i];
            if (__atomic_load_n(&p->pid, __ATOMIC_ACQUIRE) != my_pid ||
                __atomic_load_n(&p->start_time, __ATOMIC_ACQUIRE) != start)
                continue;
            zero_counts(p);
            slot = p;
        }
    }
    for (int pass = 0; pass < 2 && slot == NULL; pass++) {
        for (uint32_t i = 0; i < TESSERA_MAX_PROCS; i++) {
            struct tessera_region_proc *p = &region->proc[i];
            uint32_t expected = 0;
            if (__atomic_load_n(&p->pid, __ATOMIC_RELAXED) != 0 ||
                !__atomic_compare_exchange_n(&p->pid, &expected, my_pid, false, __ATOMIC_ACQ_REL,
                                             __ATOMIC_RELAXED))
                continue;
            __atomic_store_n(&p->start_time, start, __ATOMIC_RELEASE);
            zero_counts(p);
            uint32_t hwm = __atomic_load_n(&region->hdr.proc_hwm, __ATOMIC_ACQUIRE);
            while (hwm < i + 1 &&
                   !__atomic_compare_exchange_n(&region->hdr.proc_hwm, &hwm, i + 1, false, __ATOMIC_ACQ_REL,
                                                __ATOMIC_ACQUIRE))
                ;
            slot = p;
            break;
        }
        if (slot == NULL && pass == 0)
            tessera_region_reap();
    }
    if (slot == NULL)
        TLOG(TLOG_ERROR, "all %u process slots of the shared region are in use; allocations of process %u "
             "are refused", TESSERA_MAX_PROCS, my_pid);
    __atomic_store_n(&my_slot, slot, __ATOMIC_RELEASE);
    errno = saved;
out:
    pthread_mutex_unlock(&claim_lock);
    return slot;
}

/* Slots [0, this) may be in use. */
static uint32_t slots_in_use(void)
{
    uint32_t hwm = __atomic_load_n(&region->hdr.proc_hwm, __ATOMIC_ACQUIRE);
    return hwm > TESSERA_MAX_PROCS ? TESSERA_MAX_PROCS : hwm;
}

static uint64_t sum_used(unsigned dev)
{
    uint32_t hwm = slots_in_use();
    uint64_t total = 0;
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t v = __atomic_load_n(&region->proc[i].used[dev], __ATOMIC_SEQ_CST);
        total = total + v < total ? UINT64_MAX : total + v;
    }
    return total;
}

bool tessera_region_reserve(int dev, uint64_t bytes, uint64_t limit, uint64_t *total)
{
    *total = 0;
    if ((unsigned)dev >= TESSERA_MAX_DEVICES)
        return true;
    if (limit != 0 && bytes > limit)
        return false;
    struct tessera_region_proc *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (TESSERA_UNLIKELY(slot == NULL) && (slot = claim_slot()) == NULL)
        return false;
    __atomic_add_fetch(&slot->used[dev], bytes, __ATOMIC_SEQ_CST);
    if (limit == 0 || (*total = sum_used((unsigned)dev)) <= limit)
        return true;
    if (tessera_region_reap() > 0 && (*total = sum_used((unsigned)dev)) <= limit)
        return true;
    __atomic_sub_fetch(&slot->used[dev], bytes, __ATOMIC_SEQ_CST);
    return false;
}

/* Memory the card has already given (the driver's own, a pool's growth): counted, never refused. */
void tessera_region_charge(int dev, uint64_t bytes)
{
    if ((unsigned)dev >= TESSERA_MAX_DEVICES || bytes == 0)
        return;
    struct tessera_region_proc *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (TESSERA_UNLIKELY(slot == NULL) && (slot = claim_slot()) == NULL)
        return;
    __atomic_add_fetch(&slot->used[dev], bytes, __ATOMIC_SEQ_CST);
}

uint64_t tessera_region_own_used(int dev)
{
    struct tessera_region_proc *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (slot == NULL || (unsigned)dev >= TESSERA_MAX_DEVICES)
        return 0;
    return __atomic_load_n(&slot->used[dev], __ATOMIC_SEQ_CST);
}

void tessera_region_release(int dev, uint64_t bytes)
{
    struct tessera_region_proc *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (slot == NULL || (unsigned)dev >= TESSERA_MAX_DEVICES)
        return;
    uint64_t old = __atomic_fetch_sub(&slot->used[dev], bytes, __ATOMIC_SEQ_CST);
    if (TESSERA_UNLIKELY(old < bytes)) /* never below zero (cannot happen unless the map lied) */
        __atomic_fetch_add(&slot->used[dev], bytes - old, __ATOMIC_SEQ_CST);
}

uint64_t tessera_region_used(int dev)
{
    if ((unsigned)dev >= TESSERA_MAX_DEVICES)
        return 0;
    return sum_used((unsigned)dev);
}

/*
 * Spilled bytes are a part of used ones.  A spill is marked after its reservation, so a reader
 * that loads spilled before used never sees it off the card before it is counted at all.  A
 * release takes both back, spilled first, inside spill_busy / spill_gen, so a reader can tell
 * a pair it read across one and read again.
 */
void tessera_region_spill(int dev, uint64_t bytes)
{
    struct tessera_region_proc *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (slot == NULL || (unsigned)dev >= TESSERA_MAX_DEVICES)
        return;
    __atomic_add_fetch(&slot->spilled[dev], bytes, __ATOMIC_SEQ_CST);
}

void tessera_region_release_spilled(int dev, uint64_t bytes)
{
    struct tessera_region_proc *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    if (slot == NULL || (unsigned)dev >= TESSERA_MAX_DEVICES)
        return;
    __atomic_add_fetch(&slot->spill_busy, 1, __ATOMIC_SEQ_CST);
    uint64_t old = __atomic_fetch_sub(&slot->spilled[dev], bytes, __ATOMIC_SEQ_CST);
    if (TESSERA_UNLIKELY(old < bytes))
        __atomic_fetch_add(&slot->spilled[dev], bytes - old, __ATOMIC_SEQ_CST);
    tessera_region_release(dev, bytes);
    __atomic_add_fetch(&slot->spill_gen, 1, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&slot->spill_busy, 1, __ATOMIC_SEQ_CST);
}

uint64_t tessera_region_spilled(int dev)
{
    if ((unsigned)dev >= TESSERA_MAX_DEVICES)
        return 0;
    uint32_t hwm = slots_in_use();
    uint64_t total = 0;
    for (uint32_t i = 0; i < hwm; i++)
        total += __atomic_load_n(&region->proc[i].spilled[dev], __ATOMIC_SEQ_CST);
    return total;
}

/* One slot's used less spilled, from a pair no release tore; after a few tries, used in full
 * (more than it holds on the card, never less: a resident budget may refuse, never overrun). */
static uint64_t slot_resident(const struct tessera_region_proc *p, unsigned dev)
{
    uint64_t used = 0;
    for (int tries = 0; tries < 8; tries++) {
        uint32_t gen = __atomic_load_n(&p->spill_gen, __ATOMIC_SEQ_CST);
        bool quiet = __atomic_load_n(&p->spill_busy, __ATOMIC_SEQ_CST) == 0;
        uint64_t spilled = __atomic_load_n(&p->spilled[dev], __ATOMIC_SEQ_CST);
        used = __atomic_load_n(&p->used[dev], __ATOMIC_SEQ_CST);
        if (quiet && __atomic_load_n(&p->spill_busy, __ATOMIC_SEQ_CST) == 0 &&
            __atomic_load_n(&p->spill_gen, __ATOMIC_SEQ_CST) == gen)
            return used > spilled ? used - spilled : 0;
        sched_yield();
    }
    return used;
}

/* What the container holds on the card: used less spilled, summed over the slots. */
uint64_t tessera_region_resident(int dev)
{
    if ((unsigned)dev >= TESSERA_MAX_DEVICES)
        return 0;
    uint32_t hwm = slots_in_use();
    uint64_t total = 0;
    for (uint32_t i = 0; i < hwm; i++) {
        uint64_t add = slot_resident(&region->proc[i], (unsigned)dev);
        total = total + add < total ? UINT64_MAX : total + add;
    }
    return total;
}

void tessera_region_publish_device(int dev, uint64_t limit, uint64_t card_total, uint32_t core_pct)
{
    if ((unsigned)dev >= TESSERA_MAX_DEVICES)
        return;
    struct tessera_region_device *d = &region->dev[dev];
    __atomic_store_n(&d->mem_limit_bytes, limit, __ATOMIC_RELAXED);
    if (card_total != 0)
        __atomic_store_n(&d->card_total_bytes, card_total, __ATOMIC_RELAXED);
    __atomic_store_n(&d->core_limit_pct, core_pct, __ATOMIC_RELAXED);
}

void tessera_region_after_fork_child(void)
{
    /* The child owns no device memory (CUDA does not survive fork) and has its own pid. */
    my_pid = (uint32_t)getpid();
    my_slot = NULL;
    pthread_mutex_init(&claim_lock, NULL);
}

void tessera_region_at_exit(void)
{
    struct tessera_region_proc *slot = __atomic_exchange_n(&my_slot, NULL, __ATOMIC_ACQ_REL);
    if (slot == NULL)
        return;
    zero_counts(slot);
    __atomic_store_n(&slot->start_time, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&slot->pid, 0, __ATOMIC_RELEASE);
}
