/*
 * Process start-up with and without the shim preloaded: a trivial program
 * spawned one at a time (median of RUNS), and 32 spawned at once (median of
 * BURSTS totals, from the first spawn to the last exit).
 *
 *   bench_start NOP SHIM REGION
 * Output: "start_plain_us", "start_shim_us", "burst32_plain_ms", "burst32_shim_ms".
 */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#define RUNS 101
#define BURSTS 11
#define BURST 32

extern char **environ;

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[n / 2];
}

static void spawn(const char *prog, char **envp, pid_t *pid)
{
    char *argv[] = {(char *)prog, NULL};
    if (posix_spawn(pid, prog, NULL, NULL, argv, envp) != 0) {
        perror("posix_spawn");
        exit(1);
    }
}

static void reap(pid_t pid)
{
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "child failed\n");
        exit(1);
    }
}

/* Plain and shim runs alternate, so a change in machine load hits both alike. */
static void measure(const char *prog, char **envs[2], double single_us[2], double burst_ms[2])
{
    double v[2][RUNS], b[2][BURSTS];
    pid_t pids[BURST];
    for (int i = 0; i < 5; i++) /* warm the page cache */
        for (int m = 0; m < 2; m++) {
            spawn(prog, envs[m], &pids[0]);
            reap(pids[0]);
        }
    for (int i = 0; i < RUNS; i++)
        for (int m = 0; m < 2; m++) {
            double t0 = now_us();
            spawn(prog, envs[m], &pids[0]);
            reap(pids[0]);
            v[m][i] = now_us() - t0;
        }
    for (int i = 0; i < BURSTS; i++)
        for (int m = 0; m < 2; m++) {
            double t0 = now_us();
            for (int k = 0; k < BURST; k++)
                spawn(prog, envs[m], &pids[k]);
            for (int k = 0; k < BURST; k++)
                reap(pids[k]);
            b[m][i] = (now_us() - t0) / 1e3;
        }
    for (int m = 0; m < 2; m++) {
        single_us[m] = median(v[m], RUNS);
        burst_ms[m] = median(b[m], BURSTS);
    }
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s NOP SHIM REGION\n", argv[0]);
        return 2;
    }
    size_t n = 0;
    while (environ[n])
        n++;
    char **shim_env = calloc(n + 4, sizeof *shim_env);
    char preload[4096], region[4096];
    snprintf(preload, sizeof preload, "LD_PRELOAD=%s", argv[2]);
    snprintf(region, sizeof region, "TESSERA_SHARED_REGION=%s", argv[3]);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0 && strncmp(environ[i], "TESSERA_", 8) != 0)
            shim_env[k++] = environ[i];
    char **plain_env = calloc(k + 1, sizeof *plain_env);
    memcpy(plain_env, shim_env, k * sizeof *plain_env);
    shim_env[k++] = preload;
    shim_env[k++] = region;
    shim_env[k++] = "TESSERA_DEVICE_MEMORY_LIMIT_0=1024";
    double s[2], b[2];
    char **envs[2] = {plain_env, shim_env};
    measure(argv[1], envs, s, b);
    printf("start_plain_us %.1f\nstart_shim_us %.1f\nburst32_plain_ms %.2f\nburst32_shim_ms %.2f\n", s[0], s[1], b[0],
           b[1]);
    return 0;
}
