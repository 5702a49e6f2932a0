"""Agent-facing rollout routes: reward and custom events (CONTRACT §1)."""

from __future__ import annotations

from typing import Any

import orjson
from agl_common.schemas import EVENT_BYTES_MAX, EVENTS_PER_ATTEMPT_MAX, TERMINAL, EventIn, RewardIn, Rollout
from agl_common.store import RecordRefused
from fastapi import APIRouter, Request
from pydantic import ValidationError
from redis.exceptions import RedisError

from ..errors import ApiError, bad_request, store_down
from ..identity import Identity, caller_and_body, check_callable, not_current
from ..recording import refused
from ..state import state_of

router = APIRouter(prefix="/rollouts/{rollout_id}/attempts/{attempt_id}")


async def _parse(request: Request, model) -> tuple[Identity, Any]:
    """The caller and its body as ``model`` (:func:`agl_gateway.identity.caller_and_body`: the key first)."""
    ident, body = await caller_and_body(request, state_of(request), unique_keys=True)
    try:
        return ident, model.model_validate(body)
    except ValidationError as exc:
        raise bad_request(f"invalid body: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}") from None


@router.post("/reward")
async def reward(request: Request):
    """Set the attempt's reward (last write wins while it runs). 404 unknown rollout, 409 stale attempt or a
    rollout that already succeeded or failed (its outcome is final: the trainer may have read it)."""
    st = state_of(request)
    ident, body = await _parse(request, RewardIn)  # a JSON number within ±REWARD_LIMIT (check_reward)

    def change(r: Rollout) -> None:
        if r.attempt_id != ident.attempt_id:  # a retry started between the check and the write
            raise not_current(r.rollout_id, ident.attempt_id, r.attempt_id)
        if r.status in TERMINAL:
            raise ApiError(409, f"rollout {r.rollout_id!r} is {r.status.value}: its reward is final",
                           "conflict_error", "rollout_finished")
        r.reward, r.reward_message = body.value, body.message

    try:
        await st.store.update_rollout(ident.rollout_id, change)
    except RedisError:
        raise store_down() from None
    return {"rollout_id": ident.rollout_id, "attempt_id": ident.attempt_id, "reward": body.value}


@router.post("/events")
async def events(request: Request):
    """Append a custom event to the rollout's event stream. 400 for an event over ``EVENT_BYTES_MAX`` bytes of
    JSON (or a ``type`` over ``EVENT_TYPE_MAX`` characters), 409 once the rollout succeeded or failed (as for
    rewards and model calls), 429 once this attempt posted ``EVENTS_PER_ATTEMPT_MAX`` events: one harness cannot fill
    Redis, and a retried attempt starts with none."""
    st = state_of(request)
    ident, body = await _parse(request, EventIn)
    size = len(orjson.dumps(body.data))
    if size > EVENT_BYTES_MAX:
        raise bad_request(f"event data is {size} bytes of JSON, more than {EVENT_BYTES_MAX}", "event_too_large")
    check_callable(ident)
    try:  # (the rollout is checked again in the write: a body that arrives after the rollout ended is refused)
        entry = await st.store.add_event(ident.rollout_id, ident.attempt_id, body.type, body.data,
                                         max_events=EVENTS_PER_ATTEMPT_MAX)
    except RecordRefused as exc:
        raise refused(exc, "event") from None
    except RedisError:
        raise store_down() from None
    if entry is None:
        raise ApiError(429, f"attempt {ident.attempt_id} of rollout {ident.rollout_id!r} posted "
                       f"{EVENTS_PER_ATTEMPT_MAX} events, the most an attempt may",
                       "rate_limit_error", "too_many_events")
    return {"id": entry}
