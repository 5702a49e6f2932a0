"""Arithmetic word problems, generated with a fixed seed, with disjoint train and held-out splits.

Operands 1..9 with + and − (never a negative answer): SmolLM2-135M-Instruct gets the final number right
about 1 time in 6 at temperature 1.0 (shared/docs/machine-notes.md), so GRPO groups of 8 usually hold a
success to learn from.
"""

from __future__ import annotations

import random
import re

TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("{name} has {a} apples and gives away {b}. How many apples does {name} have left?", "-"),
    ("A box holds {a} pens. {name} puts in {b} more pens. How many pens are in the box?", "+"),
    ("There are {a} birds on a tree. {b} birds fly away. How many birds are left on the tree?", "-"),
    ("{name} reads {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read?", "+"),
    ("{name} had {a} coins and spent {b}. How many coins does {name} have now?", "-"),
]
NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia"]


def _all_problems() -> list[dict]:
    out = []
    for t, (text, op) in enumerate(TEMPLATES):
        for a in range(1, 10):
            for b in range(1, 10):
                if op == "-" and b > a:
                    continue
                answer = a + b if op == "+" else a - b
                out.append({"id": f"t{t}-{a}{op}{b}", "template": t, "a": a, "b": b, "op": op,
                            "answer": answer, "name_seed": a * 10 + b})
    return out


def split(seed: int = 0, heldout: int = 64) -> tuple[list[dict], list[dict]]:
    """All problems shuffled with ``seed``; the first ``heldout`` are held out, the rest train.

    The two lists share no (template, a, op, b): disjoint by construction.
    """
    problems = _all_problems()
    rng = random.Random(seed)
    rng.shuffle(problems)
    for p in problems:
        name = NAMES[p.pop("name_seed") % len(NAMES)]
        p["question"] = TEMPLATES[p["template"]][0].format(name=name, a=p["a"], b=p["b"])
    return problems[heldout:], problems[:heldout]


def train_problems() -> list[dict]:
    return split()[0]


def heldout_problems() -> list[dict]:
    return split()[1]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in ``text`` (what the self-check turn is asked to reply with), or None."""
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


def reward(task: dict, output: str) -> float:
    """Exact match: 1.0 if the last number of the final answer equals the answer, else 0.0."""
    value = final_number(output)
    return 1.0 if value is not None and value == float(task["answer"]) else 0.0


def report(task: dict, answer: str) -> float:
    """The evaluator's last step: score ``answer``, print it, and post the reward to AGL_REWARD_URL.

    The run's key (OPENAI_API_KEY, rollout-scoped under AGL) authorizes the post. Raises
    ``httpx.HTTPStatusError`` if the gateway refuses it (e.g. 409 for a fenced, stale attempt).
    """
    import json
    import os

    import httpx

    value = reward(task, answer)
    print(json.dumps({"question": task["question"], "answer": answer, "reward": value}))
    if os.environ.get("AGL_REWARD_URL"):
        resp = httpx.post(os.environ["AGL_REWARD_URL"], json={"value": value},
                          headers={"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"}, timeout=30)
        resp.raise_for_status()
    return value
