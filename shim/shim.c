/*
 * Tessera shim: load-time settings, logging, resolution of the real driver
 * entry points, the dlsym() redirect and cuGetProcAddress().
 *
 * Everything that names a hooked symbol is generated from hooks.def.
 */
#include "shim.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int tessera_log_level = TLOG_WARN;
struct tessera_settings tessera_cfg;
int tessera_mem_on;
uint32_t tessera_core_mask;
uint32_t tessera_oversub_mask;
int tessera_task_priority = -1;
int tessera_launch_on;
int tessera_init_done;

/* ------------------------------------------------------------------ logging */

void tessera_log(int level, const char *fmt, ...)
{
    static const char *const names[] = {"", "error", "warning", "info", "debug"};
    int saved = errno;
    char buf[768];
    int n = snprintf(buf, sizeof buf, "tessera[%d]: %s: ", (int)getpid(),
                     names[level < 0 ? 0 : level > TLOG_DEBUG ? TLOG_DEBUG : level]);
    if (n < 0)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        m = 0;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2)
        len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
    errno = saved;
}

/* ------------------------------------------------------- real entry points */

void *tessera_real_table[TESSERA_ID_COUNT];

static const char *const real_names[TESSERA_ID_COUNT] = {
#define CU_HOOK(symbol, base, since, stream, params, args) #symbol,
#define NVML_HOOK(symbol, params, args) #symbol,
#define CU_REAL(symbol, params) #symbol,
#define NVML_REAL(symbol, params) #symbol,
#include "hooks.def"
};

static const unsigned char real_is_nvml[TESSERA_ID_COUNT] = {
#define CU_HOOK(symbol, base, since, stream, params, args) 0,
#define NVML_HOOK(symbol, params, args) 1,
#define CU_REAL(symbol, params) 0,
#define NVML_REAL(symbol, params) 1,
#include "hooks.def"
};

/* What a hook calls when the driver lacks the symbol: an error, never a jump to NULL. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define CU_HOOK(symbol, base, since, stream, params, args) \
    static CUresult CUDAAPI missing_##symbol params { return CUDA_ERROR_NOT_FOUND; }
#define NVML_HOOK(symbol, params, args) \
    static nvmlReturn_t DECLDIR missing_##symbol params { return NVML_ERROR_FUNCTION_NOT_FOUND; }
#define CU_REAL(symbol, params) \
    static CUresult CUDAAPI missing_##symbol params { return CUDA_ERROR_NOT_FOUND; }
#define NVML_REAL(symbol, params) \
    static nvmlReturn_t DECLDIR missing_##symbol params { return NVML_ERROR_FUNCTION_NOT_FOUND; }
#include "hooks.def"
#pragma GCC diagnostic pop

static void *const missing_table[TESSERA_ID_COUNT] = {
#define CU_HOOK(symbol, base, since, stream, params, args) (void *)missing_##symbol,
#define NVML_HOOK(symbol, params, args) (void *)missing_##symbol,
#define CU_REAL(symbol, params) (void *)missing_##symbol,
#define NVML_REAL(symbol, params) (void *)missing_##symbol,
#include "hooks.def"
};

/* The hooks themselves, by id (NULL for entries that are only called). */
static void *const hook_table[TESSERA_ID_COUNT] = {
#define CU_HOOK(symbol, base, since, stream, params, args) (void *)symbol,
#define NVML_HOOK(symbol, params, args) (void *)symbol,
#define CU_REAL(symbol, params) NULL,
#define NVML_REAL(symbol, params) NULL,
#include "hooks.def"
};

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_ptr;

/*
 * The libc dlsym behind our own.  glibc 2.34+ defines dlsym@@GLIBC_2.34 in
 * libc.so.6 and keeps dlsym@GLIBC_2.2.5 for old binaries; dlvsym() asks for a
 * version explicitly, so it never finds the shim's unversioned dlsym.
 */
static dlsym_fn real_dlsym(void)
{
    dlsym_fn fn = __atomic_load_n(&real_dlsym_ptr, __ATOMIC_ACQUIRE);
    if (TESSERA_LIKELY(fn != NULL))
        return fn;
    fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (fn == NULL)
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&real_dlsym_ptr, fn, __ATOMIC_RELEASE);
    return fn;
}

static void *driver_handle(int nvml)
{
    static void *handles[2];
    void *h = __atomic_load_n(&handles[nvml], __ATOMIC_ACQUIRE);
    if (h != NULL)
        return h;
    const char *lib = nvml ? "libnvidia-ml.so.1" : "libcuda.so.1";
    h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL)
        h = dlopen(lib, RTLD_LAZY);
    if (h == NULL)
        TLOG(TLOG_WARN, "cannot load %s: %s", lib, dlerror());
    __atomic_store_n(&handles[nvml], h, __ATOMIC_RELEASE);
    return h;
}

/*
 * Find the real entry point: the next definition after the shim (programs
 * linked with -lcuda), else the one in libcuda.so.1 / libnvidia-ml.so.1
 * (programs that dlopen the driver, Python ctypes).  Runs once per symbol;
 * races only store the same value twice.
 */
void *tessera_resolve(enum tessera_hook_id id)
{
    int saved = errno;
    dlsym_fn rd = real_dlsym();
    void *fn = NULL;
    if (rd != NULL) {
        fn = rd(RTLD_NEXT, real_names[id]);
        if (fn == NULL) {
            void *h = driver_handle(real_is_nvml[id]);
            if (h != NULL)
                fn = rd(h, real_names[id]);
        }
    }
    if (fn == NULL || fn == hook_table[id]) {
        TLOG(TLOG_INFO, "%s is not in the driver; the hook will return an error", real_names[id]);
        fn = missing_table[id];
    }
    __atomic_store_n(&tessera_real_table[id], fn, __ATOMIC_RELEASE);
    errno = saved;
    return fn;
}

/* --------------------------------------------------------------- dlsym() */

static int hook_id_by_name(const char *name)
{
    if (!((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v')))
        return -1;
    for (int i = 0; i < TESSERA_ID_COUNT; i++)
        if (hook_table[i] != NULL && strcmp(real_names[i], name) == 0)
            return i;
    return -1;
}

/*
 * dlsym(RTLD_NEXT, ...) must search after the *caller*, but forwarding it
 * makes the shim the caller.  Walk the link map from the caller's object and
 * take the first definition that lives in a later object.
 */
static void *dlsym_next(dlsym_fn rd, const char *name, const void *caller)
{
    Dl_info info;
    struct link_map *self = NULL;
    if (caller == NULL || !dladdr1(caller, &info, (void **)&self, RTLD_DL_LINKMAP) || self == NULL)
        return rd(RTLD_NEXT, name);
    for (struct link_map *m = self->l_next; m != NULL; m = m->l_next) {
        if (m->l_name == NULL || m->l_name[0] == '\0')
            continue;
        void *h = dlopen(m->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL)
            continue;
        void *sym = rd(h, name);
        dlclose(h);
        if (sym == NULL)
            continue;
        struct link_map *owner = NULL;
        if (!dladdr1(sym, &info, (void **)&owner, RTLD_DL_LINKMAP) || owner == NULL)
            return sym;
        for (struct link_map *later = self->l_next; later != NULL; later = later->l_next)
            if (later == owner)
                return sym;
    }
    return NULL;
}

TESSERA_EXPORT void *dlsym(void *handle, const char *symbol)
{
    dlsym_fn rd = real_dlsym();
    if (TESSERA_UNLIKELY(rd == NULL))
        return NULL;
    if (handle == RTLD_NEXT)
        return dlsym_next(rd, symbol, __builtin_return_address(0));
    void *found = rd(handle, symbol);
    if (found == NULL)
        return found;
    int id = hook_id_by_name(symbol);
    if (id < 0)
        return found;
    /* The caller's own copy of the driver is the best "real" one we can get. */
    if (found != hook_table[id] && __atomic_load_n(&tessera_real_table[id], __ATOMIC_ACQUIRE) == NULL)
        __atomic_store_n(&tessera_real_table[id], found, __ATOMIC_RELEASE);
    TLOG(TLOG_DEBUG, "dlsym(%s) -> hook", symbol);
    return hook_table[id];
}

/* ------------------------------------------------------ cuGetProcAddress */

enum { STREAM_ANY = 0, STREAM_LEGACY = 1, STREAM_PTDS = 2 };

struct proc_variant {
    const char *base;
    int since;
    int stream;
    enum tessera_hook_id id;
};

static const struct proc_variant variants[] = {
#define CU_HOOK(symbol, base, since, stream, params, args) {#base, since, STREAM_##stream, TESSERA_ID_##symbol},
#include "hooks.def"
};

/*
 * The driver has already chosen the variant the caller asked for (cudaVersion
 * and the per-thread-stream flag); give back our hook for that same variant.
 * First by identity with the exported entry point; if the driver hands out
 * internal addresses instead, by name, choosing the variant the same way the
 * driver does, but only for CUDA versions whose variants this shim knows.
 */
void *tessera_proc_address_substitute(const char *symbol, void *fn, int cuda_version, cuuint64_t flags)
{
    size_t n = sizeof variants / sizeof variants[0];
    for (size_t i = 0; i < n; i++)
        if (tessera_real(variants[i].id) == fn)
            return hook_table[variants[i].id];

    int ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct proc_variant *best = NULL;
    for (size_t i = 0; i < n; i++) {
        const struct proc_variant *v = &variants[i];
        if (strcmp(v->base, symbol) != 0 || v->since > cuda_version)
            continue;
        if (v->stream != STREAM_ANY && v->stream != (ptds ? STREAM_PTDS : STREAM_LEGACY))
            continue;
        if (best == NULL || v->since > best->since)
            best = v;
    }
    if (best == NULL)
        return fn;
    if (cuda_version > CUDA_VERSION) {
        TLOG(TLOG_WARN, "cuGetProcAddress(%s, %d): newer than this shim knows (%d); not limited",
             symbol, cuda_version, CUDA_VERSION);
        return fn;
    }
    TLOG(TLOG_DEBUG, "cuGetProcAddress(%s, %d) -> hook %s by name", symbol, cuda_version,
         real_names[best->id]);
    return hook_table[best->id];
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    tessera_ensure_init();
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS && symbol != NULL && pfn != NULL && *pfn != NULL)
        *pfn = tessera_proc_address_substitute(symbol, *pfn, cudaVersion, flags);
    return r;
}

CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                     CUdriverProcAddressQueryResult *symbolStatus)
{
    tessera_ensure_init();
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS && symbol != NULL && pfn != NULL && *pfn != NULL)
        *pfn = tessera_proc_address_substitute(symbol, *pfn, cudaVersion, flags);
    return r;
}

/* --------------------------------------------------------------- settings */

#define CONFIG_MAX_BYTES 16384
#define CONFIG_MAX_LINES 128

static char config_buf[CONFIG_MAX_BYTES];
static const char *config_keys[CONFIG_MAX_LINES];
static const char *config_vals[CONFIG_MAX_LINES];
static int config_count;

static char *trim(char *s)
{
    while (*s != '\0' && isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

/* TESSERA_CONFIG: KEY=VALUE lines, '#' comments.  Environment wins over the file. */
static void load_config_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        TLOG(TLOG_ERROR, "TESSERA_CONFIG=%s cannot be read (%s); using the environment only", path,
             strerror(errno));
        return;
    }
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, config_buf + len, sizeof config_buf - 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        len += (size_t)r;
        if (len == sizeof config_buf - 1) {
            TLOG(TLOG_ERROR, "TESSERA_CONFIG=%s is larger than %d bytes; the rest is ignored", path,
                 CONFIG_MAX_BYTES - 1);
            break;
        }
    }
    close(fd);
    config_buf[len] = '\0';
    char *save = NULL;
    for (char *line = strtok_r(config_buf, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        line = trim(line);
        if (*line == '\0' || *line == '#')
            continue;
        char *eq = strchr(line, '=');
        if (eq == NULL) {
            TLOG(TLOG_ERROR, "TESSERA_CONFIG=%s: line '%s' is not KEY=VALUE; ignored", path, line);
            continue;
        }
        *eq = '\0';
        if (config_count == CONFIG_MAX_LINES)
            break;
        config_keys[config_count] = trim(line);
        config_vals[config_count] = trim(eq + 1);
        config_count++;
    }
}

static const char *setting(const char *key)
{
    const char *v = getenv(key);
    if (v != NULL)
        return v;
    for (int i = config_count - 1; i >= 0; i--)
        if (strcmp(config_keys[i], key) == 0)
            return config_vals[i];
    return NULL;
}

/* Whole decimal number, surrounding blanks allowed; -1 when it is not one. */
static int parse_u64(const char *s, uint64_t *out)
{
    while (isspace((unsigned char)*s))
        s++;
    if (!isdigit((unsigned char)*s))
        return -1;
    uint64_t v = 0;
    for (; isdigit((unsigned char)*s); s++) {
        if (v > (UINT64_MAX - 9) / 10)
            return -1;
        v = v * 10 + (uint64_t)(*s - '0');
    }
    while (isspace((unsigned char)*s))
        s++;
    if (*s != '\0')
        return -1;
    *out = v;
    return 0;
}

static void read_log_level(void)
{
    const char *v = setting("TESSERA_LOG_LEVEL");
    if (v == NULL || *v == '\0')
        return;
    static const char *const names[] = {"off", "error", "warn", "info", "debug"};
    for (int i = 0; i <= TLOG_DEBUG; i++)
        if (strcasecmp(v, names[i]) == 0 || (v[0] == '0' + i && v[1] == '\0')) {
            tessera_log_level = i;
            return;
        }
    if (strcasecmp(v, "warning") == 0) {
        tessera_log_level = TLOG_WARN;
        return;
    }
    TLOG(TLOG_ERROR, "TESSERA_LOG_LEVEL='%s' is not one of off|error|warn|info|debug or 0-4; using warn", v);
}

/* Memory limits above 2^44 MiB (16 EiB) cannot be represented in bytes. */
#define MAX_LIMIT_MIB (UINT64_MAX >> 20)

/*
 * TESSERA_DEVICE_MEMORY_RESIDENT_<i>: the part of device i's slice held on the card (MiB).  Below
 * the limit it makes the device oversubscribed.  A bad value is a Tessera bug (the node plugin is
 * the only writer and refuses such records): said, and the device is not oversubscribed, the
 * slice held to its limit as without the setting.
 */
static void read_resident(void)
{
    char key[64];
    for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++) {
        uint64_t v, limit = tessera_cfg.mem_limit[i];
        tessera_cfg.mem_resident[i] = limit;
        snprintf(key, sizeof key, "TESSERA_DEVICE_MEMORY_RESIDENT_%u", i);
        const char *s = setting(key);
        if (s == NULL)
            continue;
        if (limit == 0) {
            TLOG(TLOG_WARN, "%s is set but device %u has no memory limit; ignored", key, i);
            continue;
        }
        if (parse_u64(s, &v) != 0 || v == 0 || v > (limit >> 20)) {
            TLOG(TLOG_ERROR, "%s='%s' is not a whole number of MiB from 1 to the limit (%llu); device %u is "
                 "NOT oversubscribed, its slice is held on the card in full", key, s,
                 (unsigned long long)(limit >> 20), i);
            continue;
        }
        tessera_cfg.mem_resident[i] = v << 20;
        if (tessera_cfg.mem_resident[i] < limit)
            tessera_oversub_mask |= 1u << i;
    }
}

static void read_limits(void)
{
    char key[64];
    for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++) {
        uint64_t v;
        snprintf(key, sizeof key, "TESSERA_DEVICE_MEMORY_LIMIT_%u", i);
        const char *s = setting(key);
        if (s != NULL) {
            if (parse_u64(s, &v) != 0 || v > MAX_LIMIT_MIB)
                TLOG(TLOG_ERROR, "%s='%s' is not a whole number of MiB; device %u has NO memory limit "
                     "(fix the value, e.g. %s=4096)", key, s, i, key);
            else
                tessera_cfg.mem_limit[i] = v << 20; /* 0 = no limit */
        }
        snprintf(key, sizeof key, "TESSERA_DEVICE_CORE_LIMIT_%u", i);
        s = setting(key);
        if (s != NULL) {
            if (parse_u64(s, &v) != 0 || v > 100)
                TLOG(TLOG_ERROR, "%s='%s' is not a percentage 0-100; device %u has NO compute limit", key, s, i);
            else if (v > 0 && v < 100)
                tessera_cfg.core_limit[i] = (uint32_t)v; /* 0 and 100 = the whole card */
        }
    }
    read_resident();
    extern char **environ;
    for (char **e = environ; e != NULL && *e != NULL; e++) {
        const char *rest = NULL;
        if (strncmp(*e, "TESSERA_DEVICE_MEMORY_LIMIT_", 28) == 0)
            rest = *e + 28;
        else if (strncmp(*e, "TESSERA_DEVICE_MEMORY_RESIDENT_", 31) == 0)
            rest = *e + 31;
        else if (strncmp(*e, "TESSERA_DEVICE_CORE_LIMIT_", 26) == 0)
            rest = *e + 26;
        if (rest != NULL && (atoi(rest) >= (int)TESSERA_MAX_DEVICES || !isdigit((unsigned char)*rest)))
            TLOG(TLOG_ERROR, "%.*s: only devices 0-%u can be limited; ignored", (int)strcspn(*e, "="), *e,
                 TESSERA_MAX_DEVICES - 1);
    }
    for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++) {
        if (tessera_cfg.mem_limit[i] != 0)
            tessera_mem_on = 1;
        if (tessera_cfg.core_limit[i] != 0)
            tessera_core_mask |= 1u << i;
    }
}

/* HAMi's nvidia.com/priority as the node plugin passes it on: 0 high, 1 low.  Anything else is a
 * Tessera bug (the plugin refuses such records): said, and the container keeps today's
 * behaviour rather than guessing a rank. */
static void read_priority(void)
{
    const char *s = setting("TESSERA_TASK_PRIORITY");
    uint64_t v;
    if (s == NULL)
        return;
    if (parse_u64(s, &v) != 0 || v > 1)
        TLOG(TLOG_ERROR, "TESSERA_TASK_PRIORITY='%s' is not a priority 0-1 (0 = high, 1 = low); this "
             "container takes NO part in priorities", s);
    else
        tessera_task_priority = (int)v;
}

static void atfork_child(void)
{
    tessera_region_after_fork_child();
    tessera_memory_after_fork_child();
    tessera_drivermem_after_fork_child();
    tessera_compute_after_fork_child();
}

static void init_once(void)
{
    int saved = errno;
    const char *cfg = getenv("TESSERA_CONFIG");
    if (cfg != NULL && *cfg != '\0')
        load_config_file(cfg);
    read_log_level();
    read_limits();
    read_priority();
    if (tessera_mem_on || tessera_core_mask != 0 || tessera_task_priority >= 0) {
        const char *path = setting("TESSERA_SHARED_REGION");
        if (path == NULL || *path == '\0')
            TLOG(TLOG_WARN, "TESSERA_SHARED_REGION is not set; memory is counted per process, "
                 "so processes of this container together can exceed the limit");
        tessera_region_setup(path);
        for (unsigned i = 0; i < TESSERA_MAX_DEVICES; i++)
            if (tessera_cfg.mem_limit[i] != 0 || tessera_cfg.core_limit[i] != 0)
                tessera_region_publish_device((int)i, tessera_cfg.mem_limit[i], 0, tessera_cfg.core_limit[i]);
        tessera_devmap_read_env(getenv("CUDA_VISIBLE_DEVICES"));
        tessera_compute_init();
        tessera_priority_init();
        pthread_atfork(NULL, NULL, atfork_child);
    }
    tessera_launch_on = tessera_core_mask != 0 || tessera_task_priority >= 0;
    TLOG(TLOG_INFO, "loaded: memory limits %s, oversubscribed mask 0x%x, compute mask 0x%x, task priority %d, "
         "region %s", tessera_mem_on ? "on" : "off", tessera_oversub_mask, tessera_core_mask, tessera_task_priority,
         tessera_region_shared() ? "shared" : "process-local");
    __atomic_store_n(&tessera_init_done, 1, __ATOMIC_RELEASE);
    errno = saved;
}

static pthread_once_t init_control = PTHREAD_ONCE_INIT;

void tessera_init_slow(void)
{
    pthread_once(&init_control, init_once);
}

__attribute__((constructor)) static void tessera_constructor(void)
{
    tessera_init_slow();
}

__attribute__((destructor)) static void tessera_destructor(void)
{
    if (tessera_mem_on)
        tessera_region_at_exit();
}

/* ----------------------------------------------------------------- cuInit */

static pthread_once_t cards_control = PTHREAD_ONCE_INIT;

/*
 * An oversubscribed device's limit may pass the card (the excess lives in host memory); its
 * resident part may not.  Spilling needs a device that pages managed memory on demand
 * (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS); without it the slice is held to its resident
 * part: refused past it as without oversubscription, and reported as that, so every figure agrees.
 */
static void check_oversubscribed(int i, CUdevice d, uint64_t card)
{
    uint64_t resident = tessera_cfg.mem_resident[i];
    int concurrent = 0;
    if (REAL(cuDeviceGetAttribute)(&concurrent, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, d) != CUDA_SUCCESS)
        concurrent = 0;
    if (resident > card) {
        TLOG(TLOG_ERROR, "TESSERA_DEVICE_MEMORY_RESIDENT_%d=%llu MiB exceeds the card's %llu MiB; using the "
             "card's size", i, (unsigned long long)(resident >> 20), (unsigned long long)(card >> 20));
        resident = card;
        __atomic_store_n(&tessera_cfg.mem_resident[i], resident, __ATOMIC_RELAXED);
    }
    if (!concurrent) {
        TLOG(TLOG_WARN, "device %d has no concurrent managed access, so its slice cannot spill to host memory; "
             "it is held to its resident part, %llu MiB", i, (unsigned long long)(resident >> 20));
        __atomic_store_n(&tessera_cfg.mem_limit[i], resident, __ATOMIC_RELAXED);
        __atomic_and_fetch(&tessera_oversub_mask, ~(1u << i), __ATOMIC_RELAXED);
    }
}

/* Now that the driver is up, hold each limit to the card it is on. */
static void check_cards(void)
{
    int count = 0;
    if (REAL(cuDeviceGetCount)(&count) != CUDA_SUCCESS)
        return;
    for (int i = 0; i < (int)TESSERA_MAX_DEVICES; i++) {
        uint64_t limit = tessera_cfg.mem_limit[i];
        if (limit == 0)
            continue;
        if (i >= count) {
            TLOG(TLOG_WARN, "TESSERA_DEVICE_MEMORY_LIMIT_%d is set but this container sees %d device(s)", i,
                 count);
            continue;
        }
        CUdevice d;
        size_t total = 0;
        if (REAL(cuDeviceGet)(&d, i) != CUDA_SUCCESS || REAL(cuDeviceTotalMem_v2)(&total, d) != CUDA_SUCCESS)
            continue;
        if (tessera_oversubscribed(i))
            check_oversubscribed(i, d, total);
        else if (limit > total) {
            TLOG(TLOG_ERROR, "TESSERA_DEVICE_MEMORY_LIMIT_%d=%llu MiB exceeds the card's %llu MiB; "
                 "using the card's size", i, (unsigned long long)(limit >> 20),
                 (unsigned long long)(total >> 20));
            __atomic_store_n(&tessera_cfg.mem_limit[i], (uint64_t)total, __ATOMIC_RELAXED);
            __atomic_store_n(&tessera_cfg.mem_resident[i], (uint64_t)total, __ATOMIC_RELAXED);
        }
        tessera_region_publish_device(i, tessera_cfg.mem_limit[i], total, tessera_cfg.core_limit[i]);
    }
}

CUresult CUDAAPI cuInit(unsigned int Flags)
{
    tessera_ensure_init();
    CUresult r = REAL(cuInit)(Flags);
    if (r == CUDA_SUCCESS && (tessera_mem_on || tessera_launch_on)) {
        int saved = errno;
        int count = 0;
        if (tessera_task_priority >= 0 && tessera_core_mask == 0 &&
            REAL(cuDeviceGetCount)(&count) == CUDA_SUCCESS && count == 1)
            __atomic_store_n(&tessera_launch_quick, 1, __ATOMIC_RELAXED);
        tessera_devmap_cuda_ready();
        if (tessera_mem_on)
            pthread_once(&cards_control, check_cards);
        errno = saved;
    }
    return r;
}
