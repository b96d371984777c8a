/*
 * A container's busy process for the task priority tests: launches kernels on device 0 flat
 * out (paced by the fake card's queue, FAKE_GPU_QUEUE) until killed, and keeps the number
 * launched so far in PROGRESS_FILE (8 bytes, native order), so a test sees its progress
 * without asking the shim.
 *
 *   t_launch PROGRESS_FILE
 */
#include "tcommon.h"

#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    CHECK(argc == 2, "usage: %s PROGRESS_FILE", argv[0]);
    int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
    CHECK(fd >= 0 && ftruncate(fd, sizeof(uint64_t)) == 0, "%s: %s", argv[1], strerror(errno));
    uint64_t *done = mmap(NULL, sizeof *done, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(done != MAP_FAILED, "mmap: %s", strerror(errno));
    close(fd);
    CUcontext c;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&c, 0));
    CHECK_CU(cuCtxSetCurrent(c));
    for (;;) {
        CHECK_CU(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        __atomic_add_fetch(done, 1, __ATOMIC_RELAXED);
    }
}
