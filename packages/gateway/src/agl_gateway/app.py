"""The gateway app factory: wiring, the control-channel listener and the replica heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from agl_common.aio import wait_until
from agl_common.schemas import ControlCommand, Policy, ReplicaStatus
from agl_common.settings import allowed_hosts
from agl_common.store import REPLICA_LATE_S, Store, StoreRefused, UnreadableRecord
from fastapi import FastAPI, Request
from redis.exceptions import RedisError
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match

from .engines import Engines
from .errors import ApiError, install_handlers
from .gate import PauseGate
from .metrics import Metrics
from .otel import tracer_from_env
from .routes import anthropic, openai, ops, responses, rollouts
from .settings import GatewaySettings
from .state import GatewayState
from .upstream import current_policy, engine_credentials, mask_credentials

log = logging.getLogger("agl.gateway")

ROLLOUT_PREFIX = "/rollouts/{rollout_id}/attempts/{attempt_id}"


class RequestMetrics:
    """Pure ASGI middleware counting requests by route template and status; model calls take a short cut.

    (Starlette's ``@app.middleware("http")`` runs every request in an extra task group with memory
    streams: about 0.3 ms of CPU per call, measured with bench/gateway.py.)

    The short cut: when Starlette's own matching (first route that fully matches, same scope updates)
    picks one of the model routes (:data:`FAST_ENDPOINTS`, each ``async def f(request) -> Response``),
    its endpoint is awaited here directly, with an :class:`ApiError` answered by the app's own handler,
    instead of going through ExceptionMiddleware, the router again and FastAPI's request handler
    (~0.1 ms of CPU per call). Anything else raised propagates as it would have (500 from
    ServerErrorMiddleware, outside this middleware).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            route = _fast_route(scope) if scope["method"] == "POST" else None
            if route is None:
                await self.app(scope, receive, send_status)
            else:
                request = Request(scope, receive)
                try:
                    response = await route.endpoint(request)
                except Exception as exc:
                    handler = _handler_for(scope["app"], exc)
                    if handler is None:
                        raise
                    response = await handler(request, exc)
                await response(scope, receive, send_status)
        finally:
            st = getattr(scope["app"].state, "agl", None)
            if st is not None:
                path = getattr(scope.get("route"), "path", "unmatched")
                st.metrics.route(st.metrics.requests, path, str(status)).inc()


class HideEngineKey:
    """Pure ASGI middleware: every credential the gateway sends its engines (:func:`~.upstream.engine_credentials`:
    the engine's key, an engine URL's ``user:password`` and its ``Basic`` base64) is masked, byte for byte (``*``,
    the same length: a ``Content-Length`` stays right), in every response body the gateway sends — each whole, and
    any prefix of one of :data:`~.upstream.KEY_PREFIX_MASKED` characters or more (:func:`~.upstream.mask_key`: the
    gateway cuts long engine messages, and a key that straddled the cut reached the agent less its last
    characters). The engine's messages reach the agent (a 400 ``upstream_rejected`` names what the engine said; a
    stream's error event is relayed): an engine, or a proxy before it, that echoes the request's ``Authorization``
    handed the agent the key that opens every route of the engine (round 20), or the URL's password (round 23). Each
    credential masked is made of characters no JSON encoder escapes, and each body message is whole (an answer, or
    one stream event), so none is split across two."""

    def __init__(self, app, credentials: tuple[bytes, ...]):
        self.app = app
        self.credentials = credentials

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def masked(message):
            if message["type"] == "http.response.body":
                message["body"] = mask_credentials(message.get("body", b""), self.credentials)
            await send(message)

        await self.app(scope, receive, masked)


#: Endpoints taken by :class:`RequestMetrics`'s short cut: ``async def f(request) -> Response``.
FAST_ENDPOINTS = frozenset((openai.chat_completions, openai.completions, anthropic.messages, responses.responses))


def _handler_for(app, exc: Exception):
    """The handler ExceptionMiddleware would use (``Exception`` itself is ServerErrorMiddleware's)."""
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in app.exception_handlers:
            return app.exception_handlers[cls]
    return None


def _fast_route(scope):
    """The route Starlette's router would pick, if it is a model route (scope updated as the router does)."""
    for route in scope["app"].router.routes:
        match, child_scope = route.matches(scope)
        if match is Match.FULL:
            if getattr(route, "endpoint", None) not in FAST_ENDPOINTS:
                return None
            scope.setdefault("router", scope["app"].router)
            scope["route"] = route
            scope.update(child_scope)
            return route
    return None


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """Build the gateway. Redis and the engine are contacted on start-up (lifespan), not here."""
    settings = settings or GatewaySettings()
    credentials = engine_credentials(settings.upstream_key, settings.upstream)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = Store(settings.redis_url, settings.prefix, settings.redis_max_connections,
                      wait_replicas=settings.wait_replicas, wait_timeout_ms=settings.wait_timeout_ms)
        # aiohttp's pool costs a fraction of httpx's per call at high concurrency (bench/gateway.py). Idle
        # connections are dropped after 2 s, under the engine's own keep-alive (uvicorn, vLLM: 5 s), so a
        # connection the engine is closing is never reused. Only the TCP connect has its own bound (10 s: a
        # refused connection fails at once; a starved loopback accept under load can take seconds).
        http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.upstream_timeout_s, sock_connect=10.0),
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0), auto_decompress=True,
            cookie_jar=aiohttp.DummyCookieJar(),
            headers={"Authorization": f"Bearer {settings.upstream_key}"} if settings.upstream_key else None)
        metrics = Metrics()
        wake = asyncio.Event()
        gate = PauseGate(settings.max_hold, on_change=wake.set, max_held_per_attempt=settings.max_in_flight_per_attempt)
        st = GatewayState(settings, store, http, gate, Policy(model=settings.model) if settings.model else None,
                          metrics, Engines(settings.upstreams_v1), tracer=tracer_from_env(settings.otel),
                          credentials=credentials)
        app.state.agl = st
        await claim_replica_id(store, settings.replica_id, st.owner)
        pubsub = None
        with contextlib.suppress(RedisError, OSError):
            # before the first call can be answered: subscribed (no command missed from now on), registered (a drain
            # from now on waits for this replica), then a pause held now is held (a drain that did not see this
            # replica had stored its pause first). The gate starting open forwarded calls across an acknowledged drain.
            pubsub = await store.subscribe_control()
            await _heartbeat(st)
            try:
                await _sync_from_store(st)
            except ValueError as exc:  # a stored policy or pause this version cannot read: served as before
                log.warning("stored policy or pause unreadable (%s); the control loop keeps trying", exc)
        tasks = [asyncio.create_task(_control_loop(st, pubsub)), asyncio.create_task(_heartbeat_loop(st, wake)),
                 asyncio.create_task(_discover_model(st))]
        # LiteLLM is not imported here: the first translated call starts its import (translate.ready()).
        # A start-up import competed for the GIL and the import locks with every call of a gateway that
        # may never translate (minutes beside CPU-heavy work: issue 14).
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
            if st.pause_expiry is not None:
                st.pause_expiry.cancel()
            with contextlib.suppress(Exception):
                await store.drop_replica(settings.replica_id, st.owner)
            await http.close()
            await store.close()
            if st.tracer is not None:
                await asyncio.to_thread(st.tracer.shutdown)

    # with a key, nothing is served without one: not even the route list (/openapi.json)
    app = FastAPI(title="AGL gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None if settings.key else "/openapi.json")
    install_handlers(app)

    app.add_middleware(RequestMetrics)
    if credentials:
        app.add_middleware(HideEngineKey, credentials=credentials)
    if not settings.key:  # keyless on loopback: only loopback Host names (a web page cannot read it by DNS rebinding)
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings.host))
    for family in (openai.router, anthropic.router, responses.router):
        app.include_router(family, prefix="/v1")
        app.include_router(family, prefix=ROLLOUT_PREFIX + "/v1")
    app.include_router(rollouts.router)
    app.include_router(ops.router)
    return app


async def apply_command(st: GatewayState, cmd: ControlCommand) -> None:
    """Apply one control command to this replica (idempotent: a repeated command changes nothing).

    A resume with a ``model`` switches the policy. Whatever the command, the replica then holds calls
    exactly while the store holds a pause (:meth:`Store.pauses`: owned pauses, read after each message, so
    that the end of one pause never releases another); a pause past its expiry is over on its own (a
    trainer killed between pause and resume leaves no replica paused for good). Raises Redis errors.
    """
    policy = cmd.policy()
    if policy is not None:
        st.policy = policy
    hold(st, await st.store.pauses())


def hold(st: GatewayState, pauses: dict[str, float]) -> None:
    """Hold calls for ``pauses`` (pause id → Unix time it expires) and wake up when the first expires."""
    now = time.time()
    live = {k: t for k, t in pauses.items() if t > now}
    if st.pause_expiry is not None:
        st.pause_expiry.cancel()
        st.pause_expiry = None
    was_paused = st.gate.paused
    if was_paused and not live and st.gate.paused_at is not None:
        st.metrics.pause_seconds.observe(time.monotonic() - st.gate.paused_at)
    st.gate.hold(frozenset(live))
    if live:
        first = min(live.values())
        st.pause_expiry = asyncio.get_running_loop().call_later(max(first - now, 0.0), _expire, st, live)


def _expire(st: GatewayState, pauses: dict[str, float]) -> None:
    st.pause_expiry = None
    gone = [k for k, t in pauses.items() if t <= time.time()]
    if gone:
        log.warning("pause %s expired without a resume (its owner died?)", ", ".join(gone))
    hold(st, pauses)


async def _discover_model(st: GatewayState) -> None:
    """Until the served model is known, ask the engines every 2 s (calls also ask, on their own)."""
    while st.policy is None:
        with contextlib.suppress(ApiError):
            await current_policy(st)
        if st.policy is None:
            await asyncio.sleep(2.0)


async def _sync_from_store(st: GatewayState) -> None:
    """Converge on the stored pauses and policy (for replicas that start late or missed a message). The pauses come
    first: a stored policy this version cannot read (``UnreadableRecord``) is logged and left (the one served stays),
    never a reason to skip a pause (round 23: it was, and the control loop, reading it as a lost connection, never
    listened again: no pause was ever applied)."""
    hold(st, await st.store.pauses())
    try:
        policy = await st.store.get_policy()
    except UnreadableRecord as exc:
        log.warning("%s; serving %s until a resume names a policy", exc, st.policy.model if st.policy else "none yet")
        return
    if policy is not None:
        st.policy = policy


async def _control_loop(st: GatewayState, pubsub: Any = None) -> None:
    """Listen on the control channel (``pubsub``: already subscribed at start-up); on (re)connect, re-read the
    stored state first."""
    while True:
        try:
            if pubsub is None:
                pubsub = await st.store.subscribe_control()
            await _sync_from_store(st)
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                try:
                    cmd = ControlCommand.model_validate_json(message["data"])
                except ValueError:
                    log.warning("ignored malformed control message %r", message["data"][:200])
                    continue
                await apply_command(st, cmd)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis down: retry, keep serving with the last known state
            log.warning("control channel lost (%s); reconnecting", exc)
            await asyncio.sleep(0.5)
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            pubsub = None


class ReplicaIdLive(RuntimeError):
    """Another live gateway replica heartbeats under this replica id."""


async def claim_replica_id(store: Store, replica_id: str, owner: str, wait_s: float = REPLICA_LATE_S + 1) -> None:
    """Take ``replica_id`` for this process (token ``owner``) before it heartbeats under it: two replicas of one
    id overwrite each other's status (a pause would count one replica's in-flight calls, and call a replica that
    still forwards calls drained). The id is taken atomically (:meth:`Store.claim_replica`, ``SET NX``: of two
    gateways starting together, one gets it); one held by another process is tried again until its ownership
    lapses (a replica that crashed: :data:`~agl_common.store.REPLICA_LATE_S` after its last heartbeat, as long as
    drains wait for it; a clean shutdown frees it at once), and one still held past that (a live replica renews
    it) raises :class:`ReplicaIdLive` (after ``wait_s`` seconds). Redis out of reach: not checked (the heartbeat
    loop retries, as before); a Redis that refuses the URL's database raises :class:`~agl_common.store.StoreRefused`."""
    deadline = time.monotonic() + wait_s
    try:
        while not await store.claim_replica(replica_id, owner):
            if time.monotonic() > deadline:
                raise ReplicaIdLive(f"gateway replica id {replica_id!r} is live: another gateway heartbeats under "
                                    "it; give this one another AGL_REPLICA_ID (or stop the other)")
            await asyncio.sleep(0.25)
    except StoreRefused:  # a database the server does not have: every call would be a 503, for ever
        raise
    except (RedisError, OSError) as exc:
        log.warning("could not check that replica id %r is free: %s", replica_id, exc)


async def _heartbeat(st: GatewayState) -> None:
    """Publish this replica's status once (and renew its ownership of its id)."""
    gate = st.gate
    policy = st.policy
    status = ReplicaStatus(replica_id=st.settings.replica_id, paused=gate.paused, in_flight=gate.in_flight,
                           held=gate.held, drained_ids=sorted(gate.drained_ids), model=policy and policy.model,
                           version=policy.version if policy else 0)
    if not await st.store.heartbeat(status, st.owner):  # another process took the id while this one was silent
        if not st.displaced:  # past REPLICA_LATE_S: no drain counts this replica any more, so it forwards nothing
            log.error("replica id %r is held by another gateway process (this one's heartbeats stopped for more than "
                      "%s s): it answers 503 to every model call from now on; restart it", st.settings.replica_id,
                      REPLICA_LATE_S)
        st.displaced = True
        return
    if gate.last_drain_s is not None:
        st.metrics.drain_seconds.observe(gate.last_drain_s)
        gate.last_drain_s = None


async def _heartbeat_loop(st: GatewayState, wake: asyncio.Event) -> None:
    """Publish this replica's status every ``heartbeat_s`` seconds, and at once on a gate change (one made while a
    heartbeat is being written included: ``wake`` is cleared before the status is read, never after the write).
    Raises ``asyncio.CancelledError`` only."""
    while True:
        wake.clear()
        try:
            await _heartbeat(st)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("heartbeat failed: %s", exc)
        await wait_until(wake, st.settings.heartbeat_s)
