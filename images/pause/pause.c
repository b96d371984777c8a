/*
 * The pod sandbox's pause process: holds the pod's namespaces open, reaps the zombies of a
 * shared PID namespace, and exits on SIGINT/SIGTERM. Built static, so its image needs nothing
 * else (the real node's containerd has no registry to pull registry.k8s.io/pause from).
 */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig)
{
    (void)sig;
    _exit(0);
}

static void reap(int sig)
{
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
}

int main(void)
{
    struct sigaction quit = {.sa_handler = stop};
    struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &quit, NULL) != 0 || sigaction(SIGTERM, &quit, NULL) != 0 ||
        sigaction(SIGCHLD, &child, NULL) != 0)
        return 1;
    for (;;)
        pause();
}
