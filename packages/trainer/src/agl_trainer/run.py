"""A whole training run: start what is missing, choose the backend, run the loop, stop everything.

Outputs in ``{out_dir}/{run_id}/``: ``metrics.jsonl`` (one JSON object per step, plus ``eval`` lines),
``summary.json``, ``accuracy_curve.png`` (held-out accuracy against minutes of training), ``adapters/policy-v{N}``,
``logs/`` (services and one log per harness run).
The loop itself is :func:`agl_trainer.loop.train_async`.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
import uuid
from pathlib import Path

from agl_common.settings import redacted_url, redacted_urls
from rich.console import Console

from .config import TrainConfig
from .checkpoint import NotResumable, logged_metrics, resume_state, run_config, weight_settings
from .loop import train_async
from .report import output_console


def new_run_id() -> str:
    """A run directory's name: ``MMDD-HHMMSS-xxxx`` (local time, 4 random hex digits)."""
    return time.strftime("%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]


def run_training(cfg: TrainConfig, console: Console | None = None, resume_dir: Path | None = None) -> dict:
    """Start missing services, train, stop them (also on Ctrl-C). Returns the summary dict.

    With ``resume_dir`` (a previous run's directory), continue that run from its last checkpoint.
    """
    from .cycle import check_engine
    from .lease import TrainerLease
    from .model import ensure_base_model, load_vocabulary
    from .services import Services
    from .stack import start_agents, start_engine

    console = console or output_console()
    run_dir = Path(resume_dir) if resume_dir else Path(cfg.out_dir) / new_run_id()
    state = resume_state(run_dir) if resume_dir else None  # NotResumable, before anything starts
    if state is not None:
        check_resumable(cfg, run_dir)
        check_cpu_checkpoint(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    held = hold_run_dir(run_dir)  # (released when this returns or raises, or when the process ends)
    try:
        if not console.is_terminal:  # a pipe or a log: no progress bars that would print as one huge line
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        from .hardware import describe

        hw = describe(cfg.dtype)
        console.print(f"CPU {hw['model']} ({hw['cores']} cores; {' '.join(hw['flags']) or 'no AVX2'}; PyTorch kernels "
                      f"{hw['capability']}): {hw['dtype']} (dtype {cfg.dtype})")
        console.print(f"run {run_dir}: {cfg.steps} steps at most ({cfg.max_train_minutes or '-'} min of training), "
                      f"{cfg.groups_per_step} groups × {cfg.group_size} rollouts per step, held-out n={cfg.eval_size}")
        # the vocabulary (merge-break classes, end-of-turn ids, the bound on ids) before any service starts: a model
        # directory's file that cannot be read is one line then (ModelFilesError), not a hang with every service up
        vocab = load_vocabulary(ensure_base_model(cfg.base_model, announce=console.print))
        with Services(run_dir / "logs") as svc, TrainerLease(svc.ensure_redis(cfg.redis_url, cfg.harness_user),
                                                             cfg.prefix, run_dir.name) as lease:
            # the prefix is this trainer's from here on: nothing another trainer uses was touched before (the engine's
            # weights, the gateway, the controller, a live run's config.json on a second --resume of it)
            redis_url = lease.redis_url
            (run_dir / "config.json").write_text(json.dumps(cfg.shown(), indent=2))
            engine, base = start_engine(svc, cfg, console, lora=cfg.policy_serving == "adapter")
            if cfg.engine_url:  # an engine this run did not start: can it swap policies? (before minutes of training)
                asyncio.run(check_engine(engine, cfg.policy_serving))
            backend = cpu_backend(cfg, base, run_dir, engine)
            # before any agent can call it: the engine serves the saved policy (or the base one)
            asyncio.run(backend.serve(state["version"] if state else 0))
            gateway = start_agents(svc, cfg, engine, redis_url, cfg.model_name, run_dir / "logs" / "rollouts")
            console.print(f"engine {redacted_urls(engine)}, gateway {redacted_url(gateway)}, "
                          f"redis {redacted_url(redis_url)}"
                          f"{' (started for this run; its URL: logs/redis.url)' if 'redis' in svc.procs else ''}, "
                          f"run {run_dir}")
            try:
                return asyncio.run(train_async(cfg, run_dir, console, redis_url, state, backend, vocab, lease))
            finally:
                # an engine this run did not start gets its base weights again (not once another trainer holds the prefix)
                if cfg.engine_url and cfg.policy_serving == "merged" and lease.lost is None:
                    try:
                        asyncio.run(backend.serve(0))
                    except Exception as exc:  # noqa: BLE001 - best effort; the next merged run reloads it anyway
                        console.print(f"could not give the engine its base weights back: {exc}")
    finally:
        held.close()


def check_resumable(cfg: TrainConfig, run_dir: Path) -> None:
    """Raise :class:`NotResumable` (one line, before any service starts) if the checkpoint of the run at
    ``run_dir`` cannot be restored into ``cfg``: its ``config.json`` cannot be read, or it was trained with other
    roles (each role's weights and optimizer are in ``checkpoint/{role}``) or other :func:`weight_settings` (a
    LoRA rank the weights do not fit, an alpha or base model that would train another policy than the engine
    serves), or a role's adapter that it served at the checkpoint is gone (:func:`~.backends.roles.missing_served`),
    or its ``metrics.jsonl`` cannot be read (:func:`~.checkpoint.logged_metrics`: a FIFO, a device, too large).
    A run without ``config.json`` is left to the checkpoint to say what is missing."""
    from .backends.roles import missing_served

    try:
        logged_metrics(run_dir)
        before = run_config(run_dir)
        if before is None:
            return
        was, now = weight_settings(before), weight_settings(cfg.shown())
    except ValueError as exc:
        raise NotResumable(f"{run_dir}: {exc}") from None
    if (before.get("backend") or "cpu") != cfg.backend:  # (another backend's checkpoint has another layout)
        raise NotResumable(f"{run_dir} was trained by the {before.get('backend')!r:.40} backend, not {cfg.backend!r}")
    if sorted(was["adapters"]) != sorted(now["adapters"]):
        raise NotResumable(f"{run_dir} was trained with roles {sorted(before.get('roles') or {}) or 'none'}, this "
                           f"config has {sorted(cfg.roles) or 'none'}: resume it with the roles it was trained with")
    changed = [f"{role + ' ' if role else ''}lora_rank/lora_alpha {str(tuple(was['adapters'][role]))[:80]} → "
               f"{tuple(now['adapters'][role])}" for role in sorted(now["adapters"])
               if was["adapters"][role] != now["adapters"][role]]
    if was["base_model"] != now["base_model"]:  # (a config.json's values cut: a 3 MiB one made a 6 MB line)
        changed.append(f"base_model {was['base_model']!r:.200} → {now['base_model']!r:.200}")
    if changed:
        raise NotResumable(f"{run_dir} was trained with other weight settings ({'; '.join(changed)}): its checkpoint "
                           "cannot be restored into this config; resume it with the settings it was trained with")
    if cfg.roles and (why := missing_served(run_dir, list(cfg.roles))):
        raise NotResumable(why)


def hold_run_dir(run_dir: Path):
    """An open file holding an exclusive ``flock`` of ``{run_dir}/.trainer.lock`` (kept while the file is open, and
    released by the kernel when the process ends, however). Raises :class:`NotResumable` if another process holds
    it: two trainers resumed one run directory under two prefixes (the lease is a prefix's), and both wrote its
    checkpoint, metrics and adapters (round 23)."""
    import fcntl

    lock = open(run_dir / ".trainer.lock", "a")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise NotResumable(f"{run_dir} is being trained by another process (its .trainer.lock is held)") from None
    return lock


def check_cpu_checkpoint(cfg: TrainConfig, run_dir: Path) -> None:
    """Raise :class:`NotResumable` (one line, before any service starts) unless each file the CPU backend restores
    (``adapter_model.safetensors`` and ``optimizer.pt`` in ``checkpoint/``, or in ``checkpoint/{role}`` for each role)
    is a regular file: a missing one was a traceback once every service was up, a FIFO a hang (round 23)."""
    for part in [run_dir / "checkpoint" / role for role in cfg.roles] or [run_dir / "checkpoint"]:
        for name in ("adapter_model.safetensors", "optimizer.pt"):
            path = part / name
            try:
                regular = stat.S_ISREG(os.stat(path).st_mode)
            except OSError as exc:
                raise NotResumable(f"{path}: {exc.strerror or type(exc).__name__}: the checkpoint is incomplete") \
                    from None
            if not regular:
                raise NotResumable(f"{path}: not a regular file")


def cpu_backend(cfg: TrainConfig, base_dir: Path, run_dir: Path, engine_url: str):
    """The CPU backend for ``cfg`` (PEFT LoRA on ``base_dir``; adapters under ``run_dir/adapters``, hot-loaded
    into ``engine_url``): one :class:`~agl_trainer.backends.cpu.CpuBackend`, or with ``cfg.roles`` a
    :class:`~agl_trainer.backends.roles.RolesBackend` of one per role (each with its role's LoRA settings).
    The verl backend is built in its own environment (:mod:`agl_trainer.backends.verl.main`)."""
    from .backends.cpu import CpuBackend
    from .backends.roles import RolesBackend
    from .hardware import choose_dtype, read_cpuinfo

    dtype = choose_dtype(cfg.dtype, read_cpuinfo())

    def one(role: str | None = None, lora_rank: int | None = None, lora_alpha: int | None = None,
            lr: float | None = None) -> CpuBackend:
        return CpuBackend(base_dir, run_dir / "adapters", lora_rank=lora_rank or cfg.lora_rank,
                          lora_alpha=lora_alpha or cfg.lora_alpha, lr=lr or cfg.lr,
                          micro_batch_tokens=cfg.micro_batch_tokens, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                          clip_c=cfg.clip_c, seed=cfg.seed, tis_cap=cfg.tis_cap, bf16=dtype == "bfloat16",
                          engine_dtype=dtype, serving=cfg.policy_serving, loss_agg_mode=cfg.loss_agg_mode,
                          ppo_mini_batch_rollouts=cfg.ppo_mini_batch_rollouts,
                          max_updates_per_step=cfg.max_updates_per_step, engine_url=engine_url,
                          model_name=cfg.model_name, role=role)

    if not cfg.roles:
        return one()
    return RolesBackend({role: one(role, rc.lora_rank, rc.lora_alpha, rc.lr) for role, rc in cfg.roles.items()},
                        cfg.base_policy())
