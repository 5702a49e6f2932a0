"""A scripted harness for controller tests: AGL_INPUT says what to do.

input fields: calls (model calls to make), reward (post it, or omit), exit (exit code), sleep (seconds,
after spawning a grandchild that sleeps too), env_out (write the environment there as JSON).
"""

import json
import os
import subprocess
import sys
import time

import httpx

task = json.loads(os.environ["AGL_INPUT"])
if task.get("env_out"):
    with open(task["env_out"], "w") as f:
        json.dump(dict(os.environ), f)
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
for _ in range(task.get("calls", 1)):
    r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers=headers, timeout=30,
                   json={"model": os.environ["AGL_MODEL"], "messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()
if "reward" in task:
    httpx.post(os.environ["AGL_REWARD_URL"], json={"value": task["reward"]}, headers=headers).raise_for_status()
if task.get("sleep"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(task["pid_out"], "w") as f:
        f.write(str(child.pid))
    time.sleep(task["sleep"])
sys.exit(task.get("exit", 0))
