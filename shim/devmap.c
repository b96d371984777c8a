/*
 * Which NVML device is which CUDA device.
 *
 * Limits are keyed by the CUDA ordinal inside the container.  CUDA numbers the cards
 * in CUDA_VISIBLE_DEVICES order (the node plugin lists UUIDs in the allocation's
 * order); NVML always numbers them in PCI order.  The two orders differ whenever the
 * allocation is not in PCI order, so an NVML device is matched to a CUDA ordinal by
 * the card's identity: its UUID, else its PCI bus id.  Once CUDA is initialised in the
 * process, the identities come from the driver itself (cuDeviceGetUuid_v2,
 * cuDeviceGetPCIBusId).  A process that only uses NVML (nvidia-smi, a monitoring
 * agent, a launcher that must not initialise CUDA before it forks) is matched through
 * CUDA_VISIBLE_DEVICES read the way CUDA reads it; with neither, NVML's index is taken
 * as the ordinal, which holds when CUDA_DEVICE_ORDER=PCI_BUS_ID.
 *
 * Never on a hot path: the NVML memory hooks and the compute and memory samplers call
 * it, and each NVML handle is matched once.
 */
#include "shim.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define UUID_BUF NVML_DEVICE_UUID_V2_BUFFER_SIZE

struct pci_id {
    unsigned domain, bus, device;
    bool known;
};

/* CUDA_VISIBLE_DEVICES, read once at load: a UUID (or UUID prefix) or an index per ordinal. */
static char visible_uuid[TESSERA_MAX_DEVICES][UUID_BUF];
static int visible_index[TESSERA_MAX_DEVICES];
static int visible_count = -1; /* -1: not set */

/* What the driver says about each ordinal, once CUDA is initialised. */
static char cuda_uuid[TESSERA_MAX_DEVICES][UUID_BUF];
static struct pci_id cuda_pci[TESSERA_MAX_DEVICES];
static int cuda_count = -1; /* -1: CUDA not initialised in this process (or not yet) */

/* Matched NVML handles, and the NVML handle of each ordinal. */
#define CACHE_SIZE 32
static struct {
    nvmlDevice_t handle;
    int ordinal;
} cache[CACHE_SIZE];
static int cache_used;
static nvmlDevice_t by_ordinal[TESSERA_MAX_DEVICES];
static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;

static bool starts_with_ci(const char *s, const char *prefix)
{
    return strncasecmp(s, prefix, strlen(prefix)) == 0;
}

void tessera_devmap_read_env(const char *cvd)
{
    if (cvd == NULL)
        return;
    visible_count = 0;
    char buf[TESSERA_MAX_DEVICES * UUID_BUF];
    snprintf(buf, sizeof buf, "%s", cvd);
    char *save = NULL;
    for (char *e = strtok_r(buf, ",", &save); e != NULL && visible_count < (int)TESSERA_MAX_DEVICES;
         e = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*e))
            e++;
        size_t n = strlen(e);
        while (n > 0 && isspace((unsigned char)e[n - 1]))
            e[--n] = '\0';
        int i = visible_count;
        visible_index[i] = -1;
        visible_uuid[i][0] = '\0';
        if (isdigit((unsigned char)*e)) {
            char *end;
            long v = strtol(e, &end, 10);
            if (*end != '\0' || v < 0)
                break; /* CUDA stops at the first entry it cannot read */
            visible_index[i] = (int)v;
        } else if (starts_with_ci(e, "GPU-")) {
            snprintf(visible_uuid[i], UUID_BUF, "%s", e);
        } else {
            break; /* MIG-..., or nothing CUDA would accept */
        }
        visible_count++;
    }
}

static void format_uuid(const CUuuid *u, char *out)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, UUID_BUF, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* "0000:3b:00.0" (CUDA) or "00000000:3B:00.0" (NVML): domain, bus and device as numbers. */
static struct pci_id parse_pci(const char *s)
{
    struct pci_id id = {0, 0, 0, false};
    unsigned fn;
    if (sscanf(s, "%x:%x:%x.%x", &id.domain, &id.bus, &id.device, &fn) == 4)
        id.known = true;
    return id;
}

static void cuda_ready_once(void)
{
    int count = 0;
    if (REAL(cuDeviceGetCount)(&count) != CUDA_SUCCESS)
        return;
    if (count > (int)TESSERA_MAX_DEVICES)
        count = (int)TESSERA_MAX_DEVICES;
    for (int i = 0; i < count; i++) {
        CUdevice d;
        CUuuid u;
        char bus[32];
        cuda_uuid[i][0] = '\0';
        cuda_pci[i].known = false;
        if (REAL(cuDeviceGet)(&d, i) != CUDA_SUCCESS)
            continue;
        if (REAL(cuDeviceGetUuid_v2)(&u, d) == CUDA_SUCCESS)
            format_uuid(&u, cuda_uuid[i]);
        if (REAL(cuDeviceGetPCIBusId)(bus, (int)sizeof bus, d) == CUDA_SUCCESS)
            cuda_pci[i] = parse_pci(bus);
        TLOG(TLOG_DEBUG, "CUDA device %d is %s at %s", i, cuda_uuid[i][0] ? cuda_uuid[i] : "(no UUID)",
             cuda_pci[i].known ? bus : "(no PCI id)");
    }
    pthread_mutex_lock(&map_lock);
    __atomic_store_n(&cuda_count, count, __ATOMIC_RELEASE);
    cache_used = 0; /* matched before CUDA knew better */
    memset(by_ordinal, 0, sizeof by_ordinal);
    pthread_mutex_unlock(&map_lock);
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;

void tessera_devmap_cuda_ready(void)
{
    int saved = errno;
    pthread_once(&cuda_once, cuda_ready_once);
    errno = saved;
}

bool tessera_devmap_cuda_known(void)
{
    return __atomic_load_n(&cuda_count, __ATOMIC_ACQUIRE) >= 0;
}

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static bool nvml_up;

static void nvml_init_once(void)
{
    nvml_up = REAL(nvmlInit_v2)() == NVML_SUCCESS;
    if (!nvml_up)
        TLOG(TLOG_INFO, "NVML cannot be initialised; cards are not measured through it");
}

bool tessera_nvml_ready(void)
{
    int saved = errno;
    pthread_once(&nvml_once, nvml_init_once);
    errno = saved;
    return nvml_up;
}

/* The CUDA ordinal of an NVML device, -1 when it is none of this process's CUDA devices. */
static int match(nvmlDevice_t device)
{
    char uuid[UUID_BUF];
    bool have_uuid = REAL(nvmlDeviceGetUUID)(device, uuid, sizeof uuid) == NVML_SUCCESS;
    int count = __atomic_load_n(&cuda_count, __ATOMIC_ACQUIRE);
    if (count >= 0) {
        for (int i = 0; i < count && have_uuid; i++)
            if (cuda_uuid[i][0] != '\0' && strcasecmp(uuid, cuda_uuid[i]) == 0)
                return i;
        nvmlPciInfo_t pci;
        if (REAL(nvmlDeviceGetPciInfo_v3)(device, &pci) == NVML_SUCCESS)
            for (int i = 0; i < count; i++)
                if (cuda_pci[i].known && cuda_pci[i].domain == pci.domain && cuda_pci[i].bus == pci.bus &&
                    cuda_pci[i].device == pci.device)
                    return i;
        return -1;
    }
    unsigned index = 0;
    bool have_index = REAL(nvmlDeviceGetIndex)(device, &index) == NVML_SUCCESS;
    if (visible_count < 0)
        return have_index ? (int)index : -1;
    for (int i = 0; i < visible_count; i++) {
        if (visible_uuid[i][0] != '\0' ? have_uuid && starts_with_ci(uuid, visible_uuid[i])
                                       : have_index && visible_index[i] == (int)index)
            return i;
    }
    return -1;
}

int tessera_devmap_ordinal(nvmlDevice_t device)
{
    int saved = errno;
    int ordinal = -2;
    pthread_mutex_lock(&map_lock);
    for (int i = 0; i < cache_used; i++)
        if (cache[i].handle == device)
            ordinal = cache[i].ordinal;
    pthread_mutex_unlock(&map_lock);
    if (ordinal == -2) {
        ordinal = match(device);
        pthread_mutex_lock(&map_lock);
        if (cache_used < CACHE_SIZE)
            cache[cache_used++] = (__typeof__(cache[0])){device, ordinal};
        pthread_mutex_unlock(&map_lock);
        if (ordinal < 0)
            TLOG(TLOG_INFO, "an NVML device matches none of this container's CUDA devices; it is not limited");
    }
    errno = saved;
    return ordinal;
}

nvmlDevice_t tessera_devmap_nvml(int ordinal)
{
    if ((unsigned)ordinal >= TESSERA_MAX_DEVICES || !tessera_nvml_ready())
        return NULL;
    pthread_mutex_lock(&map_lock);
    nvmlDevice_t h = by_ordinal[ordinal];
    pthread_mutex_unlock(&map_lock);
    if (h != NULL)
        return h;
    int saved = errno;
    unsigned n = 0;
    if (REAL(nvmlDeviceGetCount_v2)(&n) == NVML_SUCCESS)
        for (unsigned j = 0; j < n && h == NULL; j++) {
            nvmlDevice_t cand;
            if (REAL(nvmlDeviceGetHandleByIndex_v2)(j, &cand) == NVML_SUCCESS && tessera_devmap_ordinal(cand) == ordinal)
                h = cand;
        }
    if (h != NULL) {
        pthread_mutex_lock(&map_lock);
        by_ordinal[ordinal] = h;
        pthread_mutex_unlock(&map_lock);
    } else {
        TLOG(TLOG_WARN, "no NVML device is CUDA device %d; it is not measured", ordinal);
    }
    errno = saved;
    return h;
}
