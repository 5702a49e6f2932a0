"""verl's own ``RayPPOTrainer`` driven with AGL's rows (verl environment only: ``.venv-verl``).

:class:`AglRayPPOTrainer` keeps everything verl sets up in ``init_workers`` (Ray resource pool, the
hybrid actor/rollout workers with their FSDP2 engine, ``LLMServerManager`` and its replicas, the
``CheckpointEngineManager``) and replaces generation: the agents call verl's inference servers through
AGL's gateway (``engine_addresses()`` = ``llm_server_manager.get_addresses()``), and a step trains on the
rows built from the gateway's records. Its ``fit()`` hands a :class:`VerlBackend` to the run loop
(:func:`agl_trainer.loop.train_async`), which does, each step::

    resume engines + gateway on version v → wait for complete groups (Redis) → pause and drain the gateway
    → backend.update: sleep_replicas → DataProto from our rows (recorded logprobs = old_log_probs,
      per-rollout advantage, loss_mode=agl_per_rollout) → _update_actor
    → backend.publish(v+1): checkpoint_manager.update_weights(v+1) (weights into the engines, engines woken)
    → gateway resumed on version v+1

Why ``RayPPOTrainer`` and not verl 0.9's "v1" trainers (``trainer.use_v1``): the v1 trainers move every
batch through TransferQueue (another service and package, ``transfer_queue``) and own the rollout loop
through their agent-loop manager; ``RayPPOTrainer`` exposes the seams AGL needs as methods
(``_update_actor``, ``_compute_old_log_prob``, ``checkpoint_manager.sleep_replicas`` /
``update_weights``, ``llm_server_manager.get_addresses``), is what Agent Lightning subclasses (for verl
≤ 0.8), and was measured to run a full step on CPU. verl marks it deprecated; when it is removed, the
same four seams exist in the v1 trainers' workers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from . import adapter

HOOK_MODULE = "agl_trainer.backends.verl.hook"


def cpu_env(extra_modules: str = "") -> dict[str, str]:
    """Environment for verl on CPU (set before ``import verl`` and ``ray.init``; Ray workers inherit it).

    ``RAY_worker_niceness=0``: Ray starts its workers at nice 15 by default (its system config
    ``worker_niceness``), which on CPU means verl's actor, rollout server and agent-loop workers get ~3% of a
    core beside any job at nice 0: the 3.5-minute test run did not finish in 15 minutes beside two busy loops.
    """
    modules = ",".join(m for m in (HOOK_MODULE, extra_modules) if m)
    return {"AGL_VERL_CPU": "1", "VERL_PLATFORM": "agl_cpu", "VERL_USE_EXTERNAL_MODULES": modules,
            "RAY_worker_niceness": "0",
            "VERL_USE_EXTERNAL_PLUGINS": "none", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "RAY_DEDUP_LOGS": "0", "WANDB_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


def verl_overrides(model_path: str | Path, *, ranks: int = 1, lr: float = 1e-4, lora_rank: int = 8,
                   lora_alpha: int = 16, clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                   max_prompt_tokens: int = 512, max_response_tokens: int = 256, temperature: float = 1.0,
                   steps: int = 1, cpu: bool = True, rollout: str = "agl_cpu", seed: int = 0,
                   out_dir: str | Path = "runs/verl") -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer`` config for AGL (see docs/verl.md for the mapping).

    ``cpu``: fp32 everywhere (recomputed logprobs then match the engine's to ~1e-6), ``trainer.device=cpu``,
    the ``agl_cpu`` rollout, gloo. On GPU pass ``cpu=False, rollout="vllm"``.
    """
    o = [
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.model.lora_rank={lora_rank}", f"actor_rollout_ref.model.lora_alpha={lora_alpha}",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={adapter.VERL_LOSS_NAME}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.clip_ratio_low={clip_low}", f"actor_rollout_ref.actor.clip_ratio_high={clip_high}",
        f"actor_rollout_ref.actor.clip_ratio_c={clip_c}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.shuffle=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ranks}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        f"actor_rollout_ref.rollout.name={rollout}", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.prompt_length={max_prompt_tokens}",
        f"actor_rollout_ref.rollout.response_length={max_response_tokens}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "reward.num_workers=1",
        f"data.max_prompt_length={max_prompt_tokens}", f"data.max_response_length={max_response_tokens}",
        f"data.train_batch_size={ranks}", "data.dataloader_num_workers=0",
        "trainer.logger=[console]", "trainer.val_before_train=False", "trainer.use_v1=False",
        "trainer.balance_batch=False", f"trainer.total_training_steps={steps}", "trainer.total_epochs=1",
        f"trainer.n_gpus_per_node={ranks}", "trainer.nnodes=1", "trainer.save_freq=-1",
        f"trainer.default_local_dir={Path(out_dir) / 'verl_checkpoints'}",
        f"actor_rollout_ref.actor.fsdp_config.seed={seed}",
    ]
    if not cpu:  # one GPU: vLLM shares it with the FSDP actor (sleep mode frees it during the update)
        o += ["actor_rollout_ref.rollout.gpu_memory_utilization=0.4", "actor_rollout_ref.rollout.enforce_eager=True",
              "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.max_num_seqs=32",
              "actor_rollout_ref.rollout.free_cache_engine=True"]
    if cpu:
        o += ["trainer.device=cpu", "+actor_rollout_ref.model.override_config.attn_implementation=eager",
              "actor_rollout_ref.model.use_remove_padding=False",
              "actor_rollout_ref.model.enable_gradient_checkpointing=False",
              "actor_rollout_ref.actor.fsdp_config.dtype=float32",
              "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
              "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,"
              "buffer_dtype:fp32}",
              "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
              "actor_rollout_ref.actor.use_torch_compile=False",
              "actor_rollout_ref.rollout.free_cache_engine=True"]
    return o


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def initial_adapter(model_path: str | Path, out_dir: Path, lora_rank: int, lora_alpha: int, seed: int) -> Path:
    """A freshly initialized LoRA adapter (PEFT layout) for verl to start from
    (``actor_rollout_ref.model.lora_adapter_path``). Returns its directory; an existing one is reused.

    verl initializes LoRA with an unseeded random ``A``, so two verl runs (or 1 and 2 ranks) would start from
    different policies-to-be; this adapter is seeded with ``seed`` (``torch.manual_seed``) and targets the
    same modules as the CPU backend, so runs with the same seed start from the same adapter.
    """
    out = Path(out_dir)
    if (out / "adapter_config.json").exists():
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0,
                                            task_type="CAUSAL_LM", target_modules=LORA_TARGETS))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def compose_config(overrides: list[str]):
    """verl's ``ppo_trainer`` config (its own YAML, via Hydra) with ``overrides`` applied."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


class _Placeholder(torch.utils.data.Dataset):
    """RayPPOTrainer builds dataloaders; AGL's data comes from Redis, so these are never iterated."""

    def __init__(self, n: int = 1):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"agl_placeholder": i}


def build_trainer(config, loop=None):
    """An :class:`AglRayPPOTrainer` with verl's standard worker set-up (``main_ppo_v0.TaskRunner``'s).

    Call :meth:`AglRayPPOTrainer.init_workers` next (needs ``ray.init`` first).
    """
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.workers.config import HFModelConfig

    OmegaConf.resolve(config)
    runner = BaseTaskRunner()
    _, worker_group_cls = runner.add_actor_rollout_worker(config)
    runner.add_reward_model_resource_pool(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    n = int(config.data.train_batch_size)  # verl checks it against the DP size; never iterated
    trainer_cls = _trainer_class()
    trainer = trainer_cls(config=config, tokenizer=model_config.tokenizer, processor=model_config.processor,
                          role_worker_mapping=runner.role_worker_mapping,
                          resource_pool_manager=runner.init_resource_pool_mgr(config),
                          ray_worker_group_cls=worker_group_cls, train_dataset=_Placeholder(n),
                          val_dataset=_Placeholder(n), collate_fn=lambda xs: {"agl": list(xs)},
                          train_sampler=torch.utils.data.SequentialSampler(range(n)))
    trainer.agl_loop = loop
    return trainer


_TRAINER_CLS = None


def _trainer_class():
    """Defined lazily: the base class lives in verl."""
    global _TRAINER_CLS
    if _TRAINER_CLS is not None:
        return _TRAINER_CLS
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    class AglRayPPOTrainer(RayPPOTrainer):
        """``RayPPOTrainer`` whose ``fit()`` runs AGL's loop (``self.agl_loop(backend)``) on AGL's rows."""

        agl_loop = None

        def engine_addresses(self) -> list[str]:
            """``host:port`` of verl's inference servers (one per replica), for the gateway's upstream."""
            return list(self.llm_server_manager.get_addresses())

        def fit(self):
            if self.agl_loop is None:
                raise RuntimeError("AglRayPPOTrainer.fit needs agl_loop (a callable taking the backend)")
            return self.agl_loop(VerlBackend(self))

    _TRAINER_CLS = AglRayPPOTrainer
    return AglRayPPOTrainer


class VerlBackend:
    """AGL's backend interface over a running :class:`AglRayPPOTrainer` (see :mod:`agl_trainer.backends`).

    ``update(rows, row_advantages)`` puts verl's engines to sleep and runs one PPO update of verl's actor on
    the rows (one mini-batch: the per-rollout weights are normalized over the whole batch); ``publish(v)``
    syncs the weights into the engines and wakes them (``update_weights(v)``), after which the gateway may
    route to version ``v``. Checkpoints go through verl's own ``_save_checkpoint`` / ``_load_checkpoint``.

    Args:
        trainer: the trainer, after ``init_workers``.
        check_logprobs: also recompute the batch's logprobs with verl's actor before the update and report
            ``logprob_max_abs_diff`` against the recorded ones (one extra forward pass).
        report_kl: report ``kl`` to the base model after the update (two more forward passes).
    """

    name = "verl"

    def __init__(self, trainer, check_logprobs: bool = True, pad_id: int | None = None,
                 model_name: str = "smollm2", report_kl: bool = True):
        self.trainer = trainer
        self.report_kl = report_kl
        self.model_name = model_name
        self.loss_agg_mode = "rollout-mean"  # TrainConfig.loss_agg_mode, set by the run
        self.check_logprobs = check_logprobs
        tok = trainer.tokenizer
        self.pad_id = pad_id if pad_id is not None else (tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.dp_size = int(trainer.config.trainer.n_gpus_per_node) * int(trainer.config.trainer.nnodes)
        self.events: list[tuple[str, float]] = []
        self.last_batch = None  # the DataProto of the last update
        self.step_checks: list[dict] = []  # per update: its stats without verl's raw metrics
        self.started_at: float = 0.0

    def _mark(self, event: str) -> None:
        self.events.append((event, time.time()))

    def engine_addresses(self) -> list[str]:
        return self.trainer.engine_addresses()

    def start(self, version: int = 0) -> None:
        """Load weights into the engines and wake them (verl's ``fit`` does ``update_weights(0)`` first)."""
        self.sync(version)
        self.started_at = time.time()

    def dataproto(self, rows, row_advantages, group_of: dict[str, str] | None = None):
        """Rows → a verl ``DataProto`` ready for ``_update_actor`` (padded to a multiple of the DP size with
        zero-weight copies of the first row; ``meta_info`` as verl's own loop sets it)."""
        rows, row_advantages = list(rows), list(row_advantages)
        group_of = group_of or {r.rollout_id: r.rollout_id for r in rows}
        batch = adapter.rows_to_batch(rows, row_advantages, group_of, pad_id=self.pad_id,
                                      loss_agg_mode=self.loss_agg_mode)
        n_pad = (-len(rows)) % self.dp_size
        if n_pad:
            t, nt = batch["tensors"], batch["non_tensors"]
            for k, v in t.items():
                extra = v[:1].repeat(n_pad, *([1] * (v.dim() - 1)))
                if k in ("response_mask", "advantages", "rollout_is_weights"):
                    extra = torch.zeros_like(extra)
                t[k] = torch.cat([v, extra])
            for k in nt:
                nt[k] = list(nt[k]) + [f"agl-pad-{i}" for i in range(n_pad)]
        data = adapter.to_dataproto(batch)
        cfg = self.trainer.config.actor_rollout_ref.rollout
        data.meta_info["temperature"] = cfg.temperature
        data.meta_info["global_token_num"] = torch.sum(data.batch["attention_mask"], dim=-1).tolist()
        return data

    def update(self, rows, row_advantages, group_of: dict[str, str] | None = None) -> dict[str, Any]:
        """``sleep_replicas`` → batch from the rows → :meth:`update_batch`. With ``AGL_VERL_SAVE_BATCHES``
        set to a directory, each batch is also saved there as ``step-{n}.pt`` (``DataProto``, pickled)."""
        free_before = _device_free_gb()
        t0 = time.perf_counter()
        self.trainer.checkpoint_manager.sleep_replicas()
        self._mark("sleep")
        sleep_s = time.perf_counter() - t0
        free_after = _device_free_gb()
        data = self.dataproto(rows, row_advantages, group_of)
        self.last_batch = data
        save = os.environ.get("AGL_VERL_SAVE_BATCHES")
        if save:
            Path(save).mkdir(parents=True, exist_ok=True)
            torch.save(data, Path(save) / f"step-{len(self.step_checks) + 1}.pt")
        stats = self.update_batch(data)
        stats["sleep_s"] = sleep_s
        if free_before is not None:  # CUDA: what sleep_replicas gave back (the engine's weights and KV cache)
            stats["gpu_free_gb_before_sleep"], stats["gpu_free_gb_after_sleep"] = free_before, free_after
        self.step_checks.append({k: v for k, v in stats.items() if k != "verl_metrics"})
        return stats

    def update_batch(self, data) -> dict[str, Any]:
        """(optional logprob check) → ``_update_actor`` on a ``DataProto`` from :meth:`dataproto`. Returns
        ``loss``, ``grad_norm``, ``clip_frac``, ``ratio_mean`` (verl's ``actor/*`` metrics of its single
        mini-batch), ``update_s``, ``verl_metrics`` (all of them), and with ``check_logprobs``
        ``logprob_max_abs_diff`` / ``logprob_mean_abs_diff`` (recorded vs verl's recomputation, nats, over
        sampled tokens of rows with recorded logprobs)."""
        from omegaconf import open_dict

        t1 = time.perf_counter()
        stats: dict[str, Any] = {}
        if self.check_logprobs:
            recomputed, _ = self.trainer._compute_old_log_prob(data)
            mask = data.batch["response_mask"].bool() & data.batch["agl_has_logprobs"].unsqueeze(1)
            diff = (recomputed.batch["old_log_probs"] - data.batch["old_log_probs"]).abs()[mask]
            stats["logprob_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
            stats["logprob_mean_abs_diff"] = float(diff.mean()) if diff.numel() else 0.0
        with open_dict(self.trainer.config):
            # one PPO mini-batch = the whole step (our per-rollout weights are normalized over it)
            self.trainer.config.actor_rollout_ref.actor.ppo_mini_batch_size = len(data)
        out = self.trainer._update_actor(data)
        self._mark("update")
        m = out.meta_info["metrics"]

        def first(key):
            v = m.get(key)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            return float(v) if v is not None else None

        stats.update({"loss": first("actor/pg_loss"), "grad_norm": first("actor/grad_norm"),
                      "clip_frac": first("actor/pg_clipfrac"), "ratio_mean": first("actor/agl_ratio_mean"),
                      # one PPO mini-batch per step: its ratio and clip fraction are the first ones
                      "ratio_first": first("actor/agl_ratio_mean"), "clip_frac_first": first("actor/pg_clipfrac"),
                      "kl": self.kl_to_base(data) if self.report_kl else None,
                      "update_s": time.perf_counter() - t1,
                      "verl_metrics": {k: (v if isinstance(v, (int, float)) else
                                           [float(x) for x in v] if isinstance(v, (list, tuple)) else str(v))
                                       for k, v in m.items()}})
        return stats

    def kl_to_base(self, data) -> float:
        """Mean per-token KL(π‖π_base) over the batch's sampled tokens after the update (nats): the k3
        estimator ``E[exp(d) - d - 1]``, ``d = log π_base - log π`` (Schulman 2020, as the CPU backend), with
        ``π_base`` = verl's actor with the LoRA adapter disabled (``_compute_ref_log_prob``)."""
        now, _ = self.trainer._compute_old_log_prob(data)
        base = self.trainer._compute_ref_log_prob(data)
        d = base.batch["ref_log_prob"] - now.batch["old_log_probs"]
        mask = data.batch["response_mask"].bool()
        k3 = (d.exp() - d - 1)[mask]
        return float(k3.mean()) if k3.numel() else 0.0

    def sync(self, version: int) -> None:
        """``update_weights(version)``: the actor's weights (LoRA adapter) into every engine, engines woken."""
        self.trainer.checkpoint_manager.update_weights(version)
        self._mark("wake")

    async def publish(self, version: int) -> "Policy":
        """:meth:`sync` (in a worker thread); the served name does not change (verl's servers hold one policy)."""
        import asyncio

        from agl_common.schemas import Policy

        await asyncio.to_thread(self.sync, version)
        if self.step_checks and self.last_batch is not None:
            self.step_checks[-1]["engine_logprob_change"] = await asyncio.to_thread(self._engine_change)
        return Policy(model=self.model_name, version=version)

    @staticmethod
    def _served_model(base: str) -> str:
        import httpx

        return httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]["id"]

    def _engine_change(self) -> float:
        """Largest change (nats) of the engine's logprobs of the last batch's first row: recorded (the
        policy that sampled it) vs the engine now serving the published weights (``agl_cpu`` only)."""
        import httpx

        b = self.last_batch.batch
        prompt = b["prompts"][0][b["attention_mask"][0][: b["prompts"].shape[1]].bool()].tolist()
        n = int(b["attention_mask"][0][b["prompts"].shape[1]:].sum())
        response = b["responses"][0][:n].tolist()
        base = f"http://{self.engine_addresses()[0]}"
        if self.trainer.config.actor_rollout_ref.rollout.name == "agl_cpu":
            r = httpx.post(f"{base}/agl/score", timeout=300,
                           json={"prompt_ids": prompt, "response_ids": response,
                                 "temperature": self.trainer.config.actor_rollout_ref.rollout.temperature})
            r.raise_for_status()
            now = torch.tensor(r.json()["logprobs"])
        else:  # vLLM: the logprobs of the given tokens as prompt logprobs (not run here: no GPU)
            r = httpx.post(f"{base}/v1/completions", timeout=300,
                           json={"model": self._served_model(base), "prompt": prompt + response, "max_tokens": 1,
                                 "prompt_logprobs": 0, "temperature": 1.0})
            r.raise_for_status()
            plp = r.json()["choices"][0]["prompt_logprobs"][len(prompt):]
            now = torch.tensor([float(next(iter(d.values()))["logprob"]) if isinstance(d, dict) else 0.0
                                for d in plp])
        mask = b["response_mask"][0][:n].bool()
        return float((now - b["old_log_probs"][0][:n]).abs()[mask].max())

    async def serve(self, version: int) -> "Policy":
        return await self.publish(version)

    async def retire(self, version: int) -> None:
        return None

    def checkpoint(self, path: Path) -> None:
        """verl's own checkpoint of the actor (model, optimizer) under ``path``."""
        from omegaconf import open_dict

        with open_dict(self.trainer.config):
            self.trainer.config.trainer.default_local_dir = str(path)
        self.trainer.global_steps = max(1, int(getattr(self.trainer, "global_steps", 0) or 0))
        self.trainer._save_checkpoint()

    def restore(self, path: Path) -> None:
        from omegaconf import open_dict

        with open_dict(self.trainer.config):
            self.trainer.config.trainer.default_local_dir = str(path)
            self.trainer.config.trainer.resume_mode = "auto"
        self.trainer._load_checkpoint()


def _device_free_gb() -> float | None:
    """Free memory of CUDA device 0 in GiB (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(0)
    return free / 2**30


def init_ray(ranks: int, env: dict[str, str]) -> None:
    """Local Ray with ``ranks`` CPU "devices" (Ray's logical GPU resource, see ``hook.CPU_SLOT``) and
    ``env`` for its workers."""
    import ray

    os.environ.update(env)
    ray.init(num_cpus=max(4, 3 * ranks + 4), num_gpus=ranks, include_dashboard=False,
             runtime_env={"env_vars": {**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
             log_to_driver=os.environ.get("AGL_VERL_QUIET") != "1", ignore_reinit_error=True)
