/* Shared by the shim's C test programs: checks, and a look inside the fake driver. */
#ifndef TESSERA_TCOMMON_H
#define TESSERA_TCOMMON_H

#include <cuda.h>
#undef cuGetProcAddress

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake/fake.h"

#define MiB (1ull << 20)

#define CHECK(cond, ...)                                                            \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);         \
            fprintf(stderr, __VA_ARGS__);                                           \
            fputc('\n', stderr);                                                    \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define CHECK_CU(call) CHECK((call) == CUDA_SUCCESS, "%s failed", #call)

static inline unsigned long long env_mib(const char *name, unsigned long long dflt)
{
    const char *s = getenv(name);
    return (s && *s) ? strtoull(s, NULL, 10) : dflt;
}

/* The fake driver's counters (looked up in libcuda.so.1 itself: dlopen'd copies are not global). */
static inline struct fake_cuda_stats fake_stats(void)
{
    static fake_cuda_stats_fn fn;
    if (fn == NULL) {
        void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        CHECK(h != NULL, "libcuda.so.1 is not loaded");
        fn = (fake_cuda_stats_fn)dlsym(h, "fake_cuda_stats");
        CHECK(fn != NULL, "the loaded libcuda.so.1 is not the fake");
    }
    struct fake_cuda_stats s;
    fn(&s);
    return s;
}

#endif
