/* A process a harness leaves behind (round 20, tests/test_hostile20.py): in two threads, it sends SIGSTOP to every
   process its user may signal, without pause; it stopped the controller's child that ended the user's processes
   while that child had the user's uid as its real one. */
#include <pthread.h>
#include <signal.h>
#include <unistd.h>
static void *loop(void *unused) { for (;;) kill(-1, SIGSTOP); return unused; }
int main(void) {
    if (fork()) return 0;
    setsid();
    pthread_t t;
    pthread_create(&t, 0, loop, 0);
    loop(0);
}
