/*
 * A process of a container, for tests that need several or that check settings.
 *
 *   t_proc hold MIB READYFILE     allocate, create READYFILE, then wait to be killed
 *   t_proc alloc MIB ok|oom       allocate once and check the answer
 *   t_proc report TOTAL_MIB FREE_MIB
 *                                 check cuMemGetInfo_v2 and cuDeviceTotalMem_v2
 *   t_proc churn READYFILE        allocate and free 16 MiB blocks from 4 threads until killed
 *   t_proc execself MIB           allocate, then exec "t_proc alloc 1024 ok" in the same process
 *   t_proc dlnext                 dlsym(RTLD_NEXT, ...) still means "after the caller"
 */
#include "tcommon.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

static void *churn(void *arg)
{
    (void)arg;
    CUdeviceptr p[8];
    for (unsigned i = 0;; i++) {
        int n = 0;
        for (int k = 0; k < 8; k++)
            if (cuMemAlloc_v2(&p[n], 16 * MiB) == CUDA_SUCCESS)
                n++;
        for (int k = 0; k < n; k++)
            CHECK_CU(cuMemFree_v2(p[k]));
    }
    return NULL;
}

static void touch(const char *path)
{
    int fd = open(path, O_CREAT | O_WRONLY, 0644);
    CHECK(fd >= 0, "cannot create %s", path);
    close(fd);
}

int main(int argc, char **argv)
{
    alarm(120); /* a holder the runner lost track of must not live on */
    CHECK(argc >= 2, "usage: %s hold|alloc|report ...", argv[0]);
    CHECK_CU(cuInit(0));
    if (strcmp(argv[1], "hold") == 0 && argc == 4) {
        CUdeviceptr p;
        CHECK_CU(cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 10) * MiB));
        touch(argv[3]);
        for (;;)
            pause();
    }
    if (strcmp(argv[1], "alloc") == 0 && argc == 4) {
        CUdeviceptr p;
        CUresult r = cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 10) * MiB);
        if (strcmp(argv[3], "ok") == 0)
            CHECK(r == CUDA_SUCCESS, "allocation of %s MiB refused (%d)", argv[2], (int)r);
        else
            CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "allocation of %s MiB returned %d, want out of memory", argv[2],
                  (int)r);
        return 0;
    }
    if (strcmp(argv[1], "report") == 0 && argc == 4) {
        size_t f = 0, t = 0, dt = 0;
        unsigned long long want_t = strtoull(argv[2], NULL, 10) * MiB, want_f = strtoull(argv[3], NULL, 10) * MiB;
        CHECK_CU(cuMemGetInfo_v2(&f, &t));
        CHECK_CU(cuDeviceTotalMem_v2(&dt, 0));
        CHECK(t == want_t && dt == want_t, "total %zu / %zu MiB, want %s", t >> 20, dt >> 20, argv[2]);
        CHECK(f == want_f, "free %zu MiB, want %s", f >> 20, argv[3]);
        return 0;
    }
    if (strcmp(argv[1], "churn") == 0 && argc == 3) {
        pthread_t t[4];
        for (int i = 0; i < 4; i++)
            CHECK(pthread_create(&t[i], NULL, churn, NULL) == 0, "pthread_create");
        touch(argv[2]);
        for (;;)
            pause();
    }
    if (strcmp(argv[1], "execself") == 0 && argc == 3) {
        CUdeviceptr p;
        CHECK_CU(cuMemAlloc_v2(&p, strtoull(argv[2], NULL, 10) * MiB));
        execl("/proc/self/exe", argv[0], "alloc", "1024", "ok", (char *)NULL);
        CHECK(0, "exec failed");
    }
    if (strcmp(argv[1], "dlnext") == 0) {
        void *next = dlsym(RTLD_NEXT, "malloc"), *dflt = dlsym(RTLD_DEFAULT, "malloc");
        CHECK(next != NULL && next == dflt, "RTLD_NEXT malloc %p, RTLD_DEFAULT malloc %p", next, dflt);
        CHECK(dlsym(RTLD_NEXT, "no_such_symbol_anywhere") == NULL, "found a symbol that does not exist");
        return 0;
    }
    CHECK(0, "bad arguments");
}
