"""``agl-controller run --mode local|k8s ...``"""

from __future__ import annotations

import asyncio
import logging
import signal

import typer
from agl_common.settings import DEFAULT_PREFIX, DEFAULT_REDIS_URL

app = typer.Typer(add_completion=False, help="AGL controller: one harness run per rollout.")


@app.callback()
def _main() -> None:
    """AGL controller."""


@app.command()
def run(
    command: str = typer.Option(..., "--command", envvar="AGL_COMMAND", help="harness command line"),
    mode: str = typer.Option("local", envvar="AGL_MODE", help="local | k8s"),
    gateway: str = typer.Option("http://127.0.0.1:8080", envvar="AGL_GATEWAY_URL", help="gateway base URL"),
    model: str = typer.Option("agl-policy", envvar="AGL_MODEL", help="model name handed to the harness"),
    redis: str = typer.Option(DEFAULT_REDIS_URL, envvar="AGL_REDIS_URL"),
    prefix: str = typer.Option(DEFAULT_PREFIX, envvar="AGL_PREFIX"),
    concurrency: int = typer.Option(4, envvar="AGL_CONCURRENCY", min=1),
    timeout: float = typer.Option(300.0, envvar="AGL_TIMEOUT", help="seconds per run"),
    key: str = typer.Option(None, envvar="AGL_KEY", help="gateway admin key (to derive scoped keys)"),
    reward_fn: str = typer.Option(None, envvar="AGL_REWARD_FN", help="module:function(input, output) -> float"),
    log_dir: str = typer.Option("runs/logs", envvar="AGL_LOG_DIR"),
) -> None:
    """Run queued rollouts until SIGINT/SIGTERM."""
    if mode != "local":
        typer.echo(f"mode {mode!r} is not available in this release; use --mode local", err=True)
        raise typer.Exit(2)
    from agl_common.store import Store

    from .local import LocalRunner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    async def main() -> None:
        store = Store(redis, prefix)
        runner = LocalRunner(store, gateway, command, model, concurrency=concurrency, timeout_s=timeout, key=key,
                             reward_fn=reward_fn, log_dir=log_dir)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await runner.run_forever(stop)
        finally:
            await store.close()

    asyncio.run(main())


def main() -> None:
    app()
