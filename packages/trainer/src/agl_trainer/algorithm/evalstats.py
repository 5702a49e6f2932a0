"""Held-out evaluation statistics: accuracy, pass@k and the reward distribution of finished rollouts.

Pure functions over :class:`~agl_common.schemas.Rollout` lists; :func:`agl_trainer.scheduler.evaluate` (the
training run's before/after evaluations and ``agl-trainer eval``) reports through :func:`eval_stats`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable

from agl_common.schemas import Rollout, RolloutStatus

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k for one problem from ``n`` samples of which ``c`` are correct:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1).

    Raises ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


IsCorrect = Callable[[dict, "float | None"], bool]


def correct(r: Rollout, is_correct: IsCorrect) -> bool:
    """Succeeded, and solved as the task's ``is_correct(input, reward)`` says; a failed rollout never is
    (even one that posted a reward before it failed)."""
    return r.status == RolloutStatus.succeeded and bool(is_correct(r.input, r.reward))


def accuracy(rollouts: list[Rollout], is_correct: IsCorrect) -> float:
    """The one definition of accuracy (evaluations and training steps): :func:`correct` rollouts / all
    rollouts, a failed one counted wrong; 0.0 for none."""
    return sum(correct(r, is_correct) for r in rollouts) / len(rollouts) if rollouts else 0.0


def outcome_reward(r: Rollout) -> float | None:
    """The reward that is a rollout's outcome: its reward if it succeeded, else ``None`` (an infrastructure
    failure is never a reward of 0, and a reward posted by a rollout that then failed is not its outcome). The one
    definition for the mean reward, training and ``rollouts export --min-reward``."""
    return r.reward if r.status == RolloutStatus.succeeded else None


def reward_mean(rollouts: list[Rollout]) -> float:
    """The one definition of the mean reward (evaluations and training steps): the mean
    :func:`outcome_reward` over the rollouts that have one; 0.0 for none."""
    got = [reward for r in rollouts if (reward := outcome_reward(r)) is not None]
    return sum(got) / len(got) if got else 0.0


def eval_stats(rollouts: list[Rollout], is_correct: IsCorrect) -> dict:
    """Statistics of an evaluation: rollouts grouped by ``group_id`` (one group per problem).

    ``is_correct(input, reward) -> bool``: the task's notion of solved (:func:`agl_trainer.tasks.load_is_correct`).
    Returns a JSON-ready dict:
        ``accuracy``: :func:`accuracy`; ``correct``: 0/1 per rollout, in input order; ``reward_mean``:
        :func:`reward_mean` (over succeeded rollouts); ``n``: rollouts; ``failed``;
        ``problems``; ``samples_per_problem`` (the smallest group's size);
        ``pass_at_k``: ``{"1": ..., "2": ..., "4": ..., ..., str(samples_per_problem): ...}``, the mean over
        problems of :func:`pass_at_k` (k up to the smallest group's size);
        ``reward``: ``mean`` (= ``reward_mean``), ``std`` (population), ``min``, ``p25``, ``median``, ``p75``,
        ``max`` over the :func:`outcome_reward` values (succeeded rollouts' rewards; ``{}`` without any),
        ``hist``: ``{value: count}`` when at most 10 distinct values, else counts in 10 equal bins keyed by their
        lower edge; ``rewards``: every rollout's :func:`outcome_reward` (None when it failed or reported none), in
        input order. (A failed rollout's posted reward had entered ``reward`` and ``rewards``: the table's
        "reward mean" differed from ``reward_mean``.)
    """
    if not rollouts:
        return {"accuracy": 0.0, "correct": [], "reward_mean": 0.0, "n": 0, "failed": 0, "problems": 0,
                "samples_per_problem": 0, "pass_at_k": {}, "reward": {}, "rewards": []}
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id or r.rollout_id, []).append(r)
    solved = [int(correct(r, is_correct)) for r in rollouts]
    per_problem = [(len(g), sum(correct(r, is_correct) for r in g)) for g in groups.values()]
    m = min(n for n, _ in per_problem)
    ks = sorted({k for k in (2 ** i for i in range(m.bit_length())) if k <= m} | {m})
    pass_k = {str(k): sum(pass_at_k(n, c, k) for n, c in per_problem) / len(per_problem) for k in ks}
    rewards = [outcome_reward(r) for r in rollouts]
    return {"accuracy": accuracy(rollouts, is_correct), "correct": solved,
            "reward_mean": reward_mean(rollouts), "n": len(rollouts),
            "failed": sum(r.status == RolloutStatus.failed for r in rollouts), "problems": len(groups),
            "samples_per_problem": m, "pass_at_k": pass_k,
            "reward": reward_distribution([x for x in rewards if x is not None]), "rewards": rewards}


def reward_distribution(values: list[float]) -> dict:
    """Summary of rewards (see :func:`eval_stats`); ``{}`` for no values."""
    if not values:
        return {}
    xs = sorted(values)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    distinct = Counter(xs)
    hist: dict[str, int] = {}  # (keys are printed values: two that print alike share one key and add up: round 23,
    if len(distinct) <= 10:  # a later count overwrote an earlier one, 3 rollouts counted 2)
        for v, c in sorted(distinct.items()):
            hist[f"{v:.12g}"] = hist.get(f"{v:.12g}", 0) + c
    else:
        lo, hi = xs[0], xs[-1]
        width = (hi - lo) / 10
        counts = Counter(min(9, int((x - lo) / width)) for x in xs)
        for b in range(10):
            hist[f"{lo + b * width:.4g}"] = hist.get(f"{lo + b * width:.4g}", 0) + counts.get(b, 0)
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs), "min": xs[0], "p25": q[0],
            "median": q[1], "p75": q[2], "max": xs[-1], "hist": hist}
