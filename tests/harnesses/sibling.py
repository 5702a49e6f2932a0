"""tests/harnesses/sibling.sh for --preload (forked: it imports nothing the forkserver does not hold, as the other
user may not reach this machine's Python)."""
import os
import time

d = os.environ["PROBE_DIR"]
me = os.environ["AGL_ROLLOUT_ID"]
with open(f"{d}/{me}.uid", "w") as f:
    f.write(str(os.getuid()))
with open(f"{d}/{me}.pid", "w") as f:
    f.write(str(os.getpid()))
if os.fork() == 0:  # a child that quits the run's process group
    os.setsid()
    os.execv("/bin/sleep", ["sleep", "300"])
if not os.environ.get("ALONE"):
    other = None
    for _ in range(100):
        others = [n for n in os.listdir(d) if n.endswith(".pid") and n != f"{me}.pid"]
        if others:
            other = others[0]
            break
        time.sleep(0.05)
    with open(f"{d}/{other}") as f:
        pid = int(f.read())
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            f.read(1)
        reached = True
    except OSError:
        try:
            os.kill(pid, 0)
            reached = True
        except OSError:
            reached = False
    with open(f"{d}/{me}.sibling", "w") as f:
        f.write("reached" if reached else "unreadable")
    time.sleep(1.5)
