"""The one batch builder: a step's rollouts and their recorded calls → kept groups → training rows → per-row
advantages. Training (:mod:`agl_trainer.loop`), ``rollouts export --shape rows`` and the dashboard's group view
all call these functions, so each shows exactly what was (or would be) trained.

Group policy: failed rollouts (timeouts, crashes, no model calls) never count as reward 0, they leave their
group; a group left with fewer than ``min_group_size`` rollouts is dropped; a kept rollout that yields no row
(every call unusable) leaves the advantage statistics too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from agl_common.schemas import CallRecord, Rollout

from .advantage import row_advantages
from .aggregate import AggregateStats, Row, Vocabulary, build_rows
from .evalstats import outcome_reward

if TYPE_CHECKING:
    from ..config import TrainConfig


def select_groups(rollouts: list[Rollout], min_group_size: int) -> tuple[list[Rollout], dict[str, int]]:
    """Keep succeeded rollouts with a reward, in groups that still have ``min_group_size`` of them.

    Returns ``(kept rollouts, {"failed": n, "dropped_groups": n})``.
    """
    groups: dict[str, list[Rollout]] = {}
    counts = {"failed": 0, "dropped_groups": 0}
    for r in rollouts:
        if outcome_reward(r) is not None:  # (the one definition: a succeeded rollout's reward)
            groups.setdefault(r.group_id or r.rollout_id, []).append(r)
        else:
            counts["failed"] += 1
    kept = []
    for members in groups.values():
        if len(members) >= min_group_size:
            kept += members
        else:
            counts["dropped_groups"] += 1
    return kept, counts


def advantages_of(rollouts: Sequence[Rollout], rows_per_rollout: Sequence[int], estimator: str = "grpo",
                  level: str = "rollout", norm_by_std: bool = True) -> torch.Tensor:
    """Per-row advantages, float32 ``(sum(rows_per_rollout),)``, rollout by rollout in the given order: GRPO or
    RLOO (``estimator``) over each rollout's group (``group_id``, else its own id) at ``level`` (``rollout``:
    one sample per rollout, broadcast to its rows; ``row``: each row a sample), see
    :func:`agl_trainer.algorithm.advantage.row_advantages`. Every rollout needs a reward (``select_groups``)."""
    groups = {g: k for k, g in enumerate(sorted({r.group_id or r.rollout_id for r in rollouts}))}
    return row_advantages(torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float64),
                          torch.tensor([groups[r.group_id or r.rollout_id] for r in rollouts], dtype=torch.int64),
                          torch.tensor(list(rows_per_rollout), dtype=torch.int64), level, estimator, norm_by_std)


def build_batch(rollouts: list[Rollout], calls: dict[str, list[CallRecord]], cfg: TrainConfig,
                vocab: Vocabulary | None = None) -> tuple[list[Row], list[float], AggregateStats, dict[str, float]]:
    """Rows and per-row advantages for the kept rollouts (:func:`select_groups` first).

    ``calls``: rollout id → its current attempt's call records. ``cfg``: ``aggregation``, ``max_prompt_tokens``,
    ``max_response_tokens`` (rows, :func:`agl_trainer.algorithm.aggregate.build_rows`), ``advantage``,
    ``advantage_level``, ``norm_by_std`` (:func:`advantages_of`). ``vocab``: the trained model's
    :class:`~agl_trainer.algorithm.aggregate.Vocabulary` (merge-break classes, end-of-turn ids, the bound on ids).

    Returns ``(rows, row advantages, aggregation stats, stats)``; ``stats``: ``adv_abs_mean`` (mean |A| over the
    rollouts), ``rollouts_trained`` (rollouts that gave a row) and ``multi_row_rollouts`` (those with several);
    empty when no rollout gave a row. Raises ``KeyError`` if a rollout's calls are missing from ``calls``.
    """
    stats = AggregateStats()
    per_rollout: list[tuple[Rollout, list[Row]]] = []
    for r in rollouts:
        rows = build_rows(calls[r.rollout_id], cfg.aggregation, stats, vocab=vocab,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_response_tokens=cfg.max_response_tokens)
        if rows:
            per_rollout.append((r, rows))
    if not per_rollout:
        return [], [], stats, {}
    n_rows = torch.tensor([len(rs) for _, rs in per_rollout])
    adv = advantages_of([r for r, _ in per_rollout], n_rows.tolist(), cfg.advantage, cfg.advantage_level,
                        cfg.norm_by_std)
    rows = [row for _, rs in per_rollout for row in rs]
    first = torch.cumsum(n_rows, 0) - n_rows  # each rollout's first row: its rows share one value at either level
    return rows, adv.tolist(), stats, {"adv_abs_mean": float(adv[first].abs().mean()),
                                       "rollouts_trained": len(per_rollout),
                                       "multi_row_rollouts": int((n_rows > 1).sum())}
