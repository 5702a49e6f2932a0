"""Rollout-level advantages: one scalar per rollout, broadcast to all of its rows.

Two baselines, chosen by ``TrainConfig.advantage`` (:func:`rollout_advantages`):

- **GRPO** (Shao et al. 2024, "DeepSeekMath", eq. 3; verl ``core_algos.compute_grpo_outcome_advantage``):
  ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the unbiased std, or without the division
  when ``norm_by_std`` is False (Dr. GRPO, Liu et al. 2025).
- **RLOO**, REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
  Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
  Feedback in LLMs", sec. 3.2; verl ``core_algos.compute_rloo_outcome_advantage``):
  ``A_i = r_i - 1/(n-1) * sum_{j != i} r_j = n/(n-1) * (r_i - mean(r_group))`` for a group of ``n``
  rollouts: the baseline of each rollout is the mean reward of the *other* rollouts of its group, so it
  does not depend on ``r_i`` and the estimate stays unbiased. No std normalization.

With either, a group of one rollout, or of equal rewards, gets ``A = 0`` (verl gives a singleton group its
raw reward instead; the loop drops groups under ``min_group_size`` anyway). A rollout with many rows
still counts once in its group's statistics: these functions take one reward per *rollout*.

:func:`row_advantages` gives each training row its value at either **level** (``TrainConfig.advantage_level``):
``rollout`` (above: one sample per rollout, broadcast to its rows; Agent Lightning's "rollout-level" credit) or
``row``, the sample-level baseline of the ablation: every row is its own sample in its group's statistics, so a
rollout that broke into three rows counts three times in the group's mean and std (what verl's
``compute_grpo_outcome_advantage`` does with rows of one ``uid``).
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "rloo"]
AdvantageLevel = Literal["rollout", "row"]


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Per-rollout GRPO advantages.

    Args:
        rewards: ``(R,)`` float, one reward per rollout.
        group_index: ``(R,)`` int64, the group of each rollout (any integer labels).
        norm_by_std: divide by the group's unbiased std (+ ``eps``).
    Returns:
        ``(R,)`` float32 advantages; 0 for groups of size 1.
    """
    rewards = rewards.to(torch.float64)  # computed in float64 (a large reward's sum would overflow float32)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_index):
        idx = group_index == g
        r = rewards[idx]
        if r.numel() < 2:
            continue
        centered = r - r.mean()
        std = r.std(unbiased=True)
        if norm_by_std:
            adv[idx] = centered / (std + eps) if std > 0 else torch.zeros_like(r)
        else:
            adv[idx] = centered
    return adv.to(torch.float32)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Per-rollout RLOO advantages ``A_i = r_i - mean_{j != i} r_j`` (leave-one-out baseline).

    Args:
        rewards: ``(R,)`` float, one reward per rollout.
        group_index: ``(R,)`` int64, the group of each rollout (any integer labels).
    Returns:
        ``(R,)`` float32 advantages; 0 for groups of size 1 (no other rollout to form a baseline).
    """
    rewards = rewards.to(torch.float64)  # computed in float64 (a large reward's sum would overflow float32)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_index):
        idx = group_index == g
        r = rewards[idx]
        n = r.numel()
        if n < 2:
            continue
        adv[idx] = r - (r.sum() - r) / (n - 1)
    return adv.to(torch.float32)


def rollout_advantages(rewards: torch.Tensor, group_index: torch.Tensor, estimator: Estimator = "grpo",
                       norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``(R,)`` float32 advantages with the chosen baseline: :func:`grpo_advantages` (``norm_by_std``,
    ``eps``) or :func:`rloo_advantages` (which ignores both). Raises ``ValueError`` for another name."""
    if estimator == "grpo":
        return grpo_advantages(rewards, group_index, norm_by_std=norm_by_std, eps=eps)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_index)
    raise ValueError(f"unknown advantage estimator {estimator!r} (grpo or rloo)")


def row_advantages(rewards: torch.Tensor, group_index: torch.Tensor, rows_per_rollout: torch.Tensor,
                   level: AdvantageLevel = "rollout", estimator: Estimator = "grpo", norm_by_std: bool = True,
                   eps: float = 1e-6) -> torch.Tensor:
    """One advantage per training row, rows in rollout order (rollout 0's rows first).

    Args:
        rewards: ``(R,)`` float, one reward per rollout.
        group_index: ``(R,)`` int64, the group of each rollout.
        rows_per_rollout: ``(R,)`` int64 (>= 0), how many rows each rollout yielded.
        level: ``rollout``: :func:`rollout_advantages` over the ``R`` rollouts, repeated for each row;
            ``row``: :func:`rollout_advantages` over the rows, each row a sample carrying its rollout's
            reward and group.
        estimator, norm_by_std, eps: as in :func:`rollout_advantages`.
    Returns:
        ``(rows_per_rollout.sum(),)`` float32.
    Raises:
        ValueError: an unknown ``level`` or estimator, or tensors of different lengths.
    """
    if not (len(rewards) == len(group_index) == len(rows_per_rollout)):
        raise ValueError(f"{len(rewards)} rewards, {len(group_index)} group labels, {len(rows_per_rollout)} row counts")
    if level == "rollout":
        adv = rollout_advantages(rewards, group_index, estimator, norm_by_std, eps)
        return adv.repeat_interleave(rows_per_rollout)
    if level == "row":
        return rollout_advantages(rewards.repeat_interleave(rows_per_rollout),
                                  group_index.repeat_interleave(rows_per_rollout), estimator, norm_by_std, eps)
    raise ValueError(f"unknown advantage level {level!r} (rollout or row)")
