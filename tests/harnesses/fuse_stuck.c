// Harness (round 20, tests/test_hostile20.py): leaves a process that SIGKILL cannot end. In a user+mount namespace of its own (unprivileged), it mounts a
// FUSE filesystem (/dev/fuse is 0666 here), answers INIT, then one thread looks a name up and another thread of the
// same process reads that request and never answers: the looking-up thread waits uninterruptibly (the request is
// "in userspace"), and the /dev/fuse descriptor that would abort the connection is closed only when every thread of
// the process has exited. The run itself exits 0 after a second.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>
static int fd;
static char buf[1 << 20];
static void wr(const char *p, const char *s) { int f = open(p, O_WRONLY); if (f >= 0) { write(f, s, strlen(s)); close(f); } }
static void *server(void *_) {
  ssize_t n = read(fd, buf, sizeof buf);  // FUSE_INIT
  struct fuse_in_header *in = (void *)buf; struct fuse_init_in *ii = (void *)(in + 1);
  struct { struct fuse_out_header h; struct fuse_init_out o; } r = {0};
  r.h.len = sizeof r; r.h.unique = in->unique; r.o.major = 7; r.o.minor = ii->minor; r.o.max_write = 4096;
  r.o.max_readahead = ii->max_readahead; r.o.time_gran = 1;
  if (write(fd, &r, sizeof r) < 0) perror("init reply");
  n = read(fd, buf, sizeof buf);  // the lookup: now "in userspace", never answered
  fprintf(stderr, "server: got opcode %u, not answering\n", ((struct fuse_in_header *)buf)->opcode);
  for (;;) pause();
}
static void *client(void *_) { struct stat st; stat("/mnt/x", &st); return 0; }
int main(void) {
  pid_t p = fork();
  if (p) { sleep(1); printf("harness %d exits; stuck child %d\n", getpid(), p); return 0; }
  setsid();
  char m[64]; uid_t u = getuid(); gid_t g = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) { perror("unshare"); return 1; }
  wr("/proc/self/setgroups", "deny");
  snprintf(m, sizeof m, "0 %d 1", u); wr("/proc/self/uid_map", m);
  snprintf(m, sizeof m, "0 %d 1", g); wr("/proc/self/gid_map", m);
  mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL);
  fd = open("/dev/fuse", O_RDWR);
  if (fd < 0) { perror("/dev/fuse"); return 1; }
  snprintf(m, sizeof m, "fd=%d,rootmode=40000,user_id=0,group_id=0", fd);
  if (mount("agl", "/mnt", "fuse", MS_NOSUID | MS_NODEV, m)) { perror("mount fuse"); return 1; }
  pthread_t a, b;
  pthread_create(&a, 0, server, 0);
  usleep(200000);
  pthread_create(&b, 0, client, 0);
  for (;;) pause();
}
