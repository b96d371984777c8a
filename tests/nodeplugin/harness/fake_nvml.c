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
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    OK = 0, E_UNINIT = 1, E_INVALID = 2, E_NOT_SUPPORTED = 3, E_NOT_FOUND = 6,
    E_INSUFFICIENT = 7, E_DRIVER = 9, E_TIMEOUT = 10, E_LOST = 15, E_UNKNOWN = 999
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
};
typedef struct card *nvmlDevice_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
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

static nvmlReturn_t check(nvmlDevice_t d)
{
    char rel[160];
    if (!initialised)
        return E_UNINIT;
    if (d == NULL || d < cards || d >= cards + ncards)
        return E_INVALID;
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
        char *save = NULL, *field[6];
        int n = 0;
        line[strcspn(line, "\n")] = 0;
        if (line[0] == 0 || line[0] == '#')
            continue;
        for (char *t = strtok_r(line, "|", &save); t && n < 6; t = strtok_r(NULL, "|", &save))
            field[n++] = t;
        if (n != 6)
            continue;
        memset(c, 0, sizeof *c);
        snprintf(c->uuid, sizeof c->uuid, "%s", field[0]);
        snprintf(c->name, sizeof c->name, "%s", field[1]);
        c->memory_mib = strtoull(field[2], NULL, 10);
        c->minor = (unsigned int)strtoul(field[3], NULL, 10);
        c->numa = atoi(field[4]);
        snprintf(c->bus_id, sizeof c->bus_id, "%s", field[5]);
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
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len)
{
    if (!initialised) return E_UNINIT;
    if (len < 8) return E_INSUFFICIENT;
    snprintf(v, len, "550.00.fake");
    return OK;
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

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned int len)
{
    nvmlReturn_t r = check(d);
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

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    nvmlReturn_t r = check(d);
    if (r != OK) return r;
    m->total = d->memory_mib << 20;
    m->used = 0;
    m->free = m->total;
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
