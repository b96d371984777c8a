/*
 * A fake libnvidia-ml.so.1 for the node plugin's tests: just the NVML entry points the plugin
 * calls through pynvml, backed by files the test controls.
 *
 *   FAKE_NVML_CARDS  a file, one card per line: uuid|name|memory_mib|minor|numa|bus_id
 *                    (numa -1 = NVML cannot tell; then the PCI bus id is asked)
 *   FAKE_NVML_STATE  a directory the test writes while the plugin runs:
 *                      lost/<uuid>   exists -> queries on that card fail with GPU_IS_LOST
 *                      events        appended lines "<uuid> <xid>" -> XID critical events
 *                      init_fail     exists -> nvmlInit fails with DRIVER_NOT_LOADED
 *                      mig/<uuid>    the card's MIG state (below); the library rewrites it
 *                      mig_reset_required  exists -> nvmlDeviceSetMigMode leaves the new mode
 *                                    pending until the test "resets" the card (edits mig/<uuid>)
 *                      busy/<mig device uuid>  exists -> destroying that instance is IN_USE
 *                      figures/<uuid>  lines "<key> <value>": what the card's gauges read,
 *                                    keys util (GPU %), mem_util (memory %), temp (C),
 *                                    power_mw, mem_used_mib; a key not given reads 0
 *                      procs/<uuid>  lines "<host pid> <sm %> <mem %>": the card's
 *                                    per-process utilisation samples (none -> NOT_FOUND)
 *                      fail/<uuid>.<call>  exists -> that query on that card fails with
 *                                    UNKNOWN; <call> is util, temp, power, memory, procs
 *                                    or placements (a MIG profile's possible placements)
 *
 * MIG (a card whose line has a 7th field "mig"): one geometry, A100/H100 80GB's: 7 compute
 * slices, 8 memory slices, the profiles and placements of NVIDIA's MIG user guide. Its state
 * lives in a file so that it outlives the plugin's process, as a GPU's does:
 *     mode <current> <pending>
 *     gi <id> <profile id> <start> <size>
 *     ci <gi id> <ci id> <ci profile id>
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    OK = 0, E_UNINIT = 1, E_INVALID = 2, E_NOT_SUPPORTED = 3, E_NOT_FOUND = 6,
    E_INSUFFICIENT = 7, E_DRIVER = 9, E_TIMEOUT = 10, E_LOST = 15, E_RESET_REQUIRED = 16,
    E_IN_USE = 19, E_INSUFFICIENT_RESOURCES = 23, E_UNKNOWN = 999
};
#define XID_CRITICAL 0x8ULL
#define MAX_CARDS 64

struct card {
    char uuid[96];
    char name[96];
    unsigned long long memory_mib;
    unsigned int minor;
    int numa;
    char bus_id[32];
    unsigned int index;
    unsigned long long events_mask;
    int mig_capable;
    /* A MIG device handle: the physical card it is part of, and its GPU/compute instance. */
    struct card *parent;
    unsigned int gi, ci;
};
typedef struct card *nvmlDevice_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time of the sample, microseconds */
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
struct event_set { long offset; };
typedef struct event_set *nvmlEventSet_t;

static struct card cards[MAX_CARDS];
static unsigned int ncards;
static int initialised;

static const char *state_path(const char *rel, char *buf, size_t len)
{
    const char *dir = getenv("FAKE_NVML_STATE");
    if (dir == NULL)
        return NULL;
    snprintf(buf, len, "%s/%s", dir, rel);
    return buf;
}

static int exists(const char *rel)
{
    char buf[512];
    const char *p = state_path(rel, buf, sizeof buf);
    return p != NULL && access(p, F_OK) == 0;
}

static void mkdir_state(const char *rel)
{
    char buf[512];
    if (state_path(rel, buf, sizeof buf) != NULL)
        mkdir(buf, 0755);
}

static nvmlReturn_t check(nvmlDevice_t d)
{
    char rel[160];
    if (!initialised)
        return E_UNINIT;
    if (d == NULL || d < cards || d >= cards + ncards)
        return E_INVALID; /* MIG device handles answer only the calls that take them */
    snprintf(rel, sizeof rel, "lost/%s", d->uuid);
    return exists(rel) ? E_LOST : OK;
}

static nvmlReturn_t load(void)
{
    const char *path = getenv("FAKE_NVML_CARDS");
    char line[512];
    FILE *f;
    if (exists("init_fail"))
        return E_DRIVER;
    if (path == NULL || (f = fopen(path, "r")) == NULL)
        return E_DRIVER;
    ncards = 0;
    while (ncards < MAX_CARDS && fgets(line, sizeof line, f) != NULL) {
        struct card *c = &cards[ncards];
        char *save = NULL, *field[7];
        int n = 0;
        line[strcspn(line, "\n")] = 0;
        if (line[0] == 0 || line[0] == '#')
            continue;
        for (char *t = strtok_r(line, "|", &save); t && n < 7; t = strtok_r(NULL, "|", &save))
            field[n++] = t;
        if (n != 6 && n != 7)
            continue;
        memset(c, 0, sizeof *c);
        snprintf(c->uuid, sizeof c->uuid, "%s", field[0]);
        snprintf(c->name, sizeof c->name, "%s", field[1]);
        c->memory_mib = strtoull(field[2], NULL, 10);
        c->minor = (unsigned int)strtoul(field[3], NULL, 10);
        c->numa = atoi(field[4]);
        snprintf(c->bus_id, sizeof c->bus_id, "%s", field[5]);
        c->mig_capable = n == 7 && strcmp(field[6], "mig") == 0;
        c->index = ncards++;
    }
    fclose(f);
    return OK;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t r = load();
    if (r == OK)
        initialised = 1;
    return r;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { initialised = 0; return OK; }

const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case OK: return "Success";
    case E_UNINIT: return "Uninitialized";
    case E_INVALID: return "Invalid Argument";
    case E_NOT_SUPPORTED: return "Not Supported";
    case E_NOT_FOUND: return "Not Found";
    case E_INSUFFICIENT: return "Insufficient Size";
    case E_DRIVER: return "Driver Not Loaded";
    case E_TIMEOUT: return "Timeout";
    case E_LOST: return "GPU is lost";
    case E_RESET_REQUIRED: return "GPU requires reset";
    case E_IN_USE: return "GPU is currently in use";
    case E_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len)
{
    if (!initialised) return E_UNINIT;
    if (len < 8) return E_INSUFFICIENT;
    snprintf(v, len, "550.54.15");
    return OK;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    if (!initialised) return E_UNINIT;
    *v = 12040; /* CUDA 12.4, as NVML encodes it: 1000 x major + 10 x minor */
    return OK;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    return nvmlSystemGetCudaDriverVersion_v2(v);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
    if (!initialised) return E_UNINIT;
    *n = ncards;
    return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (!initialised) return E_UNINIT;
    if (i >= ncards) return E_INVALID;
    *d = &cards[i];
    return OK;
}

static nvmlReturn_t copy_str(const char *s, char *out, unsigned int len)
{
    if (strlen(s) + 1 > len) return E_INSUFFICIENT;
    memcpy(out, s, strlen(s) + 1);
    return OK;
}

static nvmlReturn_t mig_device(nvmlDevice_t d);

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned int len)
{
    nvmlReturn_t r = check(d);
    if (r == E_INVALID && mig_device(d) == OK)
        return copy_str(d->uuid, out, len);
    return r == OK || r == E_LOST ? copy_str(d->uuid, out, len) : r;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned int len)
{
    nvmlReturn_t r = check(d);
    return r == OK ? copy_str(d->name, out, len) : r;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *i)
{
    nvmlReturn_t r = check(d);
    if (r == OK) *i = d->index;
    return r;
}

/* The test's failure switch for one query on one card: fail/<uuid>.<call>. */
static nvmlReturn_t check_call(nvmlDevice_t d, const char *call)
{
    char rel[200];
    nvmlReturn_t r = check(d);
    if (r != OK)
        return r;
    snprintf(rel, sizeof rel, "fail/%s.%s", d->uuid, call);
    return exists(rel) ? E_UNKNOWN : OK;
}

/* The value of <key> in figures/<uuid>; 0 when the file or the key is absent. */
static unsigned long long figure(nvmlDevice_t d, const char *key)
{
    char rel[160], buf[512], line[128], name[32];
    unsigned long long value, found = 0;
    const char *p;
    FILE *f;
    snprintf(rel, sizeof rel, "figures/%s", d->uuid);
    if ((p = state_path(rel, buf, sizeof buf)) == NULL || (f = fopen(p, "r")) == NULL)
        return 0;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "%31s %llu", name, &value) == 2 && strcmp(name, key) == 0)
            found = value;
    fclose(f);
    return found;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    nvmlReturn_t r = check_call(d, "memory");
    if (r != OK) return r;
    m->total = d->memory_mib << 20;
    m->used = figure(d, "mem_used_mib") << 20;
    if (m->used > m->total)
        m->used = m->total;
    m->free = m->total - m->used;
    return OK;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    nvmlReturn_t r = check_call(d, "util");
    if (r != OK) return r;
    if (u == NULL) return E_INVALID;
    u->gpu = (unsigned int)figure(d, "util");
    u->memory = (unsigned int)figure(d, "mem_util");
    return OK;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp)
{
    nvmlReturn_t r = check_call(d, "temp");
    if (r != OK) return r;
    if (sensor != 0 || temp == NULL) return E_INVALID; /* only NVML_TEMPERATURE_GPU exists */
    *temp = (unsigned int)figure(d, "temp");
    return OK;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *milliwatts)
{
    nvmlReturn_t r = check_call(d, "power");
    if (r != OK) return r;
    if (milliwatts == NULL) return E_INVALID;
    *milliwatts = (unsigned int)figure(d, "power_mw");
    return OK;
}

/* As NVML: a NULL buffer asks for the count (INSUFFICIENT_SIZE with the count), no sample
   newer than last_seen is NOT_FOUND. Every sample carries the time of the call, so a caller
   that passes back the newest time it saw gets nothing new within the same microsecond. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out,
                                             unsigned int *count, unsigned long long last_seen)
{
    char rel[160], buf[512], line[128];
    unsigned int pid, sm, mem, n = 0;
    struct timespec now;
    unsigned long long stamp;
    const char *p;
    FILE *f;
    nvmlReturn_t r = check_call(d, "procs");
    if (r != OK) return r;
    if (count == NULL) return E_INVALID;
    clock_gettime(CLOCK_REALTIME, &now);
    stamp = (unsigned long long)now.tv_sec * 1000000ULL + (unsigned long long)now.tv_nsec / 1000;
    if (stamp <= last_seen) {
        *count = 0;
        return E_NOT_FOUND;
    }
    snprintf(rel, sizeof rel, "procs/%s", d->uuid);
    if ((p = state_path(rel, buf, sizeof buf)) == NULL || (f = fopen(p, "r")) == NULL) {
        *count = 0;
        return E_NOT_FOUND;
    }
    while (fgets(line, sizeof line, f) != NULL) {
        if (sscanf(line, "%u %u %u", &pid, &sm, &mem) != 3)
            continue;
        if (out != NULL && n < *count) {
            memset(&out[n], 0, sizeof out[n]);
            out[n].pid = pid;
            out[n].timeStamp = stamp;
            out[n].smUtil = sm;
            out[n].memUtil = mem;
        }
        n++;
    }
    fclose(f);
    if (n == 0) {
        *count = 0;
        return E_NOT_FOUND;
    }
    if (out == NULL || n > *count) {
        *count = n;
        return E_INSUFFICIENT;
    }
    *count = n;
    return OK;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor)
{
    nvmlReturn_t r = check(d);
    if (r == OK) *minor = d->minor;
    return r;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, int *node)
{
    nvmlReturn_t r = check(d);
    if (r != OK) return r;
    if (d->numa < 0) return E_NOT_SUPPORTED;
    *node = d->numa;
    return OK;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p)
{
    nvmlReturn_t r = check(d);
    if (r != OK) return r;
    memset(p, 0, sizeof *p);
    snprintf(p->busId, sizeof p->busId, "%s", d->bus_id);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%.15s", d->bus_id);
    return OK;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    char buf[512];
    const char *p = state_path("events", buf, sizeof buf);
    FILE *f;
    if (!initialised) return E_UNINIT;
    *set = calloc(1, sizeof **set);
    if (*set == NULL) return E_UNKNOWN;
    /* Only events appended after the set exists are delivered, as with a real driver. */
    if (p != NULL && (f = fopen(p, "r")) != NULL) {
        fseek(f, 0, SEEK_END);
        (*set)->offset = ftell(f);
        fclose(f);
    }
    return OK;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t s)
{
    nvmlReturn_t r = check(d);
    if (r != OK) return r;
    if (s == NULL) return E_INVALID;
    d->events_mask |= types;
    return OK;
}

static int next_event(nvmlEventSet_t s, nvmlEventData_t *data)
{
    char buf[512], line[256], uuid[96];
    const char *p = state_path("events", buf, sizeof buf);
    unsigned long long xid;
    FILE *f;
    if (p == NULL || (f = fopen(p, "r")) == NULL)
        return 0;
    fseek(f, s->offset, SEEK_SET);
    while (fgets(line, sizeof line, f) != NULL) {
        if (strchr(line, '\n') == NULL)
            break; /* a line still being written */
        s->offset = ftell(f);
        if (sscanf(line, "%95s %llu", uuid, &xid) != 2)
            continue;
        for (unsigned int i = 0; i < ncards; i++) {
            if (strcmp(cards[i].uuid, uuid) == 0 && (cards[i].events_mask & XID_CRITICAL)) {
                memset(data, 0, sizeof *data);
                data->device = &cards[i];
                data->eventType = XID_CRITICAL;
                data->eventData = xid;
                fclose(f);
                return 1;
            }
        }
    }
    fclose(f);
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t s, nvmlEventData_t *data, unsigned int timeout_ms)
{
    struct timespec step = {0, 10 * 1000 * 1000};
    unsigned int waited = 0;
    if (!initialised) return E_UNINIT;
    if (s == NULL || data == NULL) return E_INVALID;
    for (;;) {
        if (next_event(s, data))
            return OK;
        if (waited >= timeout_ms)
            return E_TIMEOUT;
        nanosleep(&step, NULL);
        waited += 10;
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t s)
{
    free(s);
    return OK;
}

/* ---- MIG ------------------------------------------------------------------------------------ */

#define MIG_DISABLE 0
#define MIG_ENABLE 1
#define MEMORY_SLICES 8
#define COMPUTE_SLICES 7
#define MAX_GI 8
#define MAX_CI 8
#define MAX_PLACEMENTS 8
#define NAME_V2 96
#define GI_PROFILE_COUNT 0x12
#define CI_PROFILE_COUNT 0x9
#define CI_ENGINE_SHARED 0
#define STRUCT_VERSION(size, ver) ((unsigned int)(size) | ((unsigned int)(ver) << 24U))

typedef struct { unsigned int start, size; } nvmlGpuInstancePlacement_t;
typedef struct { unsigned int start, size; } nvmlComputeInstancePlacement_t;
typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;
typedef struct {
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[NAME_V2];
} nvmlGpuInstanceProfileInfo_v2_t;
typedef struct {
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;
typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount,
        sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount;
    char name[NAME_V2];
} nvmlComputeInstanceProfileInfo_v2_t;

/* Opaque handles: slots addressed by card, GPU instance id and compute instance id. */
struct gi_handle { unsigned int card, id; };
struct ci_handle { unsigned int card, gi, id; };
typedef struct gi_handle *nvmlGpuInstance_t;
typedef struct ci_handle *nvmlComputeInstance_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id, profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;
typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id, profileId;
    nvmlComputeInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

/* The geometry, indexed by NVML's NVML_GPU_INSTANCE_PROFILE_* constants; id 0 with no name is a
 * profile this card does not have. */
struct gi_profile {
    unsigned int id, slices, instances, sms;
    unsigned long long memory_mb;
    const char *name;
    unsigned int nplacements, placement_start[MAX_PLACEMENTS], placement_size;
};
static const struct gi_profile gi_profiles[GI_PROFILE_COUNT] = {
    [0x0] = {19, 1, 7, 14, 9728, "1g.10gb", 7, {0, 1, 2, 3, 4, 5, 6}, 1},
    [0x1] = {14, 2, 3, 28, 19968, "2g.20gb", 3, {0, 2, 4}, 2},
    [0x2] = {9, 3, 2, 42, 40192, "3g.40gb", 2, {0, 4}, 4},
    [0x3] = {5, 4, 1, 56, 40192, "4g.40gb", 1, {0}, 4},
    [0x4] = {0, 7, 1, 98, 80896, "7g.80gb", 1, {0}, 8},
    [0x7] = {20, 1, 1, 14, 9728, "1g.10gb+me", 7, {0, 1, 2, 3, 4, 5, 6}, 1},
    [0x9] = {15, 1, 4, 14, 19968, "1g.20gb", 4, {0, 2, 4, 6}, 2},
};
/* Compute instance profiles by NVML_COMPUTE_INSTANCE_PROFILE_*: the slices they take. */
static const unsigned int ci_profile_slices[CI_PROFILE_COUNT] = {1, 2, 3, 4, 7, 0, 0, 0, 0};

struct gi_state { int used; unsigned int id, profile_id, start, size; };
struct ci_state { int used; unsigned int gi, id, profile_id; };
struct mig_state {
    unsigned int current, pending;
    struct gi_state gi[MAX_GI];
    struct ci_state ci[MAX_GI * MAX_CI];
};

static struct gi_handle gi_slots[MAX_CARDS][MAX_GI + 1];
static struct ci_handle ci_slots[MAX_CARDS][MAX_GI + 1][MAX_CI];
static struct card mig_devices[MAX_CARDS][MAX_GI * MAX_CI];

static const struct gi_profile *profile_by_id(unsigned int id, unsigned int *index)
{
    for (unsigned int i = 0; i < GI_PROFILE_COUNT; i++)
        if (gi_profiles[i].name != NULL && gi_profiles[i].id == id) {
            if (index != NULL)
                *index = i;
            return &gi_profiles[i];
        }
    return NULL;
}

static void mig_rel(const struct card *c, char *rel, size_t len)
{
    snprintf(rel, len, "mig/%s", c->uuid);
}

static void mig_read(const struct card *c, struct mig_state *st)
{
    char rel[160], buf[512], line[256];
    unsigned int a, b, x, y;
    size_t ngi = 0, nci = 0;
    FILE *f;
    memset(st, 0, sizeof *st);
    mig_rel(c, rel, sizeof rel);
    if (state_path(rel, buf, sizeof buf) == NULL || (f = fopen(buf, "r")) == NULL)
        return;
    while (fgets(line, sizeof line, f) != NULL) {
        if (sscanf(line, "mode %u %u", &a, &b) == 2) {
            st->current = a;
            st->pending = b;
        } else if (sscanf(line, "gi %u %u %u %u", &a, &b, &x, &y) == 4 && ngi < MAX_GI) {
            st->gi[ngi++] = (struct gi_state){1, a, b, x, y};
        } else if (sscanf(line, "ci %u %u %u", &a, &b, &x) == 3 && nci < MAX_GI * MAX_CI) {
            st->ci[nci++] = (struct ci_state){1, a, b, x};
        }
    }
    fclose(f);
}

static nvmlReturn_t mig_write(const struct card *c, const struct mig_state *st)
{
    char rel[160], buf[512], tmp[600];
    FILE *f;
    mkdir_state("mig");
    mig_rel(c, rel, sizeof rel);
    if (state_path(rel, buf, sizeof buf) == NULL)
        return E_UNKNOWN;
    snprintf(tmp, sizeof tmp, "%s.tmp%d", buf, (int)getpid());
    if ((f = fopen(tmp, "w")) == NULL)
        return E_UNKNOWN;
    fprintf(f, "mode %u %u\n", st->current, st->pending);
    for (size_t i = 0; i < MAX_GI; i++)
        if (st->gi[i].used)
            fprintf(f, "gi %u %u %u %u\n", st->gi[i].id, st->gi[i].profile_id, st->gi[i].start,
                    st->gi[i].size);
    for (size_t i = 0; i < MAX_GI * MAX_CI; i++)
        if (st->ci[i].used)
            fprintf(f, "ci %u %u %u\n", st->ci[i].gi, st->ci[i].id, st->ci[i].profile_id);
    fclose(f);
    return rename(tmp, buf) == 0 ? OK : E_UNKNOWN;
}

static struct gi_state *find_gi(struct mig_state *st, unsigned int id)
{
    for (size_t i = 0; i < MAX_GI; i++)
        if (st->gi[i].used && st->gi[i].id == id)
            return &st->gi[i];
    return NULL;
}

static struct ci_state *find_ci(struct mig_state *st, unsigned int gi, unsigned int id)
{
    for (size_t i = 0; i < MAX_GI * MAX_CI; i++)
        if (st->ci[i].used && st->ci[i].gi == gi && st->ci[i].id == id)
            return &st->ci[i];
    return NULL;
}

/* A card that can do MIG, with MIG on now (not pending a reset). */
static nvmlReturn_t mig_card(nvmlDevice_t d, struct mig_state *st)
{
    nvmlReturn_t r = check(d);
    if (r != OK)
        return r;
    if (!d->mig_capable)
        return E_NOT_SUPPORTED;
    mig_read(d, st);
    return st->current == MIG_ENABLE ? OK : E_NOT_SUPPORTED;
}

/* The MIG device UUID NVML reports: stable for one card, GPU instance and compute instance. */
static void mig_uuid(const struct card *c, unsigned int gi, unsigned int ci, char *out, size_t len)
{
    unsigned long long h = 1469598103934665603ULL;
    for (const char *p = c->uuid; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    h = (h ^ gi) * 1099511628211ULL;
    h = (h ^ (ci + 0x100)) * 1099511628211ULL;
    snprintf(out, len, "MIG-%08llx-%04llx-%04llx-%04x-%012llx", h >> 32, (h >> 16) & 0xffff,
             h & 0xffff, (gi << 8) | ci, (h * 31) & 0xffffffffffffULL);
}

static int mig_busy(const struct card *c, unsigned int gi, int ci)
{
    char uuid[96], rel[160];
    struct mig_state st;
    mig_read(c, &st);
    for (size_t i = 0; i < MAX_GI * MAX_CI; i++) {
        if (!st.ci[i].used || st.ci[i].gi != gi || (ci >= 0 && st.ci[i].id != (unsigned int)ci))
            continue;
        mig_uuid(c, gi, st.ci[i].id, uuid, sizeof uuid);
        snprintf(rel, sizeof rel, "busy/%s", uuid);
        if (exists(rel))
            return 1;
    }
    return 0;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    struct mig_state st;
    nvmlReturn_t r = check(d);
    if (r != OK)
        return r;
    if (current == NULL || pending == NULL)
        return E_INVALID;
    if (!d->mig_capable)
        return E_NOT_SUPPORTED;
    mig_read(d, &st);
    *current = st.current;
    *pending = st.pending;
    return OK;
}

nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t d, unsigned int mode, nvmlReturn_t *activation)
{
    struct mig_state st;
    nvmlReturn_t r = check(d);
    if (r != OK)
        return r;
    if (activation == NULL || (mode != MIG_DISABLE && mode != MIG_ENABLE))
        return E_INVALID;
    if (!d->mig_capable)
        return E_NOT_SUPPORTED;
    mig_read(d, &st);
    if (mode == MIG_DISABLE && st.current == MIG_ENABLE) {
        for (size_t i = 0; i < MAX_GI; i++)
            if (st.gi[i].used) {
                *activation = E_IN_USE; /* instances exist: the driver will not unbind */
                return OK;
            }
    }
    st.pending = mode;
    if (exists("mig_reset_required")) {
        *activation = E_RESET_REQUIRED;
    } else {
        st.current = mode;
        *activation = OK;
    }
    return mig_write(d, &st);
}

static nvmlReturn_t gi_profile_of(nvmlDevice_t d, unsigned int profile, const struct gi_profile **p)
{
    nvmlReturn_t r = check(d);
    if (r != OK)
        return r;
    if (!d->mig_capable)
        return E_NOT_SUPPORTED;
    if (profile >= GI_PROFILE_COUNT)
        return E_INVALID;
    if (gi_profiles[profile].name == NULL)
        return E_NOT_SUPPORTED;
    *p = &gi_profiles[profile];
    return OK;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t d, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    const struct gi_profile *p;
    nvmlReturn_t r = gi_profile_of(d, profile, &p);
    if (r != OK)
        return r;
    if (info == NULL)
        return E_INVALID;
    memset(info, 0, sizeof *info);
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->instances;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->slices;
    info->memorySizeMB = p->memory_mb;
    return OK;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t d, unsigned int profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const struct gi_profile *p;
    nvmlReturn_t r = gi_profile_of(d, profile, &p);
    if (r != OK)
        return r;
    if (info == NULL || info->version != STRUCT_VERSION(sizeof *info, 2))
        return E_INVALID;
    memset(info, 0, sizeof *info);
    info->version = STRUCT_VERSION(sizeof *info, 2);
    info->id = p->id;
    info->sliceCount = p->slices;
    info->instanceCount = p->instances;
    info->multiprocessorCount = p->sms;
    info->copyEngineCount = p->slices;
    info->memorySizeMB = p->memory_mb;
    snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    return OK;
}

nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t d, unsigned int profile_id,
                                                           nvmlGpuInstancePlacement_t *placements,
                                                           unsigned int *count)
{
    const struct gi_profile *p;
    nvmlReturn_t r = check_call(d, "placements");
    if (r != OK)
        return r;
    if (count == NULL)
        return E_INVALID;
    if (!d->mig_capable || (p = profile_by_id(profile_id, NULL)) == NULL)
        return E_NOT_SUPPORTED;
    if (placements != NULL) {
        if (*count < p->nplacements)
            return E_INSUFFICIENT;
        for (unsigned int i = 0; i < p->nplacements; i++)
            placements[i] = (nvmlGpuInstancePlacement_t){p->placement_start[i], p->placement_size};
    }
    *count = p->nplacements;
    return OK;
}

nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t d, unsigned int profile_id,
                                                      const nvmlGpuInstancePlacement_t *placement,
                                                      nvmlGpuInstance_t *out)
{
    struct mig_state st;
    const struct gi_profile *p;
    unsigned int compute = 0, id, i;
    int allowed = 0;
    nvmlReturn_t r = mig_card(d, &st);
    if (r != OK)
        return r;
    if (placement == NULL || out == NULL || (p = profile_by_id(profile_id, NULL)) == NULL)
        return E_INVALID;
    for (i = 0; i < p->nplacements; i++)
        allowed |= p->placement_start[i] == placement->start && p->placement_size == placement->size;
    if (!allowed)
        return E_INVALID;
    for (i = 0; i < MAX_GI; i++) {
        const struct gi_state *g = &st.gi[i];
        const struct gi_profile *gp;
        if (!g->used)
            continue;
        if (g->start < placement->start + placement->size && placement->start < g->start + g->size)
            return E_INSUFFICIENT_RESOURCES; /* the memory slices are taken */
        gp = profile_by_id(g->profile_id, NULL);
        compute += gp != NULL ? gp->slices : 0;
    }
    if (compute + p->slices > COMPUTE_SLICES)
        return E_INSUFFICIENT_RESOURCES;
    for (id = 1; id <= MAX_GI && find_gi(&st, id) != NULL; id++)
        ;
    for (i = 0; i < MAX_GI && st.gi[i].used; i++)
        ;
    if (id > MAX_GI || i == MAX_GI)
        return E_INSUFFICIENT_RESOURCES;
    st.gi[i] = (struct gi_state){1, id, profile_id, placement->start, placement->size};
    if ((r = mig_write(d, &st)) != OK)
        return r;
    gi_slots[d->index][id] = (struct gi_handle){d->index, id};
    *out = &gi_slots[d->index][id];
    return OK;
}

/* The MIG state of the card an instance handle belongs to (NULL: an invalid handle). */
static nvmlReturn_t handle_card(const unsigned int *card, struct card **c, struct mig_state *st)
{
    if (!initialised)
        return E_UNINIT;
    if (card == NULL || *card >= ncards)
        return E_INVALID;
    *c = &cards[*card];
    mig_read(*c, st);
    return st->current == MIG_ENABLE ? OK : E_NOT_SUPPORTED;
}

/* The GPU instance a handle names, if it still exists. */
static nvmlReturn_t gi_of(nvmlGpuInstance_t h, struct card **c, struct mig_state *st,
                          struct gi_state **g)
{
    nvmlReturn_t r = handle_card(h != NULL ? &h->card : NULL, c, st);
    if (r != OK)
        return r;
    if ((*g = find_gi(st, h->id)) == NULL)
        return E_INVALID;
    return OK;
}

nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t h)
{
    struct card *c;
    struct mig_state st;
    struct gi_state *g;
    nvmlReturn_t r = gi_of(h, &c, &st, &g);
    if (r != OK)
        return r;
    for (size_t i = 0; i < MAX_GI * MAX_CI; i++)
        if (st.ci[i].used && st.ci[i].gi == g->id)
            return E_IN_USE; /* compute instances are still on it */
    g->used = 0;
    return mig_write(c, &st);
}

nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t d, unsigned int profile_id,
                                       nvmlGpuInstance_t *out, unsigned int *count)
{
    struct mig_state st;
    unsigned int n = 0;
    nvmlReturn_t r = mig_card(d, &st);
    if (r != OK)
        return r;
    if (count == NULL || out == NULL || profile_by_id(profile_id, NULL) == NULL)
        return E_INVALID;
    for (size_t i = 0; i < MAX_GI; i++) {
        if (!st.gi[i].used || st.gi[i].profile_id != profile_id)
            continue;
        gi_slots[d->index][st.gi[i].id] = (struct gi_handle){d->index, st.gi[i].id};
        out[n++] = &gi_slots[d->index][st.gi[i].id];
    }
    *count = n;
    return OK;
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t h, nvmlGpuInstanceInfo_t *info)
{
    struct card *c;
    struct mig_state st;
    struct gi_state *g;
    nvmlReturn_t r = gi_of(h, &c, &st, &g);
    if (r != OK)
        return r;
    if (info == NULL)
        return E_INVALID;
    info->device = c;
    info->id = g->id;
    info->profileId = g->profile_id;
    info->placement = (nvmlGpuInstancePlacement_t){g->start, g->size};
    return OK;
}

static nvmlReturn_t ci_profile_of(nvmlGpuInstance_t h, unsigned int profile, unsigned int eng,
                                  struct gi_state **g, struct card **c, struct mig_state *st)
{
    const struct gi_profile *gp;
    nvmlReturn_t r = gi_of(h, c, st, g);
    if (r != OK)
        return r;
    if (profile >= CI_PROFILE_COUNT || eng != CI_ENGINE_SHARED)
        return E_INVALID;
    gp = profile_by_id((*g)->profile_id, NULL);
    if (ci_profile_slices[profile] == 0 || gp == NULL || ci_profile_slices[profile] > gp->slices)
        return E_NOT_SUPPORTED;
    return OK;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t h, unsigned int profile,
                                                           unsigned int eng,
                                                           nvmlComputeInstanceProfileInfo_v2_t *info)
{
    struct gi_state *g;
    struct card *c;
    struct mig_state st;
    const struct gi_profile *gp;
    nvmlReturn_t r = ci_profile_of(h, profile, eng, &g, &c, &st);
    if (r != OK)
        return r;
    if (info == NULL || info->version != STRUCT_VERSION(sizeof *info, 2))
        return E_INVALID;
    gp = profile_by_id(g->profile_id, NULL);
    memset(info, 0, sizeof *info);
    info->version = STRUCT_VERSION(sizeof *info, 2);
    info->id = profile; /* a compute instance profile's id is its index, as on real cards */
    info->sliceCount = ci_profile_slices[profile];
    info->instanceCount = gp->slices / ci_profile_slices[profile];
    info->multiprocessorCount = 14 * ci_profile_slices[profile];
    info->sharedCopyEngineCount = gp->slices;
    if (ci_profile_slices[profile] == gp->slices)
        snprintf(info->name, sizeof info->name, "MIG %s", gp->name);
    else
        snprintf(info->name, sizeof info->name, "MIG %uc.%s", ci_profile_slices[profile], gp->name);
    return OK;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t h, unsigned int profile,
                                                          unsigned int eng,
                                                          nvmlComputeInstanceProfileInfo_t *info)
{
    nvmlComputeInstanceProfileInfo_v2_t v2;
    nvmlReturn_t r;
    if (info == NULL)
        return E_INVALID;
    v2.version = STRUCT_VERSION(sizeof v2, 2);
    if ((r = nvmlGpuInstanceGetComputeInstanceProfileInfoV(h, profile, eng, &v2)) != OK)
        return r;
    memcpy(info, &v2.id, sizeof *info);
    return OK;
}

nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t h, unsigned int profile_id,
                                                  nvmlComputeInstance_t *out)
{
    struct gi_state *g;
    struct card *c;
    struct mig_state st;
    unsigned int used = 0, id, i;
    const struct gi_profile *gp;
    nvmlReturn_t r = ci_profile_of(h, profile_id, CI_ENGINE_SHARED, &g, &c, &st);
    if (r != OK)
        return r;
    if (out == NULL)
        return E_INVALID;
    gp = profile_by_id(g->profile_id, NULL);
    for (i = 0; i < MAX_GI * MAX_CI; i++)
        if (st.ci[i].used && st.ci[i].gi == g->id)
            used += ci_profile_slices[st.ci[i].profile_id];
    if (used + ci_profile_slices[profile_id] > gp->slices)
        return E_INSUFFICIENT_RESOURCES;
    for (id = 0; id < MAX_CI && find_ci(&st, g->id, id) != NULL; id++)
        ;
    for (i = 0; i < MAX_GI * MAX_CI && st.ci[i].used; i++)
        ;
    if (id == MAX_CI || i == MAX_GI * MAX_CI)
        return E_INSUFFICIENT_RESOURCES;
    st.ci[i] = (struct ci_state){1, g->id, id, profile_id};
    if ((r = mig_write(c, &st)) != OK)
        return r;
    ci_slots[c->index][g->id][id] = (struct ci_handle){c->index, g->id, id};
    *out = &ci_slots[c->index][g->id][id];
    return OK;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t h, unsigned int profile_id,
                                                nvmlComputeInstance_t *out, unsigned int *count)
{
    struct gi_state *g;
    struct card *c;
    struct mig_state st;
    unsigned int n = 0;
    nvmlReturn_t r = gi_of(h, &c, &st, &g);
    if (r != OK)
        return r;
    if (out == NULL || count == NULL || profile_id >= CI_PROFILE_COUNT)
        return E_INVALID;
    for (size_t i = 0; i < MAX_GI * MAX_CI; i++) {
        struct ci_state *ci = &st.ci[i];
        if (!ci->used || ci->gi != g->id || ci->profile_id != profile_id)
            continue;
        ci_slots[c->index][g->id][ci->id] = (struct ci_handle){c->index, g->id, ci->id};
        out[n++] = &ci_slots[c->index][g->id][ci->id];
    }
    *count = n;
    return OK;
}

static nvmlReturn_t ci_of(nvmlComputeInstance_t h, struct card **c, struct mig_state *st,
                          struct ci_state **ci)
{
    nvmlReturn_t r = handle_card(h != NULL ? &h->card : NULL, c, st);
    if (r != OK)
        return r;
    if ((*ci = find_ci(st, h->gi, h->id)) == NULL)
        return E_INVALID;
    return OK;
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t h, nvmlComputeInstanceInfo_t *info)
{
    struct card *c;
    struct mig_state st;
    struct ci_state *ci;
    nvmlReturn_t r = ci_of(h, &c, &st, &ci);
    if (r != OK)
        return r;
    if (info == NULL)
        return E_INVALID;
    gi_slots[c->index][ci->gi] = (struct gi_handle){c->index, ci->gi};
    info->device = c;
    info->gpuInstance = &gi_slots[c->index][ci->gi];
    info->id = ci->id;
    info->profileId = ci->profile_id;
    info->placement = (nvmlComputeInstancePlacement_t){0, ci_profile_slices[ci->profile_id]};
    return OK;
}

nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t h)
{
    struct card *c;
    struct mig_state st;
    struct ci_state *ci;
    nvmlReturn_t r = ci_of(h, &c, &st, &ci);
    if (r != OK)
        return r;
    if (mig_busy(c, ci->gi, (int)ci->id))
        return E_IN_USE; /* a process still runs on it */
    ci->used = 0;
    return mig_write(c, &st);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count)
{
    nvmlReturn_t r = check(d);
    if (r != OK)
        return r;
    if (count == NULL)
        return E_INVALID;
    *count = d->mig_capable ? COMPUTE_SLICES : 0;
    return OK;
}

/* MIG devices (one per compute instance) in GPU instance id, then compute instance id order. */
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index,
                                                 nvmlDevice_t *out)
{
    struct mig_state st;
    unsigned int n = 0;
    nvmlReturn_t r = mig_card(d, &st);
    if (r != OK)
        return r;
    if (out == NULL || index >= COMPUTE_SLICES)
        return E_INVALID;
    for (unsigned int gi = 0; gi <= MAX_GI; gi++)
        for (unsigned int ci = 0; ci < MAX_CI; ci++) {
            struct card *m;
            if (find_gi(&st, gi) == NULL || find_ci(&st, gi, ci) == NULL)
                continue;
            if (n++ != index)
                continue;
            m = &mig_devices[d->index][index];
            memset(m, 0, sizeof *m);
            mig_uuid(d, gi, ci, m->uuid, sizeof m->uuid);
            snprintf(m->name, sizeof m->name, "%.80s MIG", d->name);
            m->parent = d;
            m->gi = gi;
            m->ci = ci;
            *out = m;
            return OK;
        }
    return E_NOT_FOUND;
}

static nvmlReturn_t mig_device(nvmlDevice_t d)
{
    if (!initialised)
        return E_UNINIT;
    for (unsigned int i = 0; i < ncards; i++)
        if (d >= mig_devices[i] && d < mig_devices[i] + MAX_GI * MAX_CI && d->parent != NULL)
            return OK;
    return E_INVALID;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig)
{
    if (is_mig == NULL)
        return E_INVALID;
    if (mig_device(d) == OK) {
        *is_mig = 1;
        return OK;
    }
    nvmlReturn_t r = check(d);
    if (r == OK)
        *is_mig = 0;
    return r;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id)
{
    nvmlReturn_t r = mig_device(d);
    if (r != OK || id == NULL)
        return r != OK ? r : E_INVALID;
    *id = d->gi;
    return OK;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t d, unsigned int *id)
{
    nvmlReturn_t r = mig_device(d);
    if (r != OK || id == NULL)
        return r != OK ? r : E_INVALID;
    *id = d->ci;
    return OK;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t d, nvmlDevice_t *parent)
{
    nvmlReturn_t r = mig_device(d);
    if (r != OK || parent == NULL)
        return r != OK ? r : E_INVALID;
    *parent = d->parent;
    return OK;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t d, unsigned int id, nvmlGpuInstance_t *out)
{
    struct mig_state st;
    nvmlReturn_t r = mig_card(d, &st);
    if (r != OK)
        return r;
    if (out == NULL || id > MAX_GI)
        return E_INVALID;
    if (find_gi(&st, id) == NULL)
        return E_NOT_FOUND;
    gi_slots[d->index][id] = (struct gi_handle){d->index, id};
    *out = &gi_slots[d->index][id];
    return OK;
}
