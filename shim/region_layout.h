/*
 * Tessera shared region: the ABI between the shim (every process of a
 * container) and the node plugin (nodeplugin/shared_region.py mirrors it).
 *
 * Rules: fixed-width fields only, explicit padding, little-endian (the host's),
 * no pointers.  Any change to a field's meaning or offset bumps
 * TESSERA_REGION_VERSION; the shim refuses to use a region whose magic,
 * version or sizes differ from its own.  Counters are updated with atomic
 * builtins in place; readers take a snapshot without locks.
 *
 * One writer per field: the shim writes everything except hold_mask and
 * hold_until_ns, which only the node plugin writes (task priority: a
 * low-priority container holds its launches while a higher-priority one on
 * the same card is busy).  Version 2 gave the reserved words of version 1
 * these meanings; the size and every other offset are unchanged.
 */
#ifndef TESSERA_REGION_LAYOUT_H
#define TESSERA_REGION_LAYOUT_H

#include <stdint.h>

/* "TESSERA1" read as a little-endian uint64_t */
#define TESSERA_REGION_MAGIC   0x3141524553534554ULL
#define TESSERA_REGION_VERSION 3u
#define TESSERA_MAX_DEVICES    16u
#define TESSERA_MAX_PROCS      64u

/* 64 bytes at offset 0 */
struct tessera_region_header {
    uint64_t magic;           /* TESSERA_REGION_MAGIC, written last at creation */
    uint32_t version;         /* TESSERA_REGION_VERSION */
    uint32_t header_size;     /* sizeof(struct tessera_region_header) */
    uint64_t region_size;     /* sizeof(struct tessera_region) */
    uint32_t max_devices;     /* TESSERA_MAX_DEVICES */
    uint32_t max_procs;       /* TESSERA_MAX_PROCS */
    uint32_t proc_hwm;        /* slots [0, proc_hwm) may be in use (atomic, only grows) */
    uint32_t hold_mask;       /* node plugin: bit i = hold launches on device i (atomic) */
    uint64_t created_unix_ns; /* CLOCK_REALTIME when the region was created */
    uint64_t hold_until_ns;   /* node plugin: CLOCK_MONOTONIC time hold_mask stops counting */
    uint8_t  _reserved[8];
};

/* 32 bytes per device, indexed by the device ordinal inside the container */
struct tessera_region_device {
    uint64_t mem_limit_bytes;   /* 0 = no limit */
    uint64_t card_total_bytes;  /* memory of the physical card, 0 = not yet known */
    uint32_t core_limit_pct;    /* 0 = no limit, else 1..99 */
    uint32_t _pad0;
    uint64_t launches;          /* kernel launches, counted only with a task priority (atomic) */
};

/* 320 bytes (five cache lines) per process slot */
struct tessera_region_proc {
    uint32_t pid;          /* owner pid in the container's pid namespace, 0 = free (atomic) */
    uint32_t reaper;       /* pid of a process reclaiming this slot, 0 = none (atomic) */
    uint64_t start_time;   /* owner start time, clock ticks since boot (/proc/<pid>/stat field 22) */
    uint64_t used[TESSERA_MAX_DEVICES]; /* bytes charged on each device: allocations, pools, graphs,
                                           the driver's own memory (atomic) */
    uint32_t spill_busy;   /* releases of spilled memory under way in this process (atomic) */
    uint32_t spill_gen;    /* releases of spilled memory done, wrapping (atomic): with spill_busy, lets a
                              reader of used and spilled see a pair no release tore apart */
    uint8_t  _reserved[40];
    uint64_t spilled[TESSERA_MAX_DEVICES]; /* of used: bytes served as managed memory past the device's
                                              resident part, which the driver may keep in host
                                              memory; used - spilled is held on the card (atomic) */
};

struct tessera_region {
    struct tessera_region_header hdr;                     /* offset 0 */
    struct tessera_region_device dev[TESSERA_MAX_DEVICES]; /* offset 64 */
    struct tessera_region_proc proc[TESSERA_MAX_PROCS];    /* offset 576 */
};                                                          /* size 21056 */

_Static_assert(sizeof(struct tessera_region_header) == 64, "header size");
_Static_assert(sizeof(struct tessera_region_device) == 32, "device size");
_Static_assert(sizeof(struct tessera_region_proc) == 320, "proc size");
_Static_assert(sizeof(struct tessera_region) == 21056, "region size");

#endif
