/*
 * Task priority (TESSERA_TASK_PRIORITY, HAMi's nvidia.com/priority; a lower number is a
 * higher priority).  Who yields to whom is decided by the node plugin, the one party that
 * sees every container on a card: it reads each region's launch counts and, while a
 * higher-priority container on the card is busy, sets the device's bit in a lower-priority
 * container's hold_mask with a lease (hold_until_ns) it keeps renewing.  Per launch
 * (tessera_priority_launch, inline in shim.h):
 *
 *  - the launch is counted in the region (one plain store to memory already mapped), so
 *    the plugin can tell who is busy;
 *  - unless the priority is 0, which nothing outranks, one load of hold_mask; only when
 *    the device's bit is set does the launch call tessera_priority_hold, here, and wait in
 *    short naps until the bit goes or the lease runs out.
 *
 * A lease that has run out means the plugin is gone or stalled: the hold no longer counts,
 * so a process never waits for a plugin that will not come back.  A lease further ahead
 * than any the plugin gives is not the plugin's and counts for nothing either.
 *
 * Without a priority none of this runs: the launch hooks test one word, as before.
 */
#include "shim.h"

#include <errno.h>
#include <time.h>

#define HOLD_NAP_NS 2000000u            /* a held launch looks again this often */
#define MAX_LEASE_NS 10000000000ull     /* the plugin's leases are at most 5 s (docs/nodeplugin.md) */

struct tessera_region *tessera_priority_region;
static int stale_said, bogus_said;

void tessera_priority_init(void)
{
    tessera_priority_region = tessera_region_map();
}

/* The plugin's clock (CLOCK_MONOTONIC); the coarse one costs no more than a load and runs
 * at most a tick behind, which only lengthens a hold by that tick. */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void tessera_priority_hold(int dev)
{
    struct tessera_region *region = tessera_priority_region;
    uint32_t bit = 1u << dev;
    int said = 0, saved = errno;
    for (;;) {
        if (!(__atomic_load_n(&region->hdr.hold_mask, __ATOMIC_ACQUIRE) & bit))
            break;
        uint64_t until = __atomic_load_n(&region->hdr.hold_until_ns, __ATOMIC_ACQUIRE);
        uint64_t now = now_ns();
        if (until <= now) {
            if (!__atomic_exchange_n(&stale_said, 1, __ATOMIC_RELAXED))
                TLOG(TLOG_INFO, "device %d: the node plugin's hold ran out without being renewed or "
                     "lifted (is the plugin running?); launching", dev);
            break;
        }
        if (until - now > MAX_LEASE_NS) {
            if (!__atomic_exchange_n(&bogus_said, 1, __ATOMIC_RELAXED))
                TLOG(TLOG_WARN, "device %d: a hold %llu ms ahead is longer than the node plugin ever "
                     "gives; ignored", dev, (unsigned long long)((until - now) / 1000000u));
            break;
        }
        if (!said) {
            TLOG(TLOG_DEBUG, "device %d: launches held while a higher-priority container on the card "
                 "is busy", dev);
            said = 1;
        }
        uint64_t nap = until - now < HOLD_NAP_NS ? until - now : HOLD_NAP_NS;
        struct timespec ts = {0, (long)nap};
        nanosleep(&ts, NULL);
    }
    errno = saved;
}
