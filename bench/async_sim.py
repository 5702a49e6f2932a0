#!/usr/bin/env python
"""Sync vs collocated async RL under heavy-tailed rollout durations: a seeded discrete-event simulation.

Model (all times in seconds; pure Python, runs in about a second):

- A *group* is ``n`` rollouts of one input (one GRPO group). Each rollout takes a lognormal time
  ``exp(N(mu, sigma))`` (median ``e^mu``; heavy right tail for ``sigma`` ≳ 1), independent of how many
  run at once (agentic rollouts are latency-bound: tools, environment, many short model calls). A
  group is complete when its slowest rollout is.
- Collocated: the engine and the trainer share the accelerator, so rollouts make no progress during
  an update (pause → update → resume, as ``agl_trainer.cycle``). Rollout time therefore runs on a
  *generation clock* that stops during the ``t_train`` seconds of each update;
  wall time = generation time + steps × ``t_train``.
- **sync**: each step starts ``train_batch_size`` groups, waits for all of them (the max of
  ``train_batch_size × n`` lognormals), then updates.
- **async**: keeps up to ``async_train_batch_size`` groups in flight; as soon as ``train_batch_size``
  groups are complete it updates on the earliest-completed ones; the others carry over (in-flight
  rollouts resume on the new policy after the update, their behaviour logprobs are recorded per call).
  Staleness cap ``k``: a group started under policy version ``v`` may only be trained by the update of
  version ``V`` with ``V - v <= k``; groups past that (complete or not) are dropped and their slots
  refilled (``k = 0``: no carry-over at all). Freed slots are refilled right after each update.

Reported: wall seconds per trained sample (rollout), the speedup sync/async, the mean staleness of
trained groups (versions), the dropped fraction of started groups (wasted rollouts), and the duration
bias (mean duration of trained groups / of all started ones; < 1: async over-samples fast groups).
Not modelled: the engine's extra load from keeping more rollouts in flight, and the cost of dropped
(wasted) rollouts; both favour async here.

This is the idea of partial/asynchronous rollout in e.g. AReaL (Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning") and slime/verl's async modes, for
which ~2x end-to-end speedups are reported; the numbers here are a model, not a measurement.

Run: ``.venv/bin/python bench/async_sim.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass


@dataclass
class Result:
    wall_s: float
    samples: int
    mean_staleness: float = 0.0
    dropped_groups: int = 0
    started_groups: int = 0
    #: mean group duration (s) of trained groups / of all started groups: < 1 means the batch favours
    #: fast groups (async's selection bias toward short rollouts)
    duration_bias: float = 1.0

    @property
    def per_sample(self) -> float:
        return self.wall_s / self.samples


def group_time(rng: random.Random, n: int, mu: float, sigma: float) -> float:
    """Seconds until the slowest of ``n`` lognormal rollouts finishes."""
    return max(rng.lognormvariate(mu, sigma) for _ in range(n))


def simulate_sync(seed: int, steps: int, batch: int, n: int, mu: float, sigma: float, t_train: float) -> Result:
    """Each step: ``batch`` groups start together; update when the last rollout ends."""
    rng = random.Random(seed)
    gen = 0.0
    for _ in range(steps):
        gen += max(group_time(rng, n, mu, sigma) for _ in range(batch))
    return Result(gen + steps * t_train, steps * batch * n, started_groups=steps * batch)


def simulate_async(seed: int, steps: int, batch: int, async_batch: int, n: int, mu: float, sigma: float,
                   t_train: float, k: int) -> Result:
    """Keep ``async_batch`` groups in flight; update on the first ``batch`` complete (staleness cap ``k``).

    Raises:
        ValueError: ``async_batch < batch`` (could never collect a batch).
    """
    if async_batch < batch:
        raise ValueError("async_train_batch_size must be >= train_batch_size")
    rng = random.Random(seed)
    gen = 0.0  # generation clock (stops during updates)
    version = 0
    active: list[tuple[float, int, float]] = []  # (completion on the generation clock, start version, duration)
    started = dropped = staleness = 0
    all_durations = trained_durations = 0.0
    for _ in range(steps):
        while len(active) < async_batch:
            d = group_time(rng, n, mu, sigma)
            active.append((gen + d, version, d))
            started += 1
            all_durations += d
        active.sort()
        gen = max(gen, active[batch - 1][0])  # the batch-th completion (or now, if already complete)
        trained, active = active[:batch], active[batch:]
        staleness += sum(version - v for _, v, _ in trained)
        trained_durations += sum(d for _, _, d in trained)
        version += 1
        keep = [g for g in active if version - g[1] <= k]
        dropped += len(active) - len(keep)
        active = keep
    return Result(gen + steps * t_train, steps * batch * n, staleness / (steps * batch), dropped, started,
                  (trained_durations / (steps * batch)) / (all_durations / started))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--train-batch-size", type=int, default=8, help="groups per update")
    ap.add_argument("--async-train-batch-size", type=int, default=12, help="groups kept in flight (async)")
    ap.add_argument("--group-size", type=int, default=8, help="rollouts per group (n)")
    ap.add_argument("--median-s", type=float, default=60.0, help="median rollout seconds (e^mu)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (tail heaviness)")
    ap.add_argument("--train-s", type=float, default=60.0, help="seconds per update (engine paused)")
    ap.add_argument("--staleness", type=int, default=1, help="staleness cap k (policy versions)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    mu = math.log(a.median_s)

    def compare(sigma: float, k: int, async_batch: int) -> tuple[Result, Result]:
        s = simulate_sync(a.seed, a.steps, a.train_batch_size, a.group_size, mu, sigma, a.train_s)
        y = simulate_async(a.seed, a.steps, a.train_batch_size, async_batch, a.group_size, mu, sigma,
                           a.train_s, k)
        return s, y

    s, y = compare(a.sigma, a.staleness, a.async_train_batch_size)
    print(f"{a.steps} steps × {a.train_batch_size} groups × {a.group_size} rollouts; rollout time lognormal "
          f"(median {a.median_s:.0f} s, sigma {a.sigma}); update {a.train_s:.0f} s; async keeps "
          f"{a.async_train_batch_size} groups in flight, staleness cap k={a.staleness}; seed {a.seed}")
    print(f"  sync : {s.per_sample:6.2f} s per trained sample ({s.wall_s / 3600:6.1f} h)")
    print(f"  async: {y.per_sample:6.2f} s per trained sample ({y.wall_s / 3600:6.1f} h), mean staleness "
          f"{y.mean_staleness:.2f}, dropped {y.dropped_groups}/{y.started_groups} groups, trained-group "
          f"duration bias {y.duration_bias:.2f}")
    print(f"  speedup sync/async: {s.per_sample / y.per_sample:.2f}x")
    print("\nsensitivity (speedup, dropped fraction):")
    print("  sigma  k  in-flight   sync s/sample  async s/sample  speedup  dropped  dur. bias")
    for sigma in (0.5, 1.0, 1.5):
        for k in (0, 1, 2):
            for async_batch in (a.train_batch_size * 3 // 2, a.train_batch_size * 2):
                s, y = compare(sigma, k, async_batch)
                print(f"  {sigma:5.1f}  {k}  {async_batch:9d}   {s.per_sample:13.2f}  {y.per_sample:14.2f}  "
                      f"{s.per_sample / y.per_sample:6.2f}x  {y.dropped_groups / y.started_groups:7.1%}  "
                      f"{y.duration_bias:9.2f}")


if __name__ == "__main__":
    main()
