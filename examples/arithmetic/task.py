"""Arithmetic word problems, generated with a fixed seed, in three disjoint splits: train, validation, held-out.

Operands 1..9 with + and − (never a negative answer), 12 wordings. With SmolLM2-135M-Instruct at temperature
1.0 the last number of a one-turn reply is right about 1 time in 10 (``shared/docs/machine-notes.md``), so
GRPO groups of 8 often hold a success to learn from.

The splits share no (wording, a, op, b). Settings (learning rate, budget, group sizes...) are chosen on the
**validation** split; the **held-out** split is only ever evaluated (``heldout_problems``: 256 problems).
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
    ("{name} bakes {a} cookies and then {b} more. How many cookies did {name} bake?", "+"),
    ("A shelf has {a} books. {name} takes {b} books away. How many books are on the shelf?", "-"),
    ("{name} sees {a} cars and then {b} trucks. How many vehicles does {name} see?", "+"),
    ("{name} has {a} balloons and {b} of them pop. How many balloons are left?", "-"),
    ("A class has {a} girls and {b} boys. How many children are in the class?", "+"),
    ("{name} picks {a} flowers and gives {b} to a friend. How many flowers does {name} keep?", "-"),
]
NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia"]
HELDOUT = 256
VALIDATION = 64


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


def split(seed: int = 0, heldout: int = HELDOUT, validation: int = VALIDATION
          ) -> tuple[list[dict], list[dict], list[dict]]:
    """All problems (756) shuffled with ``seed``: ``(train, validation, held-out)``.

    The first ``heldout`` are held out, the next ``validation`` validate, the rest (436) train. The three
    lists share no (template, a, op, b): disjoint by construction.
    """
    problems = _all_problems()
    rng = random.Random(seed)
    rng.shuffle(problems)
    for p in problems:
        name = NAMES[p.pop("name_seed") % len(NAMES)]
        p["question"] = TEMPLATES[p["template"]][0].format(name=name, a=p["a"], b=p["b"])
    return problems[heldout + validation:], problems[heldout: heldout + validation], problems[:heldout]


def train_problems() -> list[dict]:
    return split()[0]


def validation_problems() -> list[dict]:
    return split()[1]


def heldout_problems() -> list[dict]:
    return split()[2]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numbers(text: str) -> list[float]:
    """Every number in ``text``, in order (``"3 + 4 = 7."`` → ``[3.0, 4.0, 7.0]``)."""
    return [float(x) for x in _NUMBER.findall(text or "")]


def final_number(text: str) -> float | None:
    """The last number in ``text``, or None (lenient: "3 + 4 = 7." and "The answer is 7" both give 7)."""
    found = numbers(text)
    return found[-1] if found else None


def reward(task: dict, output: str) -> float:
    """Exact match: 1.0 if the last number of the final answer equals the answer, else 0.0."""
    value = final_number(output)
    return 1.0 if value is not None and value == float(task["answer"]) else 0.0


def is_correct(task: dict, reward: float | None) -> bool:
    """What counts as solved for this task's accuracy (the trainer asks the task, not ``reward > 0.5``)."""
    return reward is not None and reward >= 1.0


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
