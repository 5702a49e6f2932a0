"""Which rollout attempt a request belongs to, and whether its key may act for it.

Two forms name the attempt: the path (``/rollouts/{rid}/attempts/{aid}/...``) and the headers
``X-AGL-Rollout-Id`` / ``X-AGL-Attempt-Id`` (the path wins). Both give the same ids: header values are
decoded as UTF-8 (HTTP hands them over as bytes; Starlette decodes Latin-1), path segments are
percent-decoded UTF-8. An attempt id is a canonical decimal (``0``, ``1``, ``12``; not ``01``).

With a key configured every route answers a key it cannot verify with 401, before saying anything
about whether the rollout exists.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from agl_common.auth import key_allows
from agl_common.schemas import TERMINAL, Rollout, RolloutStatus, check_attempt_id, check_rollout_id
from agl_common.store import RolloutNotFound
from fastapi import Request
from redis.exceptions import RedisError

from .body import read_json
from .errors import ApiError, bad_request, store_down
from .state import GatewayState

log = logging.getLogger("agl.gateway")


@dataclass
class Identity:
    """Which rollout attempt a request belongs to."""

    rollout_id: str
    attempt_id: str
    rollout: Rollout


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def header(request: Request, name: str) -> str | None:
    """The value of header ``name`` as UTF-8 text (None if absent); ``ApiError`` 400 if it is not UTF-8, or sent
    twice with different values (which one a proxy or a framework keeps is anyone's guess)."""
    values = request.headers.getlist(name)
    if not values:
        return None
    if len(set(values)) > 1:
        raise bad_request(f"header {name} sent {len(values)} times with different values", "invalid_header")
    value = values[0]
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:  # (every str Starlette gives encodes to Latin-1: it decoded it so)
        raise bad_request(f"header {name} is not UTF-8", "invalid_header") from None


def named_attempt(request: Request) -> tuple[str | None, str | None]:
    """``(rollout_id, attempt_id)`` as named by the path or else the headers; ``None`` where not named.

    Raises ``ApiError`` 400 for a rollout id that cannot name a rollout (``invalid_rollout``), an attempt id
    that is not a canonical decimal, a header that is not UTF-8, or headers that name another rollout or attempt
    than the path (``conflicting_ids``: which one the caller meant cannot be told).
    """
    params = request.path_params
    for name, key in (("rollout_id", "x-agl-rollout-id"), ("attempt_id", "x-agl-attempt-id")):
        said = header(request, key)
        if params.get(name) and said is not None and said != params[name]:
            raise bad_request(f"the {key} header ({said!r:.80}) names another {name.split('_')[0]} than the path "
                              f"({params[name]!r:.80})", "conflicting_ids")
    rid = params.get("rollout_id") or header(request, "x-agl-rollout-id")
    aid = params.get("attempt_id") or header(request, "x-agl-attempt-id")
    if rid:
        try:
            check_rollout_id(rid)
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_rollout") from None
    if aid is not None:
        try:
            check_attempt_id(aid)
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_attempt") from None
    return rid or None, aid


def _bad_key() -> ApiError:
    return ApiError(401, "invalid API key for this rollout attempt", "authentication_error", "invalid_api_key")


async def resolve_identity(request: Request, st: GatewayState, create: bool = True) -> Identity:
    """Rollout and attempt of the request, checked against the store and the key.

    ``create``: with ``--open``, create a rollout named for the first time (model calls do; ``/v1/models``
    does not). Raises ``ApiError``: 400 (no rollout id, bad attempt id), 401 (missing key, or a key that is
    neither the admin key nor the attempt's scoped key: also when the rollout does not exist), 404 (unknown
    rollout, to a caller holding a valid key), 409 (stale attempt), 503 (Redis down).
    """
    rid, aid = named_attempt(request)
    if not rid:
        raise bad_request("no rollout: use /rollouts/{id}/attempts/{n}/v1 or the X-AGL-Rollout-Id header",
                          "missing_rollout")
    key, presented = st.settings.key, presented_key(request)
    if key and not presented:
        raise ApiError(401, "missing API key", "authentication_error", "invalid_api_key")
    if key and aid is not None and not key_allows(key, presented, rid, aid):
        raise _bad_key()  # before any lookup: a wrong key learns nothing about which rollouts exist
    try:
        try:
            rollout = await st.store.get_rollout(rid)
        except RolloutNotFound:
            if key and aid is None and not key_allows(key, presented, None, None):
                raise _bad_key() from None  # unverifiable without the attempt: the same 401 as a wrong key
            if not (st.settings.open and create):
                raise ApiError(404, f"unknown rollout {rid!r}", "not_found_error", "rollout_not_found") from None
            try:
                rollout = await st.store.create_rollout(
                    Rollout(rollout_id=rid, attempt_id=aid or "0", status=RolloutStatus.running,
                            started_at=time.time()), enqueue=False)
            except ValueError:  # created concurrently by another call
                rollout = await st.store.get_rollout(rid)
    except RedisError as exc:
        log.warning("store unavailable while resolving %r: %r", rid, exc)
        raise store_down() from None
    if aid is None:
        aid = _attempt_of_key(key, presented, rollout) if key else rollout.attempt_id
    if key and not key_allows(key, presented, rid, aid):
        raise _bad_key()
    if aid != rollout.attempt_id:
        raise not_current(rid, aid, rollout.attempt_id)
    return Identity(rid, aid, rollout)


def not_current(rid: str, aid: str, current: str) -> ApiError:
    """The 409 ``stale_attempt`` (CONTRACT §1) for attempt ``aid`` of rollout ``rid`` when ``current`` is the
    rollout's attempt: an earlier attempt "is stale", a later one "has not started" (same code: neither may
    call or report). Attempt ids are decimal strings."""
    if aid.isdecimal() and current.isdecimal() and int(aid) > int(current):
        state = f"has not started (current attempt: {current})"
    else:
        state = f"is stale (current attempt: {current})"
    return ApiError(409, f"attempt {aid} of rollout {rid!r} {state}", "conflict_error", "stale_attempt")


#: How many earlier attempts a scoped key is matched against when the headers name no attempt (retries are few).
STALE_KEYS_CHECKED = 16


def _attempt_of_key(key: str, presented: str | None, rollout: Rollout) -> str:
    """The attempt a request naming only its rollout acts for: the current one, or the earlier attempt whose
    scoped key it presents (so that a retried harness's late call is the 409 a path-form call gets, not a 401)."""
    current = int(rollout.attempt_id)
    if key_allows(key, presented, None, None):  # the admin key acts for the current attempt
        return rollout.attempt_id
    for earlier in range(current - 1, max(-1, current - 1 - STALE_KEYS_CHECKED), -1):
        if key_allows(key, presented, rollout.rollout_id, str(earlier)):
            return str(earlier)
    return rollout.attempt_id


async def authorize(request: Request, st: GatewayState) -> None:
    """The key check of a route that acts for no rollout in particular (``GET /v1/models``): the admin
    key, or the scoped key of the attempt the path or headers name (resolved as model calls resolve it).
    Without a configured key, everyone. Raises ``ApiError`` 401 (and what :func:`resolve_identity` raises)."""
    key = st.settings.key
    if not key or key_allows(key, presented_key(request), None, None):
        return
    rid, _ = named_attempt(request)
    if not rid:
        raise ApiError(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
    await resolve_identity(request, st, create=False)


def check_callable(ident: Identity) -> None:
    """Model calls are accepted only while the rollout is queuing or running (409 otherwise)."""
    if ident.rollout.status in TERMINAL:
        raise ApiError(409, f"rollout {ident.rollout_id!r} is {ident.rollout.status.value}", "conflict_error",
                       "rollout_finished")


async def caller_and_body(request: Request, st: GatewayState, create: bool = True,
                          unique_keys: bool = False) -> tuple[Identity, dict]:
    """The caller's :class:`Identity` and its JSON body, in the one order every agent route uses: with a key,
    who is asking before what they sent (a caller without the key gets 401, no word on its body, and no body is
    buffered for it); open (``--open``), the body first, so that a rollout is created only for a well-formed
    call. ``unique_keys``: as :func:`agl_gateway.body.read_json`. Raises ``ApiError`` as :func:`resolve_identity` and
    :func:`agl_gateway.body.read_json` do."""
    if st.settings.key:
        try:  # the key is checked here; a rollout to create (--open) waits for a well-formed body
            ident = await resolve_identity(request, st, create=False)
            return ident, await read_json(request, st.settings.max_body_bytes, unique_keys=unique_keys)
        except ApiError as err:
            if not (create and st.settings.open and err.code == "rollout_not_found"):
                raise
        body = await read_json(request, st.settings.max_body_bytes, unique_keys=unique_keys)
        return await resolve_identity(request, st, create), body
    body = await read_json(request, st.settings.max_body_bytes, keyless=True, unique_keys=unique_keys)
    return await resolve_identity(request, st, create), body
