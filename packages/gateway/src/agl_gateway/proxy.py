"""One model call, from the agent's bytes to the recorded :class:`CallRecord` and back.

Steps: parse the body (400/413) → resolve the rollout and attempt (404/409; ``--open`` creates) → check
the key (401) → pass the pause gate (held; 503 after ``max_hold``) → forward to the engine with
``return_token_ids`` and ``logprobs`` forced on (502/504) → record to Redis (503 if Redis fails) →
answer the agent with the engine's body, minus the fields only the recorder asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from agl_common.auth import key_allows
from agl_common.schemas import CallRecord, Policy, Rollout, RolloutStatus, TERMINAL
from agl_common.store import RolloutNotFound, Store
from fastapi import Request
from redis.exceptions import RedisError

from .errors import ApiError, bad_request
from .gate import HeldTooLong, PauseGate
from .settings import GatewaySettings

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
    http: httpx.AsyncClient
    gate: PauseGate
    policy: Policy
    metrics: Any


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
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error",
                           "body_too_large")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
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
    if aid is not None and not aid.isdigit():
        raise bad_request(f"attempt id must be a decimal string, got {aid!r}", "invalid_attempt")
    if st.settings.key and not presented_key(request):
        raise ApiError(401, "missing API key", "authentication_error", "invalid_api_key")
    try:
        try:
            rollout = await st.store.get_rollout(rid)
        except RolloutNotFound:
            if not st.settings.open:
                raise ApiError(404, f"unknown rollout {rid!r}", "not_found_error", "rollout_not_found") from None
            try:
                rollout = await st.store.create_rollout(
                    Rollout(rollout_id=rid, attempt_id=aid or "0", status=RolloutStatus.running,
                            started_at=time.time()), enqueue=False)
            except ValueError:  # created concurrently by another call
                rollout = await st.store.get_rollout(rid)
    except RedisError:
        raise ApiError(503, STORE_DOWN, "server_error", "store_unavailable", {"Retry-After": "1"}) from None
    if aid is None:
        aid = rollout.attempt_id
    if st.settings.key and not key_allows(st.settings.key, presented_key(request), rid, aid):
        raise ApiError(401, "invalid API key for this rollout attempt", "authentication_error", "invalid_api_key")
    if aid != rollout.attempt_id:
        raise ApiError(409, f"attempt {aid} of rollout {rid!r} is stale (current attempt: {rollout.attempt_id})",
                       "conflict_error", "stale_attempt")
    return Identity(rid, aid, rollout)


def check_callable(ident: Identity) -> None:
    """Model calls are accepted only while the rollout is queuing or running (409 otherwise)."""
    if ident.rollout.status in TERMINAL:
        raise ApiError(409, f"rollout {ident.rollout_id!r} is {ident.rollout.status.value}", "conflict_error",
                       "rollout_finished")


async def forward_json(st: GatewayState, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the engine at ``{upstream}/v1{path}``; returns the parsed JSON object.

    Raises ``ApiError``: 504 on timeout, 502 on a connection failure, a non-JSON answer or a 5xx; the
    engine's own 4xx status and message are passed on (the agent sent something the engine refuses).
    """
    url = st.settings.upstream_v1 + path
    try:
        resp = await st.http.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
    except httpx.TimeoutException:
        raise ApiError(504, "upstream engine timed out", "server_error", "upstream_timeout") from None
    except httpx.HTTPError as exc:
        raise ApiError(502, f"upstream engine unreachable: {type(exc).__name__}", "server_error",
                       "upstream_unreachable") from None
    try:
        data = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        data = None
    if resp.status_code >= 500 or not isinstance(data, dict):
        raise ApiError(502, f"upstream engine failed with status {resp.status_code}", "server_error",
                       "upstream_error")
    if resp.status_code >= 400:
        err = data.get("error") if isinstance(data.get("error"), dict) else {}
        msg = err.get("message") or data.get("message") or f"upstream refused the request ({resp.status_code})"
        raise ApiError(resp.status_code if resp.status_code != 401 else 502, str(msg), "invalid_request_error",
                       "upstream_rejected")
    return data


def extract_tokens(route: str, data: dict[str, Any]) -> tuple[list[int], list[int], list[float] | None, str | None]:
    """Token ids and logprobs from a vLLM answer with ``return_token_ids``/``logprobs`` on.

    Returns ``(prompt_token_ids, response_token_ids, response_logprobs, finish_reason)`` of choice 0.
    ``response_logprobs`` is ``None`` if the engine returned none or a list of another length.
    """
    choices = data.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
    response_ids = choice.get("token_ids") or []
    logprobs = None
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if route == "chat" and isinstance(lp.get("content"), list):
            logprobs = [float(t.get("logprob", 0.0)) for t in lp["content"]]
        elif route == "completions" and isinstance(lp.get("token_logprobs"), list):
            logprobs = [float(x) if x is not None else 0.0 for x in lp["token_logprobs"]]
    if logprobs is not None and len(logprobs) != len(response_ids):
        logprobs = None
    return list(prompt_ids), list(response_ids), logprobs, choice.get("finish_reason")


def agent_view(route: str, data: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The engine's answer minus what only the recorder asked for (token ids; logprobs unless requested)."""
    out = dict(data)
    out.pop("prompt_token_ids", None)
    for field in ("prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params"):
        out.pop(field, None)
    if "model" in request:
        out["model"] = request["model"]
    wants_logprobs = bool(request.get("logprobs"))
    choices = []
    for choice in out.get("choices") or []:
        if isinstance(choice, dict):
            choice = dict(choice)
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            if not wants_logprobs:
                choice["logprobs"] = None
        choices.append(choice)
    if "choices" in out:
        out["choices"] = choices
    return out


async def record(st: GatewayState, rec: CallRecord) -> CallRecord:
    """Write the record to Redis before the agent gets its answer; 503 if Redis does not acknowledge."""
    t0 = time.perf_counter()
    try:
        rec = await st.store.record_call(rec)
    except RedisError:
        raise ApiError(503, STORE_DOWN, "server_error", "store_unavailable", {"Retry-After": "1"}) from None
    st.metrics.record_seconds.observe(time.perf_counter() - t0)
    return rec


async def model_call(request: Request, route: str, path: str, force: dict[str, Any]) -> dict[str, Any]:
    """The full path of one non-streamed call on an OpenAI-shaped route; returns the agent's answer."""
    st = state_of(request)
    body = await read_json(request, st.settings.max_body_bytes)
    if body.get("stream"):
        raise bad_request("stream=true is not supported on this route yet", "stream_unsupported")
    ident = await resolve_identity(request, st)
    check_callable(ident)
    try:
        async with st.gate.admit():
            policy = st.policy
            upstream_body = {**body, **force, "model": policy.model}
            started = time.time()
            t0 = time.perf_counter()
            rec = CallRecord(rollout_id=ident.rollout_id, attempt_id=ident.attempt_id, seq=-1, route=route,
                             request=body, response=None, model=policy.model, model_version=policy.version,
                             started_at=started)
            try:
                data = await forward_json(st, path, upstream_body)
            except ApiError as err:
                rec.status, rec.error = "error", f"{err.status} {err.code}: {err.message}"
                rec.latency_ms = (time.perf_counter() - t0) * 1000
                rec.ended_at = time.time()
                await record(st, rec)
                raise
            prompt_ids, response_ids, logprobs, finish = extract_tokens(route, data)
            answer = agent_view(route, data, body)
            rec.response = answer
            rec.prompt_token_ids, rec.response_token_ids, rec.response_logprobs = prompt_ids, response_ids, logprobs
            rec.finish_reason = finish
            rec.latency_ms = (time.perf_counter() - t0) * 1000
            rec.ended_at = time.time()
            await record(st, rec)
            st.metrics.upstream_seconds.labels(route).observe(rec.latency_ms / 1000)
            st.metrics.tokens.labels("in").inc(len(prompt_ids))
            st.metrics.tokens.labels("out").inc(len(response_ids))
            return answer
    except HeldTooLong:
        raise ApiError(503, f"gateway paused for a weight update; call held over {st.settings.max_hold:g} s",
                       "server_error", "paused", {"Retry-After": "5"}) from None
