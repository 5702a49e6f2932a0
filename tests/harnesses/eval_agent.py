"""A tiny harness for the eval command's test: one chat call, reward 1 if the answer holds input["answer"].

input fields: answer (the number expected), flaky (if true, only even-numbered rollouts of a group may succeed:
``{tag}-g{k}-{i}`` with i even), so that pass@k differs from accuracy.
"""

import json
import os

import httpx

task = json.loads(os.environ["AGL_INPUT"])
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers=headers, timeout=30,
               json={"model": os.environ["AGL_MODEL"], "messages": [{"role": "user", "content": task["question"]}]})
r.raise_for_status()
text = r.json()["choices"][0]["message"]["content"]
ok = str(task["answer"]) in text
if task.get("flaky"):
    ok = ok and int(os.environ["AGL_ROLLOUT_ID"].rsplit("-", 1)[1]) % 2 == 0
httpx.post(os.environ["AGL_REWARD_URL"], json={"value": 1.0 if ok else 0.0}, headers=headers).raise_for_status()
