"""What every request handler of one gateway app shares (no module-level state)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any
from dataclasses import dataclass, field

import aiohttp
from agl_common.schemas import Policy
from agl_common.store import Store
from fastapi import Request

from .engines import Engines
from .gate import PauseGate
from .metrics import Metrics
from .settings import GatewaySettings


@dataclass
class GatewayState:
    """One per app. ``policy`` is ``None`` until the served model name is known (``--model``, the stored
    policy, a resume command, or the engine's ``GET /v1/models``: see :mod:`.upstream`)."""

    settings: GatewaySettings
    store: Store
    http: aiohttp.ClientSession
    gate: PauseGate
    policy: Policy | None
    metrics: Metrics
    engines: Engines
    discovery: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: pipeline tasks of live streams (they outlive their request if the agent goes away)
    tasks: set[asyncio.Task] = field(default_factory=set)
    pause_expiry: asyncio.TimerHandle | None = None
    tracer: Any = None  # agl_gateway.otel.CallTracer when --otel, else None
    #: this process's token for its replica id (:meth:`agl_common.store.Store.claim_replica`)
    owner: str = field(default_factory=lambda: secrets.token_hex(8))
    #: another process took this replica's id (its heartbeats stopped too long): no drain counts it any more
    displaced: bool = False
    #: what the gateway sends its engines, masked in every answer and record (:func:`.upstream.engine_credentials`)
    credentials: tuple[bytes, ...] = ()


def state_of(request: Request) -> GatewayState:
    return request.app.state.agl
