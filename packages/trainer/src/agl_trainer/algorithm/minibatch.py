"""PPO mini-batches by rollout, with an optional cap on optimizer steps per training step.

A training step's rows are split into mini-batches of ``rollouts_per_batch`` *rollouts* (all rows of a
rollout always fall in the same mini-batch, so the per-rollout normalization of
:func:`agl_trainer.algorithm.loss.per_rollout_token_weights`, computed on one mini-batch's rows, weighs every rollout
of that mini-batch the same). Each mini-batch is one optimizer step, as verl's ``ppo_mini_batch_size``
(one PPO epoch; Schulman et al. 2017, "PPO", Algorithm 1: minibatch SGD over the collected samples).
With ``max_updates`` the mini-batches past the first ``max_updates`` are not trained on: their rollouts
and rows are counted as dropped.

Order (deterministic, documented so that runs are reproducible): the rollout ids are sorted, then
shuffled with ``random.Random(f"{seed}:{crc32 of the sorted ids}")``, then cut into consecutive chunks of
``rollouts_per_batch``; the last chunk may be smaller. The same batch and seed give the same split, also
after a trainer restart. Without splitting (``rollouts_per_batch`` None or >= the number of rollouts)
there is one mini-batch holding every row, and nothing is shuffled or dropped.

Pure Python (no torch, no ``agl_common``): usable in any environment.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class MiniBatchPlan:
    """What :func:`plan_mini_batches` decided.

    Attributes:
        batches: one list of row indices per optimizer step (ascending within a mini-batch).
        dropped_rollouts: rollouts left out because of ``max_updates``.
        dropped_rows: their rows.
        dropped: the row indices left out (ascending).
    """

    batches: list[list[int]] = field(default_factory=list)
    dropped_rollouts: int = 0
    dropped_rows: int = 0
    dropped: list[int] = field(default_factory=list)

    @property
    def kept(self) -> list[int]:
        """Every trained row index, ascending."""
        return sorted(i for mb in self.batches for i in mb)


def plan_mini_batches(rollout_of_row: Sequence[str], rollouts_per_batch: int | None = None,
                      max_updates: int | None = None, seed: int = 0) -> MiniBatchPlan:
    """Split rows into per-rollout mini-batches (see the module docstring for the order).

    Args:
        rollout_of_row: ``(B,)`` the rollout id of each row.
        rollouts_per_batch: rollouts per mini-batch (>= 1), or None for one mini-batch of everything.
        max_updates: at most this many mini-batches (>= 1); rollouts of later ones are dropped. None: all.
        seed: shuffle seed (``TrainConfig.seed``).
    Returns:
        a :class:`MiniBatchPlan` with ``min(ceil(R / rollouts_per_batch), max_updates)`` mini-batches for
        ``R`` distinct rollouts (0 mini-batches for no rows).
    Raises:
        ValueError: ``rollouts_per_batch`` or ``max_updates`` below 1.
    """
    if rollouts_per_batch is not None and rollouts_per_batch < 1:
        raise ValueError(f"rollouts_per_batch must be >= 1, got {rollouts_per_batch}")
    if max_updates is not None and max_updates < 1:
        raise ValueError(f"max_updates must be >= 1, got {max_updates}")
    rows_of: dict[str, list[int]] = {}
    for i, rid in enumerate(rollout_of_row):
        rows_of.setdefault(rid, []).append(i)
    ids = sorted(rows_of)
    if not ids:
        return MiniBatchPlan()
    if rollouts_per_batch is None or rollouts_per_batch >= len(ids):
        return MiniBatchPlan(batches=[list(range(len(rollout_of_row)))])
    digest = zlib.crc32("\n".join(ids).encode())
    random.Random(f"{seed}:{digest}").shuffle(ids)
    chunks = [ids[k: k + rollouts_per_batch] for k in range(0, len(ids), rollouts_per_batch)]
    n_kept = len(chunks) if max_updates is None else min(len(chunks), max_updates)
    batches = [sorted(i for rid in chunk for i in rows_of[rid]) for chunk in chunks[:n_kept]]
    dropped_ids = [rid for chunk in chunks[n_kept:] for rid in chunk]
    dropped = sorted(i for rid in dropped_ids for i in rows_of[rid])
    return MiniBatchPlan(batches=batches, dropped_rollouts=len(dropped_ids), dropped_rows=len(dropped),
                         dropped=dropped)
