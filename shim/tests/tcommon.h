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

/* Run `call`, expecting a refusal that never reached the driver. */
#define EXPECT_REFUSED(call)                                                                    \
    do {                                                                                        \
        struct fake_cuda_stats s0_ = fake_stats();                                              \
        CUresult r_ = (call);                                                                   \
        struct fake_cuda_stats s1_ = fake_stats();                                              \
        CHECK(r_ == CUDA_ERROR_OUT_OF_MEMORY, "%s returned %d, want out of memory", #call, (int)r_); \
        CHECK(s1_.alloc_calls == s0_.alloc_calls, "%s reached the driver", #call);              \
    } while (0)

/* A symbol of the fake driver's own (looked up in libcuda.so.1 itself: dlopen'd copies are not global). */
static inline void *fake_cuda_symbol(const char *name)
{
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    CHECK(h != NULL, "libcuda.so.1 is not loaded");
    void *fn = dlsym(h, name);
    CHECK(fn != NULL, "the loaded libcuda.so.1 is not the fake (no %s)", name);
    return fn;
}

/* The fake driver's counters. */
static inline struct fake_cuda_stats fake_stats(void)
{
    static fake_cuda_stats_fn fn;
    if (fn == NULL)
        fn = (fake_cuda_stats_fn)fake_cuda_symbol("fake_cuda_stats");
    struct fake_cuda_stats s;
    fn(&s);
    return s;
}

/* main() of a program of cases run with a 1024 MiB limit: check the limit, cuInit, run the case named. */
struct test_case {
    const char *name;
    void (*fn)(void);
};

static inline int run_case(int argc, char **argv, const struct test_case *cases, size_t n, unsigned long long *limit)
{
    CHECK(argc == 2, "usage: %s CASE", argv[0]);
    *limit = env_mib("TESSERA_DEVICE_MEMORY_LIMIT_0", 0) * MiB;
    CHECK(*limit == 1024 * MiB, "run with TESSERA_DEVICE_MEMORY_LIMIT_0=1024");
    CHECK_CU(cuInit(0));
    for (size_t i = 0; i < n; i++)
        if (strcmp(argv[1], cases[i].name) == 0) {
            cases[i].fn();
            return 0;
        }
    CHECK(0, "unknown case %s", argv[1]);
    return 1;
}

#endif
