/* A harness's process that never stays (round 20, tests/test_hostile20.py): it forks a successor and exits,
   without pause, for ever; its stdout is held by every member, so its end is seen as the pipe's. */
#include <unistd.h>
#include <stdlib.h>
int main(){ for(;;){ pid_t p=fork(); if(p<0) continue; if(p>0) _exit(0); } }
