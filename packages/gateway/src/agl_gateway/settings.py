"""Gateway settings: command-line options of ``agl-gateway serve``, each also read from ``AGL_*``."""

from __future__ import annotations

import os
import socket

from agl_common.settings import CommonSettings
from pydantic import Field


class GatewaySettings(CommonSettings):
    """Defaults here are the single source for the CLI and the docs.

    Units: seconds for every ``*_s`` field, bytes for ``max_body_bytes``.
    """

    upstream: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    key: str | None = None
    open: bool = False
    max_hold: float = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    heartbeat_s: float = 1.0
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @property
    def upstream_v1(self) -> str:
        """The engine's OpenAI base URL, always ending in ``/v1`` (appended if the user left it off)."""
        url = self.upstream.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"
