"""The plain-PyTorch backend: PEFT LoRA on the served model, on CPU.

Each update is one optimizer step over the whole batch (gradients accumulated over micro-batches, the
loss normalized per rollout via global token weights), or, with ``ppo_mini_batch_rollouts``, one step per
mini-batch of that many rollouts (at most ``max_updates_per_step``; see :mod:`agl_trainer.algorithm.minibatch`);
then the new policy is served in one of two ways (``serving``):

- ``merged`` (default): the adapter is merged into the base weights (``W + B A * alpha/r`` per LoRA layer, in
  the engine's dtype) and the engine reloads those full weights in place (vLLM ``reload_weights``), so calls
  run at plain-weights speed under the base model's served name; measured on a 2-core AMD EPYC (avx512_bf16):
  509 vs 69 tokens/s at 32 in flight against serving the adapter, ~1.5 s a swap (bench/engine.py,
  docs/learning.md). Only the newest merged copy is kept on disk.
- ``adapter``: the adapter is saved with ``save_pretrained`` and hot-loaded (``/v1/load_lora_adapter``) as
  ``policy-v{N}`` (the engine needs ``--enable-lora``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from agl_common.schemas import Policy, policy_name

from .. import compute, interrupt
from ..algorithm.aggregate import Row
from ..algorithm.loss import ppo_loss, token_weights, truncated_is_weights
from ..algorithm.minibatch import plan_mini_batches


class CpuBackend:
    """LoRA policy on CPU (:class:`agl_trainer.backends.base.Backend`).

    Args:
        base_dir: the base model (safetensors + tokenizer) the engine serves.
        out_dir: adapters are written to ``{out_dir}/policy-v{N}``.
        lora_rank, lora_alpha: LoRA size (rank must not exceed the engine's ``--max-lora-rank``).
        lr: AdamW learning rate.
        micro_batch_tokens: most (padded) tokens per forward pass.
        tis_cap: with a cap, the PPO ratio is taken against the trainer's own policy before the update and
            the engine's logprobs enter as truncated importance weights (for stale, async samples).
        bf16: run forward and backward under CPU bf16 autocast (LoRA weights and optimizer stay fp32);
            about as fast as the engine's own bf16 and closer to its logprobs.
        ppo_mini_batch_rollouts: rollouts per optimizer step (None: one step over the whole batch).
        max_updates_per_step: at most this many optimizer steps per update; the rest is dropped, counted.
        seed: LoRA initialization and the mini-batch order.
        engine_url: the vLLM engine(s) that hot-load each published adapter (comma-separated; needed by
            :meth:`publish`, :meth:`serve`, :meth:`retire`).
        model_name: the base model's served name (policy version 0; every version with ``serving="merged"``).
        serving: ``merged`` or ``adapter`` (see the module docstring).
        engine_dtype: ``bfloat16`` or ``float32``: the dtype merged weights are written in.
        loss_agg_mode: how a mini-batch's token losses are weighed (:func:`agl_trainer.algorithm.loss.token_weights`):
            ``rollout-mean`` (default), ``token-mean`` or ``seq-mean-token-mean``.
        role: the role this policy is (:class:`agl_trainer.backends.roles.RolesBackend`): its adapters are
            saved and served as ``policy-v{N}-{role}`` (adapter serving only); None: the run's one policy.
    """

    name = "cpu"

    def __init__(self, base_dir: Path, out_dir: Path, lora_rank: int = 8, lora_alpha: int = 16, lr: float = 1e-4,
                 micro_batch_tokens: int = 1024, clip_low: float = 0.2, clip_high: float = 0.2,
                 clip_c: float | None = 3.0, seed: int = 0, bf16: bool = True, tis_cap: float | None = None,
                 ppo_mini_batch_rollouts: int | None = None, max_updates_per_step: int | None = None,
                 engine_url: str | None = None, model_name: str = "smollm2", serving: str = "merged",
                 engine_dtype: str = "bfloat16", loss_agg_mode: str = "rollout-mean", role: str | None = None):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.out_dir = Path(out_dir)
        self.base_dir = Path(base_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])
        self.model = get_peft_model(base, config)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=0.0)
        self.micro_batch_tokens = micro_batch_tokens
        self.clip = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)
        self.pad_id = 0
        self.bf16 = bf16
        self.tis_cap = tis_cap
        self.seed = seed
        plan_mini_batches([], ppo_mini_batch_rollouts, max_updates_per_step)  # raises ValueError if below 1
        self.ppo_mini_batch_rollouts = ppo_mini_batch_rollouts
        self.max_updates_per_step = max_updates_per_step
        self.engine_url = engine_url
        self.model_name = model_name
        if serving not in ("merged", "adapter"):
            raise ValueError(f"serving must be merged or adapter, got {serving!r}")
        if role is not None and serving != "adapter":
            raise ValueError("a role's policy is served as an adapter (serving='adapter')")
        self.role = role
        self.serving = serving
        self.engine_dtype = getattr(torch, engine_dtype)
        token_weights(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), loss_agg_mode)  # ValueError if unknown
        self.loss_agg_mode = loss_agg_mode
        self.tied = bool(getattr(base.config, "tie_word_embeddings", False))

    # ------------------------------------------------------------------ batching
    def _micro_batches(self, order: list[int], rows: list[Row]) -> list[list[int]]:
        batches, cur, cur_max = [], [], 0
        for i in order:
            n = len(rows[i].prompt_ids) + len(rows[i].response_ids)
            if cur and max(cur_max, n) * (len(cur) + 1) > self.micro_batch_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, n)
        if cur:
            batches.append(cur)
        return batches

    def _response_logprobs(self, rows: list[Row], entropy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward a micro-batch; returns ``(logprobs (b, T_resp), mask (b, T_resp), entropy)`` right-padded,
        ``entropy`` (b, T_resp) float32 in nats (``H = logsumexp(z) - Σ softmax(z) z``, no gradient) only when
        asked for, else None."""
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
        L = max(lengths)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), L), dtype=torch.long)
        for b, r in enumerate(rows):
            full = r.full_ids()
            ids[b, : len(full)] = torch.tensor(full)
            attn[b, : len(full)] = 1
        # Only positions from the shortest prompt's last token on predict a response token: the LM head and
        # the (b, keep, vocab) fp32 logits are computed for those alone (transformers' ``logits_to_keep``),
        # not for the whole prompt (~2/3 of the sequence in the demo; the vocabulary is 49,152 wide).
        start = max(min(len(r.prompt_ids) for r in rows) - 1, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(input_ids=ids, attention_mask=attn, logits_to_keep=L - start).logits[:, :-1].float()
        # log p(token) = logit[token] - logsumexp(logits): no (b, keep, vocab) log-softmax copy is kept.
        lse = torch.logsumexp(logits, dim=-1)
        token_lp = logits.gather(-1, ids[:, start + 1:].unsqueeze(-1)).squeeze(-1) - lse
        ent = None
        if entropy:
            with torch.no_grad():
                ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
        T = max(len(r.response_ids) for r in rows)
        out = torch.zeros((len(rows), T))
        mask = torch.zeros((len(rows), T))
        ent_out = torch.zeros((len(rows), T)) if entropy else None
        for b, r in enumerate(rows):
            p, n = len(r.prompt_ids) - start, len(r.response_ids)
            out[b, :n] = token_lp[b, p - 1: p - 1 + n]
            mask[b, :n] = torch.tensor(r.response_mask, dtype=torch.float32)
            if ent_out is not None:
                ent_out[b, :n] = ent[b, p - 1: p - 1 + n]
        return out, mask, ent_out

    @torch.no_grad()
    def logprobs(self, rows: list[Row]) -> list[list[float]]:
        """Current-policy logprobs (nats) of every response token of each row (context tokens included)."""
        self.model.eval()
        out: list[list[float]] = [[] for _ in rows]
        for mb in self._micro_batches(list(range(len(rows))), rows):
            interrupt.check()
            lp, _, _ = self._response_logprobs([rows[i] for i in mb])
            for j, i in enumerate(mb):
                out[i] = lp[j, : len(rows[i].response_ids)].tolist()
        return out

    kl_sample_rows = 8

    @torch.no_grad()
    def kl_to_base(self, rows: list[Row]) -> float:
        """Mean per-token KL(π‖π_base) over the sampled tokens (response mask 1) of ``rows``, in nats.

        The k3 estimator of Schulman ("Approximating KL divergence", 2020): ``E[exp(d) - d - 1]`` with
        ``d = log π_base(t) - log π(t)`` on tokens ``t`` sampled by the engine; ``π_base`` is the model with
        the LoRA adapter disabled. 0.0 for no rows.
        """
        if not rows:
            return 0.0
        self.model.eval()
        total, count = 0.0, 0.0
        for mb in self._micro_batches(list(range(len(rows))), rows):
            interrupt.check()
            batch = [rows[i] for i in mb]
            lp, mask, _ = self._response_logprobs(batch)
            with self.model.disable_adapter():
                base, _, _ = self._response_logprobs(batch)
            d = base - lp
            total += float(((d.exp() - d - 1) * mask).sum())
            count += float(mask.sum())
        return total / max(count, 1.0)

    # ------------------------------------------------------------------ update
    def update(self, rows: list[Row], row_advantages: list[float]) -> dict[str, float]:
        """Clipped PPO over ``rows``: one optimizer step per mini-batch, loss normalized per rollout.

        The rows are split by rollout with :func:`agl_trainer.algorithm.minibatch.plan_mini_batches`
        (``ppo_mini_batch_rollouts`` rollouts per step, at most ``max_updates_per_step`` steps, seeded order);
        with neither set, one step over the whole batch. Each mini-batch's loss is the per-rollout mean over
        *its* rollouts (:func:`agl_trainer.algorithm.loss.token_weights` on its rows only; another ``loss_agg_mode``
        weighs its tokens or its rows alike instead). The ratio's ``old`` side is the
        engine's recorded logprobs (or, with ``tis_cap``, the trainer's policy before the first step),
        the same for every mini-batch.

        Args:
            rows: training rows; ``old_logprobs`` must be set (recorded by the engine).
            row_advantages: the rollout's advantage for each row (broadcast over its tokens).
        Returns:
            stats: ``loss`` and ``grad_norm`` (pre-clip) averaged over the optimizer steps, ``clip_frac`` and
            ``ratio_mean`` averaged over micro-batches, ``ratio_first`` / ``clip_frac_first`` of the first
            micro-batch (before any optimizer step of this update: ≈ 1 / 0 unless engine and trainer disagree),
            ``entropy`` (mean token entropy of the policy, nats, over the sampled tokens of the trained rows,
            from the update's own forward passes), ``kl`` (:meth:`kl_to_base` on up to ``kl_sample_rows`` rows, after the update), ``train_tokens`` (sampled tokens trained on),
            ``updates`` (optimizer steps planned), ``nonfinite_steps`` (of them, not taken: the gradient was
            NaN/inf; ``grad_norm`` averages the others), ``dropped_rollouts`` / ``dropped_rows`` (past the cap),
            ``update_s`` (seconds).
        Raises:
            KeyboardInterrupt: Ctrl-C or SIGTERM (:mod:`agl_trainer.interrupt`), checked before each micro-batch:
                the optimizer step of the mini-batch under way is not taken.
        """
        t0 = time.perf_counter()
        self.model.train()
        plan = plan_mini_batches([r.rollout_id for r in rows], self.ppo_mini_batch_rollouts,
                                 self.max_updates_per_step, self.seed)
        trainer_old: dict[int, list[float]] | None = None
        if self.tis_cap is not None:
            kept = plan.kept
            trainer_old = dict(zip(kept, self.logprobs([rows[i] for i in kept])))
        self.model.train()
        losses, grad_norms, clip_fracs, ratios, tokens = [], [], [], [], 0
        entropy = [0.0, 0.0]  # (sum over sampled tokens, their count)
        for batch in plan.batches:
            loss, norm, n_tokens = self._step(rows, row_advantages, batch, trainer_old, clip_fracs, ratios, entropy)
            losses.append(loss)
            grad_norms.append(norm)
            tokens += n_tokens
        finite = [g for g in grad_norms if math.isfinite(g)]
        return {"loss": sum(losses) / len(losses), "clip_frac": sum(clip_fracs) / len(clip_fracs),
                "ratio_mean": sum(ratios) / len(ratios), "grad_norm": sum(finite) / max(1, len(finite)),
                "nonfinite_steps": len(grad_norms) - len(finite),
                "ratio_first": ratios[0], "clip_frac_first": clip_fracs[0],
                "entropy": entropy[0] / max(entropy[1], 1.0),
                "kl": self.kl_to_base([rows[i] for i in plan.kept[: self.kl_sample_rows]]),
                "train_tokens": tokens, "updates": len(plan.batches), "dropped_rollouts": plan.dropped_rollouts,
                "dropped_rows": plan.dropped_rows, "update_s": time.perf_counter() - t0}

    def _step(self, rows: list[Row], row_advantages: list[float], batch: list[int],
              trainer_old: dict[int, list[float]] | None, clip_fracs: list[float],
              ratios: list[float], entropy: list[float]) -> tuple[float, float, int]:
        """One optimizer step on the rows ``batch`` (indices into ``rows``), gradients accumulated over
        micro-batches. Appends per-micro-batch stats to ``clip_fracs``/``ratios``, adds the sampled tokens'
        entropy sum and count to ``entropy[0]``/``entropy[1]``; returns
        ``(loss, pre-clip gradient norm, sampled tokens)``."""
        local = {i: k for k, i in enumerate(batch)}
        rindex = {rid: k for k, rid in enumerate(sorted({rows[i].rollout_id for i in batch}))}
        T = max(len(rows[i].response_ids) for i in batch)
        mask_all = torch.zeros((len(batch), T))
        for k, i in enumerate(batch):
            mask_all[k, : len(rows[i].response_mask)] = torch.tensor(rows[i].response_mask, dtype=torch.float32)
        weights_all = token_weights(mask_all, torch.tensor([rindex[rows[i].rollout_id] for i in batch]),
                                    self.loss_agg_mode)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        order = sorted(batch, key=lambda i: -len(rows[i].response_ids))
        for mb in self._micro_batches(order, rows):
            interrupt.check()  # Ctrl-C / SIGTERM: stop within one micro-batch, before the optimizer step
            mb_rows = [rows[i] for i in mb]
            lp, mask, ent = self._response_logprobs(mb_rows, entropy=True)
            entropy[0] += float((ent * mask).sum())
            entropy[1] += float(mask.sum())
            Tm = lp.shape[1]
            old = torch.zeros_like(lp)
            for j, r in enumerate(mb_rows):
                old[j, : len(r.old_logprobs)] = torch.tensor(r.old_logprobs)
            # Rows without recorded logprobs are trained on-policy (ratio 1).
            for j, r in enumerate(mb_rows):
                if not r.has_logprobs:
                    old[j] = lp[j].detach()
            adv = torch.tensor([row_advantages[i] for i in mb], dtype=torch.float32)
            is_w = None
            if trainer_old is not None:
                behaviour = old
                old = torch.zeros_like(lp)
                for j, i in enumerate(mb):
                    old[j, : len(trainer_old[i])] = torch.tensor(trainer_old[i])
                is_w = truncated_is_weights(old, behaviour, self.tis_cap)
            weights = weights_all[[local[i] for i in mb], :Tm]
            loss, st = ppo_loss(lp, old, adv, weights, is_weights=is_w, **self.clip)
            loss.backward()
            total += float(loss.detach())
            clip_fracs.append(st["clip_frac"])
            ratios.append(st["ratio_mean"])
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:  # a NaN/inf gradient would make the adapter NaN for good: this step is not taken (counted)
            self.optimizer.zero_grad(set_to_none=True)
        return total, float(grad_norm), int(mask_all.sum())

    def checkpoint(self, path: Path) -> None:
        """Write the LoRA weights (PEFT format) and the optimizer state to ``path``."""
        self.model.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), Path(path) / "optimizer.pt")

    def restore(self, path: Path) -> None:
        """Load what :meth:`checkpoint` wrote (same LoRA configuration). Raises ``FileNotFoundError``."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.model, load_file(Path(path) / "adapter_model.safetensors"))
        self.optimizer.load_state_dict(torch.load(Path(path) / "optimizer.pt", weights_only=True))

    def save(self, version: int) -> Path:
        """Write the adapter of policy ``version`` (PEFT ``save_pretrained``) and return its directory."""
        path = self.out_dir / policy_name(version, self.role)
        self.model.save_pretrained(path)
        return path

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The policy as plain weights: every LoRA layer's ``W + delta`` (PEFT ``get_delta_weight``: ``B A *
        alpha / r``), every other base parameter as it is, in the engine's dtype, named as in the base
        checkpoint (``lm_head.weight`` left out when tied to the embeddings). The model is not changed."""
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, mod in base.named_modules():
                if isinstance(mod, LoraLayer):
                    out[f"{name}.weight"] = (mod.base_layer.weight + mod.get_delta_weight("default")).to(
                        self.engine_dtype).contiguous()
            for name, p in base.state_dict().items():
                clean = name.replace(".base_layer.", ".")
                if "lora_" in name or clean in out or (self.tied and clean == "lm_head.weight"):
                    continue
                out[clean] = p.to(self.engine_dtype).contiguous().clone()
        return out

    def save_merged(self, version: int) -> Path:
        """Write :meth:`merged_weights` to ``{out_dir}/merged/policy-v{version}/model.safetensors``; returns
        the directory."""
        from safetensors.torch import save_file

        path = self.out_dir / "merged" / policy_name(version)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.merged_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    # ------------------------------------------------------------------ serving (merged reload or LoRA hot-load)
    async def publish(self, version: int) -> Policy:
        """Make every engine serve the current policy as ``version``; returns the policy that routes to it (served
        under the base name when merged, as ``policy-v{version}`` as an adapter). The adapter is saved either way."""
        path = await compute.run(self.save, version)
        if self.serving == "merged":
            return Policy(model=await self._reload(version), version=version)
        return Policy(model=await self._load(version, path), version=version)

    async def serve(self, version: int) -> Policy:
        """:meth:`serve_name` as the policy that routes to it."""
        return Policy(model=await self.serve_name(version), version=version)

    async def serve_name(self, version: int) -> str:
        """Serve the saved policy ``version`` (a resumed run: the model was restored to it); version 0 is the
        base model (merged: its weights are reloaded, so an engine left serving another policy, by a run that
        was killed, serves the base again)."""
        if self.serving == "merged":
            if version == 0:
                from ..cycle import reload_weights

                if self.engine_url:
                    await reload_weights(self.engine_url, self.base_dir)
                return self.model_name
            return await self._reload(version)
        if version == 0:
            return self.model_name
        return await self._load(version, self.out_dir / policy_name(version, self.role))

    async def _reload(self, version: int) -> str:
        from ..cycle import reload_weights

        if not self.engine_url:
            raise ValueError("CpuBackend has no engine_url to load weights into")
        path = await compute.run(self.save_merged, version)
        await reload_weights(self.engine_url, path)
        return self.model_name

    async def _load(self, version: int, path: Path) -> str:
        from ..cycle import load_adapter

        if not self.engine_url:
            raise ValueError("CpuBackend has no engine_url to load adapters into")
        name = policy_name(version, self.role)
        await load_adapter(self.engine_url, name, path)
        return name

    async def retire(self, version: int) -> None:
        """Drop what served ``version`` once a newer one serves: its adapter from the engines, or its merged
        copy from disk (the base model, version 0, stays)."""
        import shutil

        from ..cycle import unload_adapter

        if version < 1:
            return
        if self.serving == "merged":
            shutil.rmtree(self.out_dir / "merged" / policy_name(version), ignore_errors=True)
        elif self.engine_url:
            await unload_adapter(self.engine_url, policy_name(version, self.role))
