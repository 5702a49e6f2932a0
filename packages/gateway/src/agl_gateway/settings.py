"""Gateway settings: command-line options of ``agl-gateway serve``, each also read from ``AGL_*``."""

from __future__ import annotations

import os
import socket

from agl_common.schemas import check_served_name
from agl_common.settings import CommonSettings, check_bind_host, check_engine_key, engine_base_urls
from agl_common.store import CALLS_PER_ATTEMPT_MAX, RECORD_BYTES_PER_ATTEMPT_MAX
from pydantic import Field, field_validator, model_validator


class GatewaySettings(CommonSettings):
    """Defaults here are the single source for the CLI and the docs.

    Units: seconds for every ``*_s`` field, bytes for ``max_body_bytes`` and ``max_record_bytes_per_attempt``.
    """

    upstream: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    key: str | None = None
    open: bool = False
    max_hold: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    max_calls_per_attempt: int = Field(default=CALLS_PER_ATTEMPT_MAX, ge=1, description=(
        "model calls one attempt of a rollout may record; beyond: 403 too_many_calls (nothing forwarded)"))
    max_in_flight_per_attempt: int = Field(default=64, ge=1, description=(
        "model calls of one attempt held by a pause or in flight at once (each holds its body in memory); beyond: "
        "503 too_many_in_flight"))
    max_record_bytes_per_attempt: int = Field(default=RECORD_BYTES_PER_ATTEMPT_MAX, ge=1, description=(
        "bytes the call records of one attempt may hold in Redis; beyond: 403 too_many_bytes (a harness "
        "holding a scoped key cannot fill Redis)"))
    upstream_key: str | None = Field(default=None, description=(
        "the engine's API key, sent as `Authorization: Bearer` on every engine request (environment only: a "
        "command line is public); 16 characters or more, letters, digits and `._~+/=-` (characters no JSON or "
        "Python quoting escapes: the gateway masks it, and any prefix of 16 characters or more, in what it answers "
        "and records), with a letter other than e/E or one of `_~/=` among its first 16 (never part of a JSON "
        "number): agl_common.settings.check_engine_key"))
    upstream_timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False, description=(
        "seconds one engine call may take (0, negative or NaN would mean none: a hung engine held its calls, "
        "and every drain, for ever)"))
    heartbeat_s: float = Field(default=1.0, ge=0.05, le=4.0, allow_inf_nan=False, description=(
        "seconds between two status heartbeats (under the 5 s a replica counts as live)"))
    otel: bool = False  # one OpenTelemetry span per call (agl_gateway.otel), exporter set by OTEL_* variables
    redis_max_connections: int = Field(default=512, ge=2)  # (the control channel holds one) per replica; a call waits (up to 10 s) for a free one beyond that
    wait_replicas: int = Field(default=0, ge=0, description=(
        "replicas that must hold a call's record (Redis WAIT) before the agent gets its answer; 0: reply once "
        "the master has it (faster; a failover can lose acknowledged records)"))
    wait_timeout_ms: int = Field(default=1000, ge=0, description=(
        "how long to wait for them; fewer in time: 503 store_unavailable (the record may still exist)"))
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}", min_length=1,
                            max_length=256, pattern=r"^[!-~]+$")  # printable ASCII, no spaces: shown and keyed

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_bind_host(v)

    @field_validator("model")
    @classmethod
    def _model_is_a_served_name(cls, v: str | None) -> str | None:
        return check_served_name(v) if v else v  # ("" or none: the engine's first, discovered)

    @field_validator("upstream")
    @classmethod
    def _upstream_is_engine_urls(cls, v: str) -> str:
        import aiohttp
        from yarl import URL

        for url in engine_base_urls(v):  # ValueError for an entry that is not an http(s) URL: a usage error at start
            try:  # the user part as aiohttp sends it (latin-1, no ":" in the user): every call was a 500 before
                auth = aiohttp.BasicAuth.from_url(URL(url))
                if auth is not None:
                    auth.encode()
            except (ValueError, UnicodeError) as exc:  # (UnicodeEncodeError is a ValueError)
                raise ValueError(f"the engine URL's user part cannot be sent as Basic credentials ({type(exc).__name__}"
                                 "): latin-1 characters only, no ':' in the user") from None
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        from agl_common.store import check_redis_url

        return check_redis_url(v)

    @field_validator("key")
    @classmethod
    def _key_is_a_header_token(cls, v: str | None) -> str | None:
        """The admin key travels in an HTTP header: printable ASCII only (else no client could present it)."""
        if v is not None and not (v and v.isascii() and v.isprintable() and v.strip() == v):
            raise ValueError("the admin key must be non-empty printable ASCII without surrounding spaces")
        return v

    @field_validator("upstream_key")
    @classmethod
    def _maskable_key(cls, v: str | None) -> str | None:
        return check_engine_key(v) if v else None  # ("" sends none, as the trainer's engine_headers reads it)

    @model_validator(mode="after")
    def _one_way_to_authenticate(self) -> "GatewaySettings":
        """An engine URL with credentials (``http://user:pw@host``) and ``upstream_key`` cannot both be sent (aiohttp
        refused every engine request: 500s); refused at start."""
        from urllib.parse import urlsplit

        if self.upstream_key and any(urlsplit(u).username is not None or urlsplit(u).password is not None
                                     for u in engine_base_urls(self.upstream)):
            raise ValueError("upstream_key (AGL_UPSTREAM_KEY) and an upstream URL with credentials (user:password@) "
                             "are two ways of authenticating to the engine: give one")
        return self

    @property
    def upstreams_v1(self) -> list[str]:
        """The engines' OpenAI base URLs (``--upstream`` is comma-separated), each ending in ``/v1``."""
        return [u + "/v1" for u in engine_base_urls(self.upstream)]
