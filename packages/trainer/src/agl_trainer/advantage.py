"""Rollout-level advantages: one scalar per rollout, broadcast to all of its rows.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3; verl ``core_algos.compute_grpo_outcome_advantage``):
``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the unbiased std, or without the division
when ``norm_by_std`` is False (Dr. GRPO, Liu et al. 2025). A group of one rollout, or of equal rewards, gets ``A = 0``.
A rollout with many rows still counts once in its group's statistics.
"""

from __future__ import annotations

import torch


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
    rewards = rewards.to(torch.float32)
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
    return adv
