"""What a training step's rollouts tell: where the wall-clock time went, and the signals users watch.

All inputs are the records the project already stores: rollouts (``started_at`` / ``ended_at``, stamped by
the controller) and call records (``started_at`` / ``ended_at``, ``finish_reason``, token ids, stamped by the
gateway). Times are Unix seconds; durations are seconds.
"""

from __future__ import annotations

from collections.abc import Iterable

from agl_common.schemas import CallRecord, Rollout

from .evalstats import outcome_reward

#: categories of a step's wall-clock time, in the order they claim an instant (see :func:`rollout_phase_split`)
TIME_KEYS = ("time_generation_s", "time_harness_startup_s", "time_wait_s", "time_update_s", "time_weight_load_s",
             "time_pause_drain_s", "time_idle_s")


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length (s) of the union of ``intervals`` clipped to ``[lo, hi]``; empty or inverted intervals count 0."""
    spans = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _minus(intervals: list[tuple[float, float]], cut: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of ``union(intervals) - union(cut)`` within ``[lo, hi]``."""
    return union_length(intervals + cut, lo, hi) - union_length(cut, lo, hi)


def rollout_phase_split(rollouts: list[Rollout], calls: dict[str, list[CallRecord]], start: float, ready: float,
                        tail_frac: float = 0.9) -> dict[str, float]:
    """Split the rollout phase ``[start, ready]`` (Unix s) of a step into exclusive parts (seconds).

    * ``time_wait_s``: waiting for stragglers, from the instant ``tail_frac`` of the rollouts had ended to
      ``ready`` (whatever ran then: the engine serves only the last few rollouts);
    * before that instant, ``time_generation_s``: at least one model call in flight (union of call intervals);
    * ``time_harness_startup_s``: no call in flight, but some harness process started and not yet at its first
      call (``rollout.started_at`` → first call);
    * ``time_idle_s``: the rest (harness work after its last call, the controller's and trainer's bookkeeping).

    The four add up to ``ready - start``.
    """
    ends = sorted(r.ended_at for r in rollouts if r.ended_at)
    if ends and len(ends) >= tail_frac * len(rollouts):
        tail = min(max(ends[max(0, int(len(rollouts) * tail_frac + 0.999999) - 1)], start), ready)
    else:
        tail = ready
    gen = [(c.started_at, c.ended_at) for cs in calls.values() for c in cs if c.started_at and c.ended_at]
    startup = []
    for r in rollouts:
        firsts = [c.started_at for c in calls.get(r.rollout_id, []) if c.started_at]
        if r.started_at:
            startup.append((r.started_at, min(firsts) if firsts else (r.ended_at or tail)))
    generation = union_length(gen, start, tail)
    harness = _minus(startup, gen, start, tail)
    return {"time_generation_s": generation, "time_harness_startup_s": harness,
            "time_wait_s": max(0.0, ready - tail), "time_idle_s": max(0.0, (tail - start) - generation - harness)}


def batch_signals(rollouts: list[Rollout], calls: dict[str, list[CallRecord]]) -> dict[str, float]:
    """Signals of one step's rollouts.

    Returns ``group_signal_frac`` (groups whose succeeded rollouts' rewards are not all equal / groups),
    ``truncation_rate`` (calls that stopped at ``max_tokens``: ``finish_reason == "length"`` / calls),
    ``response_tokens_mean`` (sampled tokens per call) and ``calls`` (how many).
    """
    groups: dict[str, set[float]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id or r.rollout_id, set())
        if (reward := outcome_reward(r)) is not None:  # (a failed rollout's posted reward made a group "signal")
            groups[r.group_id or r.rollout_id].add(reward)
    every = [c for cs in calls.values() for c in cs]
    n = max(1, len(every))
    return {"group_signal_frac": sum(len(v) > 1 for v in groups.values()) / max(1, len(groups)),
            "truncation_rate": sum(c.finish_reason == "length" for c in every) / n,
            "response_tokens_mean": sum(len(c.response_token_ids) for c in every) / n,
            "calls": len(every)}


def role_signals(rollouts: list[Rollout], calls: dict[str, list[CallRecord]], rows: list) -> dict[str, dict]:
    """Per role (:attr:`CallRecord.role`) of one step: ``calls``, ``truncation_rate`` (its calls cut at
    ``max_tokens``), ``rollouts`` (rollouts that called it), ``reward_mean`` (the mean of their
    :func:`~agl_trainer.algorithm.evalstats.outcome_reward`: succeeded, rewarded ones only; None if none) and
    ``rows`` (training rows of that role, :attr:`Row.role`). ``{}`` without roles."""
    out: dict[str, dict] = {}
    by_id = {r.rollout_id: r for r in rollouts}
    for rid, cs in calls.items():
        for role in {c.role for c in cs if c.role is not None}:
            s = out.setdefault(role, {"calls": 0, "cut": 0, "rewards": [], "rollouts": 0, "rows": 0})
            s["rollouts"] += 1
            if rid in by_id and (reward := outcome_reward(by_id[rid])) is not None:
                s["rewards"].append(reward)
        for c in cs:
            if c.role is not None:
                out[c.role]["calls"] += 1
                out[c.role]["cut"] += c.finish_reason == "length"
    for row in rows:
        if row.role in out:
            out[row.role]["rows"] += 1
    return {role: {"calls": s["calls"], "truncation_rate": s["cut"] / max(1, s["calls"]), "rollouts": s["rollouts"],
                   "reward_mean": sum(s["rewards"]) / len(s["rewards"]) if s["rewards"] else None, "rows": s["rows"]}
            for role, s in sorted(out.items())}
