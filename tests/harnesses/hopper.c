/* A harness's process that never stays (round 20, tests/test_hostile20.py): each of LINEAGES lineages forks a
   successor and exits, over and over, until SECONDS have passed: a new pid every ~100 us. */
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/types.h>
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    struct timespec now; clock_gettime(CLOCK_MONOTONIC, &now);
    time_t end = now.tv_sec + atoi(argv[2]);
    for (int i = 0; i < n; i++) if (fork() == 0) break;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec >= end) _exit(0);
        pid_t p = fork();
        if (p > 0) _exit(0);
        if (p < 0) usleep(1000);
    }
}
