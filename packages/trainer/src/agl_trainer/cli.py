"""``agl-trainer``: train, demo, rollouts, gateway control (CONTRACT §4)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import typer
from agl_common.settings import DEFAULT_PREFIX, DEFAULT_REDIS_URL
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, help="AGL trainer: harnessed agentic RL.")
rollouts_app = typer.Typer(add_completion=False, help="Create and read rollouts and their recorded calls.")
gateway_app = typer.Typer(add_completion=False, help="Pause, resume and inspect every gateway replica.")
app.add_typer(rollouts_app, name="rollouts")
app.add_typer(gateway_app, name="gateway")

RedisOpt = typer.Option(DEFAULT_REDIS_URL, "--redis", envvar="AGL_REDIS_URL", help="Redis URL")
PrefixOpt = typer.Option(DEFAULT_PREFIX, "--prefix", envvar="AGL_PREFIX", help="Redis key prefix")
# train/demo: unset means "the config's value" (which defaults to the same URL and prefix)
RunRedisOpt = typer.Option(None, "--redis", envvar="AGL_REDIS_URL", help="Redis URL (overrides the config)")
RunPrefixOpt = typer.Option(None, "--prefix", envvar="AGL_PREFIX", help="Redis key prefix (overrides the config)")


def _redis_overrides(redis: str | None, prefix: str | None) -> dict:
    return {k: v for k, v in {"redis_url": redis, "prefix": prefix}.items() if v is not None}
# Not a terminal (a pipe, a log): don't wrap or cut ids at 80 columns.
console = Console() if sys.stdout.isatty() else Console(width=250)
err = Console(stderr=True)


def _store(redis: str, prefix: str):
    from agl_common.store import Store

    return Store(redis, prefix)


def _sigterm_as_interrupt() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _run(cfg, resume_dir: Path | None = None) -> None:
    from .run import run_training

    _sigterm_as_interrupt()
    try:
        run_training(cfg, console, resume_dir)
    except KeyboardInterrupt:
        err.print("interrupted: every service this run started has been stopped")
        raise typer.Exit(130) from None
    except TimeoutError as exc:  # DrainTimeout included: a replica that never drains
        err.print(f"error: {exc}\nA gateway replica listed here is still heartbeating but not draining (a "
                  "gateway left from a killed run?): stop it, or wait 5 s after it dies, and resume with "
                  "--resume RUN_DIR. `agl-trainer gateway status` lists the replicas.")
        raise typer.Exit(1) from None


@app.command()
def train(config: Path = typer.Argument(..., exists=True, dir_okay=False, help="YAML file of TrainConfig fields"),
          resume: Path = typer.Option(None, exists=True, file_okay=False,
                                      help="continue this run directory from its last checkpoint"),
          redis: str = RunRedisOpt, prefix: str = RunPrefixOpt):
    """Train with the settings in CONFIG (missing keys take the demo defaults)."""
    from pydantic import ValidationError

    from .config import TrainConfig

    try:
        cfg = TrainConfig.from_yaml(config)
        cfg = cfg.model_validate({**cfg.model_dump(), **_redis_overrides(redis, prefix)})
    except (ValidationError, ValueError) as exc:
        err.print(f"[red]invalid config {config}[/red]: {exc}")
        raise typer.Exit(2) from None
    _run(cfg, resume)


@app.command()
def demo(
    steps: int = typer.Option(None, help="training steps (default from TrainConfig)"),
    out_dir: Path = typer.Option(None, help="where runs are written"),
    engine_url: str = typer.Option(None, help="use this running vLLM instead of starting one"),
    seed: int = typer.Option(None, help="seed of the LoRA initialization, the group order and the mini-batches"),
    redis: str = RunRedisOpt, prefix: str = RunPrefixOpt,
):
    """The CPU main job: SmolLM2-135M + OpenAI Agents SDK arithmetic agent, eval → GRPO → eval."""
    from .config import TrainConfig

    overrides = {k: v for k, v in {"steps": steps, "out_dir": out_dir, "engine_url": engine_url,
                                   "seed": seed}.items() if v is not None}
    _run(TrainConfig(**overrides, **_redis_overrides(redis, prefix)))


# ---------------------------------------------------------------------------------------------- rollouts
@rollouts_app.command("create")
def rollouts_create(
    input_json: str = typer.Option(..., "--input", help="the rollout's input, as a JSON object"),
    n: int = typer.Option(1, help="rollouts to create (one group)"),
    group: str = typer.Option(None, help="group id (default: the first rollout's id)"),
    rollout_id: str = typer.Option(None, "--id", help="rollout id (with n > 1, suffixed -0, -1...)"),
    redis: str = RedisOpt, prefix: str = PrefixOpt,
):
    """Queue rollouts for the controller; prints their ids."""
    import uuid

    from agl_common.schemas import Rollout

    try:
        inp = json.loads(input_json)
        if not isinstance(inp, dict):
            raise ValueError("input must be a JSON object")
    except ValueError as exc:
        err.print(f"[red]invalid --input[/red]: {exc}")
        raise typer.Exit(2) from None
    base = rollout_id or uuid.uuid4().hex[:12]
    ids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]

    async def main():
        store = _store(redis, prefix)
        try:
            for rid in ids:
                await store.create_rollout(Rollout(rollout_id=rid, input=inp, group_id=group or base))
        finally:
            await store.close()

    try:
        asyncio.run(main())
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    for rid in ids:
        console.print(rid)


@rollouts_app.command("list")
def rollouts_list(limit: int = typer.Option(100), as_json: bool = typer.Option(False, "--json"),
                  run: str = typer.Option(None, "--run", help="only rollouts whose id starts with this (a run id)"),
                  redis: str = RedisOpt, prefix: str = PrefixOpt):
    """The latest rollouts with their status, reward and failure."""

    async def main():
        store = _store(redis, prefix)
        try:
            ids = await store.rollout_ids()
            ids = [i for i in ids if run is None or i.startswith(run)][-limit:]
            return await store.get_rollouts(ids)
        finally:
            await store.close()

    items = asyncio.run(main())
    if as_json:
        for r in items:
            sys.stdout.write(r.model_dump_json() + "\n")
        return
    table = Table()
    for col in ("rollout", "attempt", "status", "reward", "failure", "group"):
        table.add_column(col)
    for r in items:
        table.add_row(r.rollout_id, r.attempt_id, r.status.value, "-" if r.reward is None else f"{r.reward:g}",
                      r.failure or "", r.group_id or "")
    console.print(table)


@rollouts_app.command("show")
def rollouts_show(rollout_id: str, as_json: bool = typer.Option(False, "--json"),
                  redis: str = RedisOpt, prefix: str = PrefixOpt):
    """One rollout with its recorded calls (``--json``: one JSON object)."""
    from agl_common.store import RolloutNotFound

    async def main():
        store = _store(redis, prefix)
        try:
            return await store.get_rollout(rollout_id), await store.read_calls(rollout_id)
        finally:
            await store.close()

    try:
        rollout, calls = asyncio.run(main())
    except RolloutNotFound:
        err.print(f"[red]unknown rollout {rollout_id!r}[/red]")
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps({**rollout.model_dump(mode="json"),
                                     "calls": [c.model_dump(mode="json") for c in calls]}) + "\n")
        return
    console.print(rollout.model_dump(mode="json"))
    for c in calls:
        console.print(f"call {c.attempt_id}/{c.seq} {c.route} {c.status} prompt={len(c.prompt_token_ids)} "
                      f"response={len(c.response_token_ids)} tokens, v{c.model_version}, {c.latency_ms:.0f} ms")


@rollouts_app.command("export")
def rollouts_export(rollout: str = typer.Option(None, "--rollout", help="only this rollout"),
                    run: str = typer.Option(None, "--run", help="only rollouts whose id starts with this (a run id)"),
                    redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Every recorded call as JSON Lines on standard output."""
    from agl_common.store import RolloutNotFound

    async def main():
        store = _store(redis, prefix)
        try:
            if rollout is not None:
                await store.get_rollout(rollout)
                ids = [rollout]
            else:
                ids = await store.rollout_ids()
                ids = [i for i in ids if run is None or i.startswith(run)]
            for rid in ids:
                for c in await store.read_calls(rid):
                    sys.stdout.write(c.model_dump_json() + "\n")
        finally:
            await store.close()

    try:
        asyncio.run(main())
    except RolloutNotFound:
        err.print(f"[red]unknown rollout {rollout!r}[/red]")
        raise typer.Exit(1) from None


# ---------------------------------------------------------------------------------------------- gateway
@gateway_app.command("pause")
def gateway_pause(timeout: float = typer.Option(60.0, help="seconds to wait for the drain"),
                  redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Pause every gateway replica; return once all report their in-flight calls drained."""
    from agl_common.control import DrainTimeout, pause_and_drain

    async def main():
        store = _store(redis, prefix)
        try:
            return await pause_and_drain(store, timeout)
        finally:
            await store.close()

    try:
        replicas = asyncio.run(main())
    except DrainTimeout as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    console.print(f"paused and drained: {len(replicas)} replica(s)")


@gateway_app.command("resume")
def gateway_resume(model: str = typer.Option(None, help="route new calls to this served model name"),
                   version: int = typer.Option(None, help="policy version of that model"),
                   redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Release held calls on every replica."""
    from agl_common.control import resume

    async def main():
        store = _store(redis, prefix)
        try:
            await resume(store, model, version)
        finally:
            await store.close()

    asyncio.run(main())
    console.print("resumed")


@gateway_app.command("status")
def gateway_status(redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Live replicas with paused, in-flight and held counts."""

    async def main():
        store = _store(redis, prefix)
        try:
            return await store.replicas(), await store.get_policy()
        finally:
            await store.close()

    replicas, policy = asyncio.run(main())
    console.print(f"policy: {policy.model if policy else '-'} (v{policy.version if policy else 0})")
    table = Table()
    for col in ("replica", "paused", "in flight", "held", "model"):
        table.add_column(col)
    for r in replicas:
        table.add_row(r.replica_id, str(r.paused), str(r.in_flight), str(r.held), f"{r.model} v{r.version}")
    console.print(table)


def main() -> None:
    app()
