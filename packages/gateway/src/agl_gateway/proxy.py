"""One model call, from the agent's bytes to the recorded :class:`CallRecord` and back.

Steps: parse the body (400/413) → resolve the rollout and attempt (404/409; ``--open`` creates) → check
the key (401) → pass the pause gate (held; 503 after ``max_hold``) → forward to the engine with
``return_token_ids`` and ``logprobs`` forced on (502/504) → record to Redis (503 if Redis fails) →
answer the agent with the engine's body, minus the fields only the recorder asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from agl_common.auth import key_allows
from agl_common.schemas import TERMINAL, CallRecord, Policy, Rollout, RolloutStatus
from agl_common.store import RolloutNotFound, Store
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect

from .engines import Engines, NoEngine
from .capture import MAX_JSON_DEPTH, MalformedUpstream, agent_view, extract_tokens, too_deep
from .errors import ApiError, bad_request
from .gate import GateClosed, HeldTooLong, PauseGate
from .settings import GatewaySettings

log = logging.getLogger("agl.gateway")

JSON_HEADERS = {"content-type": "application/json"}
STORE_DOWN = "the gateway's store (Redis) is unavailable; retry later"

@dataclass
class Identity:
    """Which rollout attempt a request belongs to."""

    rollout_id: str
    attempt_id: str
    rollout: Rollout


@dataclass
class GatewayState:
    """Everything a request handler needs; one per app (no module-level state)."""

    settings: GatewaySettings
    store: Store
    http: aiohttp.ClientSession
    gate: PauseGate
    policy: Policy
    metrics: Any
    engines: Engines
    tracer: Any = None  # agl_gateway.otel.CallTracer when --otel, else None


def state_of(request: Request) -> GatewayState:
    return request.app.state.agl


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object. Raises ``ApiError`` 413 (too large) or 400 (not a JSON object)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error", "body_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise ApiError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error",
                               "body_too_large")
    except ClientDisconnect:  # the agent went away mid-body: nothing to answer, nothing forwarded
        raise bad_request("client disconnected before sending the whole body", "client_disconnected") from None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    # fewer brackets than the limit in the whole text: cannot nest deeper (brackets in strings only add)
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH and too_deep(data):
        raise bad_request(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    return data


async def resolve_identity(request: Request, st: GatewayState) -> Identity:
    """Rollout and attempt from the URL path, else from ``X-AGL-Rollout-Id`` / ``X-AGL-Attempt-Id``.

    Raises ``ApiError``: 400 (no rollout id), 401 (bad key), 404 (unknown rollout), 409 (stale attempt or
    finished rollout), 503 (Redis down).
    """
    rid = request.path_params.get("rollout_id") or request.headers.get("x-agl-rollout-id")
    aid = request.path_params.get("attempt_id") or request.headers.get("x-agl-attempt-id")
    if not rid:
        raise bad_request("no rollout: use /rollouts/{id}/attempts/{n}/v1 or the X-AGL-Rollout-Id header",
                          "missing_rollout")
    if aid is not None and not (aid.isascii() and aid.isdigit()):  # not "²" or "٣" (str.isdigit accepts them)
        raise bad_request(f"attempt id must be a decimal string, got {aid!r}", "invalid_attempt")
    key, presented = st.settings.key, presented_key(request)
    bad_key = ApiError(401, "invalid API key for this rollout attempt", "authentication_error", "invalid_api_key")
    if key and not presented:
        raise ApiError(401, "missing API key", "authentication_error", "invalid_api_key")
    if key and aid is not None and not key_allows(key, presented, rid, aid):
        raise bad_key  # before any lookup: a wrong key learns nothing about which rollouts exist
    try:
        try:
            rollout = await st.store.get_rollout(rid)
        except RolloutNotFound:
            if not st.settings.open:
                raise ApiError(404, f"unknown rollout {rid!r}", "not_found_error", "rollout_not_found") from None
            if key and not key_allows(key, presented, rid, aid or "0"):
                raise bad_key from None  # --open creates rollouts only for callers holding a valid key
            try:
                rollout = await st.store.create_rollout(
                    Rollout(rollout_id=rid, attempt_id=aid or "0", status=RolloutStatus.running,
                            started_at=time.time()), enqueue=False)
            except ValueError:  # created concurrently by another call
                rollout = await st.store.get_rollout(rid)
    except RedisError as exc:
        log.warning("store unavailable while resolving %r: %r", rid, exc)
        raise ApiError(503, STORE_DOWN, "server_error", "store_unavailable", {"Retry-After": "1"}) from None
    if aid is None:
        aid = rollout.attempt_id
    if key and not key_allows(key, presented, rid, aid):
        raise bad_key
    if aid != rollout.attempt_id:
        raise ApiError(409, f"attempt {aid} of rollout {rid!r} is stale (current attempt: {rollout.attempt_id})",
                       "conflict_error", "stale_attempt")
    return Identity(rid, aid, rollout)


def check_callable(ident: Identity) -> None:
    """Model calls are accepted only while the rollout is queuing or running (409 otherwise)."""
    if ident.rollout.status in TERMINAL:
        raise ApiError(409, f"rollout {ident.rollout_id!r} is {ident.rollout.status.value}", "conflict_error",
                       "rollout_finished")


async def forward_json(st: GatewayState, path: str, body: dict[str, Any], rollout_id: str) -> dict[str, Any]:
    """POST ``body`` to the rollout's engine at ``{engine}/v1{path}``; returns the parsed JSON object.

    A connection failure (nothing was sent) marks the engine down and tries the next healthy one, at
    most once per engine. Raises ``ApiError``: 504 on timeout, 502 on connection failures everywhere, a
    non-JSON answer or a 5xx; the engine's own 4xx status and message are passed on.
    """
    tried: set[str] = set()
    while True:
        try:
            base = st.engines.pick(rollout_id, tried)
        except NoEngine:
            raise ApiError(502, "no upstream engine reachable", "server_error", "upstream_unreachable") from None
        tried.add(base)
        try:
            async with st.http.post(base + path, data=orjson.dumps(body), headers=JSON_HEADERS) as resp:
                status, content = resp.status, await resp.read()
            break
        except TimeoutError:
            raise ApiError(504, "upstream engine timed out", "server_error", "upstream_timeout") from None
        except aiohttp.ClientConnectorError:
            st.engines.mark_down(base)
        except aiohttp.ClientError as exc:
            raise ApiError(502, f"upstream engine failed: {type(exc).__name__}", "server_error",
                           "upstream_unreachable") from None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if status >= 500 or not isinstance(data, dict):
        raise ApiError(502, f"upstream engine failed with status {status}", "server_error", "upstream_error")
    if status >= 400:
        err = data.get("error") if isinstance(data.get("error"), dict) else {}
        msg = err.get("message") or data.get("message") or f"upstream refused the request ({status})"
        raise ApiError(status if status != 401 else 502, str(msg), "invalid_request_error",
                       "upstream_rejected")
    return data


async def record(st: GatewayState, rec: dict[str, Any]) -> None:
    """Write the record to Redis before the agent gets its answer; 503 if Redis does not acknowledge.

    ``rec`` is a :func:`new_record` dict: one ``orjson.dumps`` gives the :class:`CallRecord` JSON (same
    fields, same order, ``"seq":-1`` third, replaced by the store's script), without building the model.
    """
    t0 = time.perf_counter()
    try:
        payload = orjson.dumps(rec)
    except TypeError:  # something orjson does not encode (non-string keys...): pydantic's serializer
        payload = CallRecord.model_validate(rec).model_dump_json().encode()
    try:
        seq = await st.store.record_call_json(rec["rollout_id"], rec["attempt_id"], payload)
    except RedisError as exc:
        log.warning("record of %s/%s not written: %r", rec["rollout_id"], rec["attempt_id"], exc)
        raise ApiError(503, STORE_DOWN, "server_error", "store_unavailable", {"Retry-After": "1"}) from None
    st.metrics.record_seconds.observe(time.perf_counter() - t0)
    if st.tracer is not None:  # one OpenTelemetry span per recorded call (agl_gateway.otel)
        st.tracer.emit(rec, seq)


@dataclass
class RouteSpec:
    """How one model route maps onto the engine's OpenAI routes.

    ``to_upstream`` translates the agent's body into the engine's (None: pass through); ``to_agent``
    translates the engine's answer back; ``sse`` encodes a complete answer as a stream (used when the
    agent asked for ``stream: true`` and the call could not be streamed live).
    """

    route: str
    path: str
    force: dict[str, Any]
    to_upstream: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    to_agent: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    sse: Callable[[dict[str, Any], dict[str, Any]], Iterator[bytes]] | None = None
    live_stream: bool = False


#: Upstream answers that were cut by a weight update: never handed to the agent as a normal answer.
ABORTED = {"abort"}
MAX_ABORT_RETRIES = 3


def new_record(ident: Identity, spec: RouteSpec, body: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """A :class:`CallRecord` as a plain dict, its fields in the model's order (see :func:`record`)."""
    return {"rollout_id": ident.rollout_id, "attempt_id": ident.attempt_id, "seq": -1, "route": spec.route,
            "request": body, "response": None, "prompt_token_ids": [], "response_token_ids": [],
            "response_logprobs": None, "finish_reason": None, "model_version": policy.version,
            "model": policy.model, "latency_ms": 0.0, "status": "ok", "error": None, "started_at": time.time(),
            "ended_at": 0.0}


async def record_failure(st: GatewayState, rec: dict[str, Any], err: ApiError, t0: float) -> None:
    rec["status"], rec["error"] = "error", f"{err.status} {err.code}: {err.message}"
    rec["latency_ms"] = (time.perf_counter() - t0) * 1000
    rec["ended_at"] = time.time()
    await record(st, rec)


async def enter_gate(st: GatewayState) -> None:
    try:
        await st.gate.enter()
    except HeldTooLong:
        raise ApiError(503, f"gateway paused for a weight update; call held over {st.settings.max_hold:g} s",
                       "server_error", "paused", {"Retry-After": "5"}) from None
    except GateClosed:
        raise ApiError(503, "gateway shutting down; retry (another replica, or this one once restarted)",
                       "server_error", "shutting_down", {"Retry-After": "1"}) from None


async def model_call(request: Request, spec: RouteSpec) -> Response:
    """The full path of one call on a model route; returns the agent's answer (JSON or SSE)."""
    st = state_of(request)
    t_call = time.perf_counter()
    body = await read_json(request, st.settings.max_body_bytes)
    ident = await resolve_identity(request, st)
    check_callable(ident)
    upstream = spec.to_upstream(body) if spec.to_upstream else dict(body)
    if not isinstance(upstream.get("messages", []), list):
        raise bad_request("'messages' must be a list")
    if not isinstance(body.get("model", ""), str):
        raise bad_request("'model' must be a string")
    if spec.to_upstream:
        try:  # a translated body must be forwardable (chat/completions bodies are parsed JSON already)
            orjson.dumps(upstream)
        except TypeError as exc:
            raise bad_request(f"request cannot be translated for the engine: {exc}") from None
    stream = bool(body.get("stream"))
    if stream and not (spec.sse or spec.live_stream):
        raise bad_request(f"stream=true is not supported on the {spec.route} route", "stream_unsupported")
    for field in ("stream", "stream_options"):
        upstream.pop(field, None)
    upstream.update(spec.force)
    if stream and spec.live_stream and not body.get("tools") and body.get("n", 1) == 1:
        from .streaming import GateSlot, SlotStreamingResponse, stream_chat  # (imports this module)

        await enter_gate(st)
        slot = GateSlot(st.gate)
        return SlotStreamingResponse(stream_chat(st, ident, spec, body, upstream, slot), slot,
                                     media_type="text/event-stream")
    token_route = "completions" if spec.path == "/completions" else "chat"  # the engine's answer shape
    waited = 0.0  # seconds held by a pause or spent on aborted tries: not added by the gateway
    for _ in range(MAX_ABORT_RETRIES):
        t_gate = time.perf_counter()
        await enter_gate(st)
        waited += time.perf_counter() - t_gate
        try:
            policy = st.policy
            rec = new_record(ident, spec, body, policy)
            t0 = time.perf_counter()
            try:
                data = await forward_json(st, spec.path, {**upstream, "model": policy.model}, ident.rollout_id)
            except ApiError as err:
                await record_failure(st, rec, err, t0)
                raise
            upstream_s = time.perf_counter() - t0
            try:
                prompt_ids, response_ids, logprobs, finish = extract_tokens(token_route, data)
                if finish not in ABORTED:
                    answer = agent_view(spec.route, data, body)
                    if spec.to_agent:
                        answer = spec.to_agent(answer, body)
                    if too_deep(answer):
                        raise MalformedUpstream(f"answer nested deeper than {MAX_JSON_DEPTH} levels")
                    # encoded now, so that nothing can fail once the agent's answer has started
                    out = list(spec.sse(answer, body)) if stream and spec.sse else orjson.dumps(answer)
            except Exception as exc:  # noqa: BLE001 -- wrong types from the engine, or LiteLLM refusing its answer
                err = ApiError(502, f"upstream engine sent a malformed answer ({type(exc).__name__}: {exc})"[:500],
                               "server_error", "upstream_error")
                await record_failure(st, rec, err, t0)
                raise err from None
            if finish in ABORTED:  # cut by a weight update: record, then retry once the gate reopens
                await record_failure(st, rec, ApiError(503, "upstream aborted the request", "server_error",
                                                       "upstream_aborted"), t0)
                waited += time.perf_counter() - t0
                continue
            rec["response"] = answer
            rec["prompt_token_ids"], rec["response_token_ids"] = prompt_ids, response_ids
            rec["response_logprobs"], rec["finish_reason"] = logprobs, finish
            rec["latency_ms"] = (time.perf_counter() - t0) * 1000
            rec["ended_at"] = time.time()
            await record(st, rec)
            observe(st, rec)
            st.metrics.route(st.metrics.added_seconds, spec.route).observe(
                time.perf_counter() - t_call - waited - upstream_s)
        finally:
            st.gate.leave()
        if isinstance(out, list):
            return StreamingResponse(iter(out), media_type="text/event-stream")
        return Response(out, media_type="application/json")
    raise ApiError(503, f"upstream aborted the request {MAX_ABORT_RETRIES} times", "server_error",
                   "upstream_aborted", {"Retry-After": "5"})


def observe(st: GatewayState, rec: dict[str, Any]) -> None:
    m = st.metrics
    m.route(m.upstream_seconds, rec["route"]).observe(rec["latency_ms"] / 1000)
    m.tokens_in.inc(len(rec["prompt_token_ids"]))
    m.tokens_out.inc(len(rec["response_token_ids"]))
