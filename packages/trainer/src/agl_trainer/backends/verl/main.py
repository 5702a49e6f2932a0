"""``agl-trainer train CONFIG --backend verl``, in the verl environment: ``python -m agl_trainer.backends.verl.main``.

Order: Ray and verl's workers first (``init_workers``: FSDP2 actor, inference servers), then the gateway
pointed at verl's servers (``get_addresses()``) and the controller (both run by the main environment's
Python, ``$AGL_MAIN_PYTHON``), then ``fit()``: AGL's run loop (:func:`agl_trainer.loop.train_async`) with a
:class:`~agl_trainer.backends.verl.trainer.VerlBackend`. At the end ``{run_dir}/verl.json`` records the
engines' addresses, every engine's event log (sleep / weights / wake, wall-clock), the backend's events
and the per-step logprob check.

``--replay BATCH --out JSON``: no services; start verl with ``--ranks`` ranks, train once on a saved batch
(``AGL_VERL_SAVE_BATCHES`` makes a run save each step's batch) and write its stats (the 1-vs-2-rank check).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


def verl_python() -> Path | None:
    """The verl environment's Python: ``$AGL_VERL_PYTHON``, else ``.venv-verl/bin/python`` in the current
    directory or the repository this package lives in (None if none exists)."""
    env = os.environ.get("AGL_VERL_PYTHON")
    if env:
        return Path(env)
    for root in (Path.cwd(), Path(__file__).resolve().parents[6]):
        py = root / ".venv-verl" / "bin" / "python"
        if py.exists():
            return py
    return None


def _trainer(cfg, ranks: int, run_dir: Path, loop, cpu: bool):
    from ...model import ensure_base_model
    from .trainer import build_trainer, compose_config, initial_adapter, verl_overrides

    base = ensure_base_model(cfg.base_model)
    adapter = initial_adapter(base, run_dir / "adapters" / "initial", cfg.lora_rank, cfg.lora_alpha, cfg.seed)
    overrides = verl_overrides(
        base, ranks=ranks, lr=cfg.lr, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_c if cfg.clip_c is not None else 1e9,
        max_prompt_tokens=cfg.max_prompt_tokens or 1024, max_response_tokens=cfg.max_response_tokens or 1024,
        steps=max(1, cfg.steps), cpu=cpu, rollout="agl_cpu" if cpu else "vllm", seed=cfg.seed, out_dir=run_dir)
    overrides += [f"actor_rollout_ref.model.lora_adapter_path={adapter}"]
    overrides += list(getattr(cfg, "verl_overrides", None) or [])
    return build_trainer(compose_config(overrides), loop)


def _server_events(addresses: list[str]) -> dict:
    import ray

    from .rollout import server_name

    out = {}
    for rank in range(len(addresses)):
        try:
            out[addresses[rank]] = ray.get(ray.get_actor(server_name(rank)).events.remote(), timeout=30)
        except Exception as e:  # noqa: BLE001 - a GPU rollout (vLLM) has no such actor
            out[addresses[rank]] = f"no agl_cpu server: {type(e).__name__}"
    return out


def run(config_path: Path, run_dir: Path, ranks: int, cpu: bool, resume: bool = False) -> dict:
    """The whole verl run (services included). Returns the loop's summary."""
    from agl_common.settings import redacted_url

    from ...checkpoint import resume_state
    from ...config import TrainConfig
    from ...loop import train_async
    from ...lease import TrainerLease
    from ...model import ensure_base_model, load_vocabulary
    from ...report import output_console
    from ...services import Services
    from ...stack import start_agents
    from .adapter import engine_upstream
    from .trainer import VerlBackend, cpu_env, init_ray

    cfg = TrainConfig.from_yaml(config_path).with_fields(backend="verl")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.shown(), indent=2))
    state = resume_state(run_dir) if resume else None  # (the CLI checked it before starting this process)
    console = output_console()
    env = cpu_env() if cpu else {"VERL_USE_EXTERNAL_MODULES": "agl_trainer.backends.verl.hook"}
    init_ray(ranks, env) if cpu else _init_ray_gpu(env)
    result: dict = {}
    t0 = time.time()

    with Services(run_dir / "logs") as svc:
        def loop(backend: VerlBackend):
            backend.model_name = cfg.model_name
            backend.loss_agg_mode = cfg.loss_agg_mode
            if state:  # before the engines are loaded: agents must never meet the un-restored policy
                backend.restore(run_dir / "checkpoint")
            backend.start(state["version"] if state else 0)
            addresses = backend.engine_addresses()
            if not cpu:  # verl's vLLM servers answer to the name they were started with
                backend.model_name = backend._served_model(f"http://{addresses[0]}")
            cfg_run = cfg.model_copy(update={"model_name": backend.model_name})
            redis_url = svc.ensure_redis(cfg.redis_url, cfg.harness_user)
            lease = TrainerLease(redis_url, cfg.prefix, run_dir.name)
            lease.take()  # (before the gateway and controller: TrainerLive if another trainer holds the prefix)
            try:
                gateway = start_agents(svc, cfg, engine_upstream(addresses), redis_url, backend.model_name,
                                       run_dir / "logs" / "rollouts", python=svc.python)
                console.print(f"verl engines {addresses}, gateway {redacted_url(gateway)}, redis "
                              f"{redacted_url(redis_url)}, run {run_dir} (verl ready after {time.time() - t0:.0f} s)")
                vocab = load_vocabulary(ensure_base_model(cfg.base_model))
                summary = asyncio.run(train_async(cfg_run, run_dir, console, redis_url, state, backend, vocab, lease))
            finally:
                lease.let_go()
                result["verl"] = {"addresses": addresses, "ranks": ranks, "server_events": _server_events(addresses),
                                  "backend_events": backend.events, "steps": backend.step_checks,
                                  "init_s": backend.started_at - t0}
                (run_dir / "verl.json").write_text(json.dumps(result["verl"], indent=1))
            return summary

        trainer = _trainer(cfg, ranks, run_dir, loop, cpu)
        trainer.init_workers()
        return trainer.fit()


def replay(config_path: Path, batch_path: Path, out_path: Path, ranks: int) -> dict:
    """Train once on a saved ``DataProto`` with ``ranks`` ranks; writes and returns the update's stats."""
    import torch

    from ...config import TrainConfig
    from .trainer import cpu_env, init_ray

    cfg = TrainConfig.from_yaml(config_path)
    init_ray(ranks, cpu_env())
    out: dict = {}

    def loop(backend):
        backend.start(0)
        data = torch.load(batch_path, weights_only=False)
        out.update({k: v for k, v in backend.update_batch(data).items() if k != "verl_metrics"})
        out["ranks"] = ranks
        return out

    trainer = _trainer(cfg, ranks, out_path.parent, loop, cpu=True)
    trainer.init_workers()
    trainer.fit()
    out_path.write_text(json.dumps(out))
    return out


def _init_ray_gpu(env: dict[str, str]) -> None:
    import ray

    os.environ.update(env)
    ray.init(runtime_env={"env_vars": {**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
             ignore_reinit_error=True)


def main(argv: list[str] | None = None) -> int:
    from agl_common.settings import printable_log_records

    printable_log_records()  # (the lease's warnings carry a Redis server's text: no terminal escapes, as in the CLIs)
    p = argparse.ArgumentParser(prog="python -m agl_trainer.backends.verl.main", description=__doc__.split("\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (CPU processes or GPUs)")
    p.add_argument("--gpu", action="store_true", help="verl's vLLM rollout on CUDA instead of agl_cpu")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--backend", default="verl", help=argparse.SUPPRESS)
    p.add_argument("--replay", type=Path, help="a saved batch (.pt) to train on once, no services")
    p.add_argument("--out", type=Path, help="--replay: where to write the stats (JSON)")
    a = p.parse_args(argv)
    try:
        if a.replay:
            replay(a.config, a.replay, a.out or a.run_dir / "replay.json", a.ranks)
        else:
            run(a.config, a.run_dir, a.ranks, cpu=not a.gpu, resume=a.resume)
    finally:
        try:
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
