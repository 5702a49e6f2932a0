"""A one-call harness for the verl CPU test: ask the model, post a reward that differs within each group.

The reward is the parity of the rollout's index in its group (``AGL_ROLLOUT_ID`` ends in ``-{i}``), so every
group of 2+ has a reward signal whatever the tiny model answers; the test checks the training mechanics,
not learning.
"""

import json
import os

import httpx

task = json.loads(os.environ["AGL_INPUT"])
headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers=headers, timeout=120,
               json={"model": os.environ["AGL_MODEL"], "messages": [{"role": "user", "content": task["question"]}],
                     "max_tokens": task.get("max_tokens", 8), "temperature": 1.0})
r.raise_for_status()
index = int(os.environ["AGL_ROLLOUT_ID"].rsplit("-", 1)[1])
httpx.post(os.environ["AGL_REWARD_URL"], json={"value": float(index % 2)}, headers=headers).raise_for_status()
