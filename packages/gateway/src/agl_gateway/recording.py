"""The :class:`CallRecord` of one call: built as a plain dict, written to Redis before the agent's answer."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from agl_common.schemas import CallRecord, Policy, token_id_fault
from agl_common.store import RecordRefused
from redis.exceptions import RedisError

from .capture import Captured, check, sent_prompt_ids
from .errors import ApiError, store_down
from .state import GatewayState
from .upstream import mask_credentials

log = logging.getLogger("agl.gateway")


def new_record(rollout_id: str, attempt_id: str, route: str, body: dict[str, Any], policy: Policy,
               served: str | None = None, role: str | None = None) -> dict[str, Any]:
    """A :class:`CallRecord` as a plain dict, its fields in the model's order (see :func:`write`);
    ``served``: the model name the call is sent under (default ``policy.model``), ``role``: its role."""
    return {"rollout_id": rollout_id, "attempt_id": attempt_id, "seq": -1, "route": route,
            "request": body, "response": None, "prompt_token_ids": [], "response_token_ids": [],
            "response_logprobs": None, "finish_reason": None, "model_version": policy.version,
            "model": policy.model if served is None else served, "role": role, "latency_ms": 0.0, "status": "ok", "error": None, "started_at": time.time(),
            "ended_at": 0.0}


def fill(rec: dict[str, Any], cap: Captured, response: dict[str, Any] | None, t0: float,
         error: str | None = None) -> None:
    """Put what was captured into ``rec``; ``status`` is ``error`` with ``error`` set, or with what
    :func:`check` finds wrong with the capture (never trained on; a completions prompt of token ids is compared
    with the engine's prompt ids), else ``ok``. ``t0``: perf_counter at the upstream call's start (for
    ``latency_ms``). Raises nothing."""
    rec["response"] = response
    ids_fit = token_id_fault(cap.prompt_token_ids, cap.response_token_ids) is None
    # ids outside any vocabulary are not kept (the error names the first): a record stays writable as int64
    # everywhere (Parquet, torch), and it is an error record, never trained on
    rec["prompt_token_ids"], rec["response_token_ids"] = ((cap.prompt_token_ids, cap.response_token_ids) if ids_fit
                                                          else ([], []))
    rec["response_logprobs"] = cap.response_logprobs if ids_fit else None  # (aligned with the ids, or none)
    rec["finish_reason"] = cap.finish_reason
    request = rec["request"]
    error = error or check(cap, sent_prompt_ids(rec["route"], request),
                           truncated=request.get("truncate_prompt_tokens") not in (None, False))
    if error:
        rec["status"], rec["error"] = "error", error
    rec["latency_ms"] = (time.perf_counter() - t0) * 1000
    rec["ended_at"] = time.time()


#: the store's refusal of a record → the agent's answer (the rollout's state is read where the record is written)
_REFUSED = {"rollout_not_found": (404, "not_found_error", "is gone"),
            "stale_attempt": (409, "conflict_error", "was retried: this attempt is over"),
            "rollout_finished": (409, "conflict_error", "has finished"),
            # 403, not 429: SDKs retry a 429 (each retry a generation thrown away); this attempt may make no more
            "too_many_calls": (403, "permission_error", "attempt holds the most call records it may"),
            "too_many_bytes": (403, "permission_error", "attempt holds the most call record bytes it may")}


def refused(exc: RecordRefused, what: str = "call") -> ApiError:
    """The agent's answer to a record (of a ``what``: a call, an event) the store refused
    (:class:`agl_common.store.RecordRefused`)."""
    status, type_, why = _REFUSED[exc.code]
    return ApiError(status, f"rollout {exc.rollout_id!r} {why}; the {what} was not recorded", type_, exc.code)


async def write(st: GatewayState, rec: dict[str, Any]) -> None:
    """Write the record to Redis (before the agent gets its answer); ``ApiError`` 503 if Redis does not
    acknowledge it, 404/409 if the rollout is gone, finished or on another attempt by now (a call held by a
    pause, or in flight, while it ended), 403 once the attempt holds its most calls or bytes.

    One ``orjson.dumps`` of the :func:`new_record` dict gives the :class:`CallRecord` JSON (same fields,
    same order, ``"seq":-1`` third, replaced by the store's script), without building the model.
    """
    t0 = time.perf_counter()
    try:
        payload = orjson.dumps(rec)
    except TypeError:  # something orjson does not encode (non-string keys...): pydantic's serializer
        try:
            payload = CallRecord.model_validate(rec).model_dump_json().encode()
        except Exception as exc:  # noqa: BLE001 - nests too deep for both: keep the call, not its bodies
            rec.update(request={}, response=None, status="error",
                       error=f"record could not be encoded ({type(exc).__name__}); request and answer dropped")
            payload = orjson.dumps(rec)
    if st.credentials:  # the record as the agent got it (HideEngineKey): no engine credential in its error, its
        payload = mask_credentials(payload, st.credentials)  # answer or anywhere else (round 23: the answer kept it)
    try:
        seq = await st.store.record_call_json(rec["rollout_id"], rec["attempt_id"], payload,
                                              st.settings.max_calls_per_attempt,
                                              st.settings.max_record_bytes_per_attempt)
    except RecordRefused as exc:
        raise refused(exc) from None
    except RedisError as exc:
        log.warning("record of %s/%s not written: %r", rec["rollout_id"], rec["attempt_id"], exc)
        raise store_down() from None
    st.metrics.record_seconds.observe(time.perf_counter() - t0)
    if st.tracer is not None:  # one OpenTelemetry span per recorded call (agl_gateway.otel), of the record as written
        st.tracer.emit(orjson.loads(payload) if st.credentials else rec, seq)  # (credentials masked)


async def write_failure(st: GatewayState, rec: dict[str, Any], err: ApiError | str, t0: float) -> None:
    """Record a call that failed with ``err`` (the agent's error answer, or the error's text: status ``error``);
    ``ApiError`` 503 if Redis is down."""
    rec["status"], rec["error"] = "error", err if isinstance(err, str) else f"{err.status} {err.code}: {err.message}"
    rec["latency_ms"] = (time.perf_counter() - t0) * 1000
    rec["ended_at"] = time.time()
    await write(st, rec)


def observe(st: GatewayState, rec: dict[str, Any]) -> None:
    """Count a recorded call in the metrics (upstream latency, tokens in and out)."""
    m = st.metrics
    m.route(m.upstream_seconds, rec["route"]).observe(rec["latency_ms"] / 1000)
    m.tokens_in.inc(len(rec["prompt_token_ids"]))
    m.tokens_out.inc(len(rec["response_token_ids"]))


async def check_room(st: GatewayState, rollout_id: str, attempt_id: str) -> None:
    """``ApiError`` 403 if the attempt holds its most records or record bytes already (checked before the call is
    forwarded: the engine is not asked for an answer that could not be recorded), 503 if Redis is down."""
    try:
        calls, size = await st.store.attempt_usage(rollout_id, attempt_id)
    except RedisError:
        raise store_down() from None
    if calls >= st.settings.max_calls_per_attempt:
        raise refused(RecordRefused("too_many_calls", rollout_id, attempt_id))
    if size >= st.settings.max_record_bytes_per_attempt:
        raise refused(RecordRefused("too_many_bytes", rollout_id, attempt_id))
