"""A scripted harness for controller tests: AGL_INPUT says what to do.

input fields: calls (model calls to make), reward (post it, or omit), exit (exit code), sleep (seconds,
after spawning a grandchild that sleeps too), env_out (write the environment there as JSON), mark (append
"rollout attempt pid" to that file at start), reward_after_sleep (post the reward after sleeping, not before; status_out: write the answer's status
code there), kill_self (send this signal to itself after the calls), first_attempt (fields that override
the others on attempt 0 only), kill_parent (SIGKILL the process that started it: with --preload, the
forkserver), on_term (exit with this code on SIGTERM, as harnesses that trap it do), spew (after the calls, print
lines to stdout for ever: a harness in a print loop), unlink_log (first unlink the file its stdout goes to),
interrupt (after the reward, raise KeyboardInterrupt), left_behind ("reward" or "calls": before exiting, leave a
detached process (setsid, double fork) that posts reward 0.123, or makes model calls, until the attempt is over).
"""

import json
import os
import subprocess
import sys
import time

import httpx

task = json.loads(os.environ["AGL_INPUT"])
if task.get("on_term") is not None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(task["on_term"]))
if os.environ["AGL_ATTEMPT_ID"] == "0":
    task.update(task.get("first_attempt", {}))
if task.get("mark"):
    with open(task["mark"], "a") as f:
        f.write(f"{os.environ['AGL_ROLLOUT_ID']} {os.environ['AGL_ATTEMPT_ID']} {os.getpid()}\n")
if task.get("env_out"):
    with open(task["env_out"], "w") as f:
        json.dump(dict(os.environ), f)
    with open(task["env_out"] + ".proc", "wb") as f:  # what a subprocess of the run can read of it
        f.write(open("/proc/self/environ", "rb").read())
if task.get("kill_parent"):
    os.kill(os.getppid(), 9)
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
for _ in range(task.get("calls", 1)):
    r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers=headers, timeout=30,
                   json={"model": os.environ["AGL_MODEL"], "messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()
if task.get("spew"):
    if task.get("unlink_log"):
        try:
            os.unlink(os.readlink("/proc/self/fd/1"))
        except OSError:  # (a pipe since round 20: the log file is the controller's alone)
            pass
    while True:
        print("x" * 1023, flush=True)
if task.get("kill_self"):
    os.kill(os.getpid(), task["kill_self"])
    time.sleep(10)
if task.get("left_behind") and os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for _ in range(400):  # until the attempt is over (409), 20 s at most
            if task["left_behind"] == "reward":
                r = httpx.post(os.environ["AGL_REWARD_URL"], json={"value": 0.123}, headers=headers)
            else:
                r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers=headers, timeout=30,
                               json={"model": os.environ["AGL_MODEL"], "messages": [{"role": "user", "content": "hi"}]})
            if r.status_code == 409:
                break
            time.sleep(0.05)
    os._exit(0)
if "reward" in task and not task.get("reward_after_sleep"):
    httpx.post(os.environ["AGL_REWARD_URL"], json={"value": task["reward"]}, headers=headers).raise_for_status()
if task.get("interrupt"):
    raise KeyboardInterrupt
if task.get("sleep"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(task["pid_out"], "w") as f:
        f.write(str(child.pid))
    time.sleep(task["sleep"])
if "reward" in task and task.get("reward_after_sleep"):
    r = httpx.post(os.environ["AGL_REWARD_URL"], json={"value": task["reward"]}, headers=headers)
    if task.get("status_out"):
        with open(task["status_out"], "w") as f:
            f.write(str(r.status_code))
    r.raise_for_status()
sys.exit(task.get("exit", 0))
