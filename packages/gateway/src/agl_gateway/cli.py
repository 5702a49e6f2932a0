"""``agl-gateway serve``: every option also read from ``AGL_*`` environment variables (CONTRACT §4)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import sys

import typer

from .settings import GatewaySettings

app = typer.Typer(add_completion=False, help="AGL gateway: an OpenAI-compatible proxy that records every call.")
_D = GatewaySettings.model_fields



def _say(text: str) -> None:
    """One message on stderr, its control characters but newlines escaped (:func:`agl_common.settings.printable`: a
    Redis server's error text or a user's URL held terminal escapes)."""
    from agl_common.settings import printable

    typer.echo(printable(text, "\n"), err=True)

@app.callback()
def _main() -> None:
    """AGL gateway."""


@app.command()
def serve(
    upstream: str = typer.Option(_D["upstream"].default, envvar="AGL_UPSTREAM",
                                 help="engine base URL (OpenAI-compatible, e.g. vLLM), /v1 optional"),
    model: str = typer.Option(None, envvar="AGL_MODEL", help="public model name (default: the engine's first)"),
    redis: str = typer.Option(_D["redis_url"].default, envvar="AGL_REDIS_URL", help="Redis URL"),
    prefix: str = typer.Option(_D["prefix"].default, envvar="AGL_PREFIX", help="Redis key prefix"),
    host: str = typer.Option(_D["host"].default, envvar="AGL_HOST"),
    port: int = typer.Option(_D["port"].default, envvar="AGL_PORT", min=0, max=65535),
    key: str = typer.Option(None, envvar="AGL_KEY", help="admin key; enables auth and rollout-scoped keys"),
    open_: bool = typer.Option(False, "--open", envvar="AGL_OPEN", help="create rollouts on first use"),
    max_hold: float = typer.Option(_D["max_hold"].default, envvar="AGL_MAX_HOLD",
                                   help="seconds a call may be held by a pause before 503"),
    max_body_bytes: int = typer.Option(_D["max_body_bytes"].default, envvar="AGL_MAX_BODY_BYTES"),
    max_calls_per_attempt: int = typer.Option(_D["max_calls_per_attempt"].default, envvar="AGL_MAX_CALLS_PER_ATTEMPT",
                                              help=_D["max_calls_per_attempt"].description),
    max_in_flight_per_attempt: int = typer.Option(_D["max_in_flight_per_attempt"].default,
                                                  envvar="AGL_MAX_IN_FLIGHT_PER_ATTEMPT",
                                                  help=_D["max_in_flight_per_attempt"].description),
    max_record_bytes_per_attempt: int = typer.Option(_D["max_record_bytes_per_attempt"].default,
                                                     envvar="AGL_MAX_RECORD_BYTES_PER_ATTEMPT",
                                                     help=_D["max_record_bytes_per_attempt"].description),
    otel: bool = typer.Option(_D["otel"].default, "--otel", envvar="AGL_OTEL",
                              help="emit an OpenTelemetry GenAI span per model call (OTLP/HTTP; configured by the "
                              "standard OTEL_* variables)"),
    log_level: str = typer.Option("warning", envvar="AGL_LOG_LEVEL",
                                  help="critical, error, warning, info, debug or trace (uvicorn's levels)"),
) -> None:
    """Serve the gateway (uvicorn, one process)."""
    from pydantic import ValidationError
    from uvicorn.config import LOG_LEVELS

    from agl_common.store import StoreRefused

    from agl_common.settings import printable_log_records

    from .app import ReplicaIdLive, create_app

    printable_log_records()  # (a Redis server's or an engine's text in a log line drives no terminal)
    if log_level.lower() not in LOG_LEVELS:  # (uvicorn's KeyError traceback)
        _say(f"error: --log-level / AGL_LOG_LEVEL {log_level!r}: one of {', '.join(LOG_LEVELS)}")
        raise typer.Exit(2)
    log_level = log_level.lower()

    try:
        settings = GatewaySettings(upstream=upstream, model=model, redis_url=redis, prefix=prefix, host=host,
                                   port=port, key=key, open=open_, max_hold=max_hold,
                                   max_body_bytes=max_body_bytes, max_calls_per_attempt=max_calls_per_attempt,
                                   max_record_bytes_per_attempt=max_record_bytes_per_attempt,
                                   max_in_flight_per_attempt=max_in_flight_per_attempt, otel=otel)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        _say(f"error: invalid gateway settings: {errors}")
        raise typer.Exit(2) from None
    try:  # (the app's start-up checks again: for apps made in-process; this is the CLI's one-line refusal)
        asyncio.run(_claim(settings))
    except (ReplicaIdLive, StoreRefused) as exc:
        _say(f"error: {exc}")
        raise typer.Exit(2) from None
    run_server(create_app(settings), host=host, port=port, log_level=log_level)


async def _claim(settings: GatewaySettings) -> None:
    from agl_common.store import Store
    from redis.exceptions import RedisError

    from .app import claim_replica_id

    store = Store(settings.redis_url, settings.prefix, max_connections=2)
    owner = secrets.token_hex(8)
    try:  # a check only: the app takes the id itself when it starts
        await claim_replica_id(store, settings.replica_id, owner)
        with contextlib.suppress(RedisError, OSError):
            await store.drop_replica(settings.replica_id, owner)
    finally:
        await store.close()


def run_server(app_, **config) -> None:
    """Serve ``app_`` with :class:`GatewayServer`; ``config``: more :class:`uvicorn.Config` keywords.

    httptools (cheaper per request than h11) with the request line + headers bounded (64 KiB, then 431:
    httptools alone buffers a header of any size). A SIGTERM during a pause answers held calls 503 instead
    of waiting for them; calls still waiting on the engine 10 s after a SIGTERM are cancelled (unrecorded,
    so unacknowledged: agents retry).
    """
    import uvicorn

    from .server import BoundedHttpToolsProtocol, GatewayServer

    server = GatewayServer(uvicorn.Config(app_, access_log=False, http=BoundedHttpToolsProtocol,
                                          timeout_graceful_shutdown=10, **config))
    # Bind before the app starts: a port in use (or not a port) exits at once (uvicorn's startup-failure
    # code 3, its error logged), before any replica heartbeats or holds a Redis connection. Bound after
    # start-up, the failed bind ran the app's shutdown from inside its start-up and hung there for good.
    server.run(sockets=[server.config.bind_socket()])


def main() -> None:
    """The ``agl-gateway`` entry point: its key and a Redis password are hidden from ``/proc`` first
    (:func:`agl_common.proc_secrets.hide_from_proc`)."""
    from agl_common.proc_secrets import argv_secrets, hide_from_proc, scrub_argv

    args = sys.argv[1:]  # (parsed from this copy: sys.argv itself reaches multiprocessing children)
    secrets = argv_secrets(args)
    hide_from_proc(secrets)  # a harness reads /proc/<pid>/{cmdline,environ}
    scrub_argv(secrets)
    app(args=args)
