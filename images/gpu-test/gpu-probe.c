/*
 * What a GPU container sees, printed as one JSON line on stdout, then (with --sleep) it waits
 * for SIGTERM so the pod stays Running.
 *
 *   gpu-probe --inside=MIB --beyond=MIB [--spill=MIB] [--card-mib=MIB] [--sleep]
 *
 * It reports the environment the node plugin's CDI spec gave it, the /dev/nvidia* nodes in
 * the container, /etc/ld.so.preload and whether libtessera.so is mapped into this process,
 * then opens libcuda.so.1 the way the CUDA runtime does (dlopen + dlsym, so the preloaded shim
 * interposes), makes device 0's primary context current and tries two allocations on it: one
 * of --inside MiB, which a slice of more than that must allow, and one of --beyond MiB, which a
 * smaller slice must refuse with CUDA_ERROR_OUT_OF_MEMORY (2).  With --spill, a third of that
 * many MiB while the first is still held: on an oversubscribed slice (virtual device memory)
 * one that takes the container past its resident part, which the shim serves as managed memory.
 * For the first and the third it says which driver call served them ("alloc": cuMemAlloc_v2,
 * "managed": cuMemAllocManaged), as the fake driver records it.
 *
 * The image's libcuda.so.1 is the project's fake driver (shim/tests/fake/fake_cuda.c), which
 * has no hardware to look at: the probe tells it which cards the container was given (the
 * entries of CUDA_VISIBLE_DEVICES, their number and UUIDs) and their size, as a real driver
 * would find them.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

static void json_string(const char *s)
{
    putchar('"');
    for (; s != NULL && *s != '\0'; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static int cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void print_devices(void)
{
    char *names[256];
    int n = 0;
    DIR *dir = opendir("/dev");
    struct dirent *entry;
    while (dir != NULL && (entry = readdir(dir)) != NULL && n < 256)
        if (strncmp(entry->d_name, "nvidia", 6) == 0)
            names[n++] = strdup(entry->d_name);
    if (dir != NULL)
        closedir(dir);
    qsort(names, (size_t)n, sizeof(names[0]), cmp);
    printf("\"devices\":[");
    for (int i = 0; i < n; i++) {
        printf(i ? "," : "");
        json_string(names[i]);
        free(names[i]);
    }
    printf("]");
}

static void print_file(const char *key, const char *path)
{
    char buf[4096] = "";
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        size_t got = fread(buf, 1, sizeof(buf) - 1, f);
        buf[got] = '\0';
        fclose(f);
    }
    printf("\"%s\":", key);
    if (f == NULL)
        printf("null");
    else
        json_string(buf);
}

static int shim_mapped(void)
{
    char line[4096];
    int found = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (strstr(line, "libtessera.so") != NULL)
            found = 1;
    if (f != NULL)
        fclose(f);
    return found;
}

static long arg_mib(int argc, char **argv, const char *name, long fallback)
{
    size_t len = strlen(name);
    for (int i = 1; i < argc; i++)
        if (strncmp(argv[i], name, len) == 0 && argv[i][len] == '=')
            return strtol(argv[i] + len + 1, NULL, 10);
    return fallback;
}

static int has_flag(int argc, char **argv, const char *name)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return 1;
    return 0;
}

typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*count_fn)(int *);
typedef CUresult (*get_fn)(CUdevice *, int);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*current_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef int (*via_fn)(unsigned long long);

/* The driver call that served ptr, as the fake driver records it (its enum fake_via). */
static const char *served_by(via_fn via, CUresult rc, CUdeviceptr ptr)
{
    static const char *const names[] = {"none", "alloc", "managed", "pitch", "other"};
    if (via == NULL || rc != CUDA_SUCCESS)
        return NULL;
    int v = via((unsigned long long)ptr);
    return v >= 0 && v <= 4 ? names[v] : "unknown";
}

static void print_served(const char *key, const char *name)
{
    printf(",\"%s\":", key);
    if (name == NULL)
        printf("null");
    else
        json_string(name);
}

int main(int argc, char **argv)
{
    long inside = arg_mib(argc, argv, "--inside", 0);
    long beyond = arg_mib(argc, argv, "--beyond", 0);
    long spill = arg_mib(argc, argv, "--spill", 0);
    long card = arg_mib(argc, argv, "--card-mib", 81920);
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    int cards = 0;
    char number[32];

    for (const char *p = visible; p != NULL && *p != '\0'; p++)
        cards += (p == visible || p[-1] == ',') && *p != ',';
    snprintf(number, sizeof(number), "%d", cards > 0 ? cards : 1);
    setenv("FAKE_CUDA_DEVICES", number, 1);
    if (visible != NULL && strncmp(visible, "GPU-", 4) == 0)
        setenv("FAKE_GPU_UUIDS", visible, 1);
    snprintf(number, sizeof(number), "%ld", card);
    setenv("FAKE_CUDA_MEM_MIB", number, 1);

    printf("{\"hostname\":");
    {
        char host[256] = "";
        gethostname(host, sizeof(host) - 1);
        json_string(host);
    }
    printf(",\"env\":{");
    int first = 1;
    for (char **e = environ; *e != NULL; e++) {
        if (strncmp(*e, "TESSERA_", 8) != 0 && strncmp(*e, "CUDA_", 5) != 0 &&
            strncmp(*e, "NVIDIA_", 7) != 0 && strncmp(*e, "LD_", 3) != 0)
            continue;
        char *eq = strchr(*e, '=');
        if (eq == NULL)
            continue;
        *eq = '\0';
        printf(first ? "" : ",");
        first = 0;
        json_string(*e);
        putchar(':');
        json_string(eq + 1);
        *eq = '=';
    }
    printf("},");
    print_devices();
    printf(",");
    print_file("preload", "/etc/ld.so.preload");
    printf(",\"shim_mapped\":%s", shim_mapped() ? "true" : "false");

    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) {
        printf(",\"error\":");
        json_string(dlerror());
        printf("}\n");
        return 1;
    }
    init_fn cu_init = (init_fn)dlsym(cuda, "cuInit");
    count_fn cu_count = (count_fn)dlsym(cuda, "cuDeviceGetCount");
    get_fn cu_get = (get_fn)dlsym(cuda, "cuDeviceGet");
    retain_fn cu_retain = (retain_fn)dlsym(cuda, "cuDevicePrimaryCtxRetain");
    current_fn cu_current = (current_fn)dlsym(cuda, "cuCtxSetCurrent");
    alloc_fn cu_alloc = (alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
    free_fn cu_free = (free_fn)dlsym(cuda, "cuMemFree_v2");
    info_fn cu_info = (info_fn)dlsym(cuda, "cuMemGetInfo_v2");
    via_fn via = (via_fn)dlsym(cuda, "fake_cuda_alloc_via"); /* the fake's own, never hooked */
    if (!cu_init || !cu_count || !cu_get || !cu_retain || !cu_current || !cu_alloc || !cu_free || !cu_info) {
        printf(",\"error\":\"libcuda.so.1 lacks a driver entry point\"}\n");
        return 1;
    }
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    int count = 0;
    size_t free_b = 0, total_b = 0;
    CUresult init = cu_init(0);
    cu_count(&count);
    CUresult ctx_rc = cu_get(&dev, 0);
    if (ctx_rc == CUDA_SUCCESS)
        ctx_rc = cu_retain(&ctx, dev);
    if (ctx_rc == CUDA_SUCCESS)
        ctx_rc = cu_current(ctx);
    cu_info(&free_b, &total_b);
    CUdeviceptr a = 0, b = 0, c = 0;
    CUresult in_rc = cu_alloc(&a, (size_t)inside << 20);
    CUresult out_rc = cu_alloc(&b, (size_t)beyond << 20);
    CUresult spill_rc = spill > 0 ? cu_alloc(&c, (size_t)spill << 20) : CUDA_ERROR_INVALID_VALUE;
    const char *in_via = served_by(via, in_rc, a), *spill_via = served_by(via, spill_rc, c);
    if (in_rc == CUDA_SUCCESS)
        cu_free(a);
    if (out_rc == CUDA_SUCCESS)
        cu_free(b);
    if (spill > 0 && spill_rc == CUDA_SUCCESS)
        cu_free(c);
    printf(",\"cuInit\":%d,\"device_count\":%d,\"context\":%d,\"total_mib\":%zu,"
           "\"inside_mib\":%ld,\"inside\":%d,\"beyond_mib\":%ld,\"beyond\":%d",
           (int)init, count, (int)ctx_rc, total_b >> 20, inside, (int)in_rc, beyond, (int)out_rc);
    print_served("inside_via", in_via);
    if (spill > 0) {
        printf(",\"spill_mib\":%ld,\"spill\":%d", spill, (int)spill_rc);
        print_served("spill_via", spill_via);
    }
    printf("}\n");
    fflush(stdout);
    if (has_flag(argc, argv, "--sleep")) {
        sigset_t set;
        int sig;
        sigemptyset(&set);
        sigaddset(&set, SIGTERM);
        sigaddset(&set, SIGINT);
        sigprocmask(SIG_BLOCK, &set, NULL);
        sigwait(&set, &sig);
    }
    return 0;
}
