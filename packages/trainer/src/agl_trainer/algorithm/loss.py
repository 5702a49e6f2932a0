"""The policy loss: clipped PPO on token logprobs, normalized per rollout.

Clipped surrogate (Schulman et al. 2017, "PPO", eq. 7), token level, with ratio
``rho_t = exp(clamp(logp_t - old_logp_t, -20, 20))`` (the log-ratio clamped as verl's
``compute_policy_loss_vanilla`` does: one token whose recorded logprob is far off, e.g. an engine's -9999 floor
for -inf, would otherwise overflow float32 to an infinite ratio and a NaN gradient)::

    pg_t = max(-A * rho_t, -A * clip(rho_t, 1 - clip_low, 1 + clip_high))

and, for ``A < 0``, the dual clip of Ye et al. 2020 ("Mastering Complex Control in MOBA Games"):
``pg_t = min(pg_t, -A * clip_c)`` (verl ``core_algos.compute_policy_loss_vanilla``).

Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"): when the behaviour policy (the engine, possibly several versions old) differs
from the trainer's ``old`` policy, ``pg_t`` is multiplied by ``min(exp(old_t - behaviour_t), C)``; see
:func:`truncated_is_weights`.

Per-rollout normalization: every rollout weighs the same whatever its number of rows or tokens::

    L = (1 / R) * sum_r (1 / T_r) * sum_{rows of r} sum_t mask_t * pg_t

with ``R`` rollouts in the batch and ``T_r`` the response-mask tokens of rollout ``r`` over all its rows.

The sample-level normalizations of the ablation (``TrainConfig.loss_agg_mode``, verl's ``loss_agg_mode`` names;
:func:`token_weights`): ``token-mean`` (every sampled token of the batch weighs the same: a long or many-row
rollout weighs more) and ``seq-mean-token-mean`` (every *row* weighs the same: a rollout with three rows
weighs three times).
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggMode = Literal["rollout-mean", "token-mean", "seq-mean-token-mean"]

#: |log-ratio| above this is clamped before ``exp`` (verl's value): ``exp(20)`` ≈ 4.9e8 is finite in float32
LOG_RATIO_CLAMP = 20.0


def per_rollout_token_weights(response_mask: torch.Tensor, rollout_index: torch.Tensor) -> torch.Tensor:
    """Token weights ``mask / (T_r * R)`` that make :func:`ppo_loss` a per-rollout mean.

    Args:
        response_mask: ``(B, T)`` 0/1 (any dtype), 1 where the policy sampled the token.
        rollout_index: ``(B,)`` int64, the rollout of each row.
    Returns:
        ``(B, T)`` float32 weights summing to 1 over the batch (0 if no token is masked in).
    """
    mask = response_mask.to(torch.float32)
    rollouts, inverse = torch.unique(rollout_index, return_inverse=True)
    tokens_per_rollout = torch.zeros(len(rollouts)).index_add_(0, inverse, mask.sum(dim=1))
    has_tokens = tokens_per_rollout > 0
    n_rollouts = has_tokens.sum().clamp(min=1)
    row_scale = torch.where(has_tokens[inverse], 1.0 / tokens_per_rollout[inverse].clamp(min=1), 0.0)
    return mask * (row_scale / n_rollouts).unsqueeze(1)


def token_weights(response_mask: torch.Tensor, rollout_index: torch.Tensor,
                  mode: LossAggMode = "rollout-mean") -> torch.Tensor:
    """Token weights for :func:`ppo_loss`, summing to 1 over the batch's sampled tokens (all 0 if none).

    Args:
        response_mask: ``(B, T)`` 0/1 (any dtype), 1 where the policy sampled the token.
        rollout_index: ``(B,)`` int64, the rollout of each row (used by ``rollout-mean`` only).
        mode: ``rollout-mean`` (:func:`per_rollout_token_weights`: ``mask / (T_r * R)``), ``token-mean``
            (``mask / N``, ``N`` sampled tokens in the batch) or ``seq-mean-token-mean`` (``mask / (T_b * B')``,
            ``T_b`` the row's sampled tokens, ``B'`` the rows that have any; verl ``core_algos.agg_loss``).
    Returns:
        ``(B, T)`` float32.
    Raises:
        ValueError: an unknown ``mode``.
    """
    mask = response_mask.to(torch.float32)
    if mode == "rollout-mean":
        return per_rollout_token_weights(mask, rollout_index)
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_row = mask.sum(dim=1, keepdim=True)
        n_rows = (per_row > 0).sum().clamp(min=1)
        return torch.where(per_row > 0, mask / per_row.clamp(min=1), 0.0) / n_rows
    raise ValueError(f"unknown loss_agg_mode {mode!r} (rollout-mean, token-mean or seq-mean-token-mean)")


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             weights: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
             clip_c: float | None = 3.0, is_weights: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO loss with dual clip, reduced with ``weights``.

    Args:
        logprobs: ``(B, T)`` float, current policy logprobs of the response tokens (nats).
        old_logprobs: ``(B, T)`` float, behaviour-policy logprobs (the engine's, as recorded).
        advantages: ``(B,)`` or ``(B, T)`` float; a per-row value is broadcast over tokens.
        weights: ``(B, T)`` float from :func:`token_weights` (0 at context tokens).
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        clip_c: dual-clip constant (> 1), or None to disable.
        is_weights: ``(B, T)`` token-level importance weights multiplied into ``pg`` (e.g. truncated IS).
    Returns:
        ``(loss, stats)``: scalar loss; stats with the clipped fraction and mean ratio over weighted tokens.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(loss1, loss2)
    if clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * clip_c), pg)
    if is_weights is not None:
        pg = pg * is_weights
    loss = (pg * weights).sum()
    with torch.no_grad():
        active = weights > 0
        n = active.sum().clamp(min=1)
        stats = {"clip_frac": float(((loss2 > loss1) & active).sum() / n),
                 "ratio_mean": float((ratio * active).sum() / n)}
    return loss, stats


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(old - behaviour), cap)`` per token, ``(B, T)`` float, no gradient.

    Args:
        old_logprobs: ``(B, T)`` the trainer's policy before this update (nats).
        behaviour_logprobs: ``(B, T)`` what the engine recorded when it sampled (nats).
        cap: the truncation C (Yao et al. 2025 use 2).
    """
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap).detach()
