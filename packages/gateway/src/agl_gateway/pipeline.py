"""One model call, for every route and mode: identity → gate → forward → capture and check → record → reply.

1. Parse the body (400/413), resolve the rollout attempt and check the key (:mod:`.identity`: 400, 401,
   404, 409; ``--open`` creates the rollout).
2. Pass the pause gate (held while paused; 503 after ``max_hold``).
3. Forward to the rollout's engine with ``return_token_ids`` and ``logprobs`` forced on
   (:mod:`.upstream`: failover between engines, one error mapping: 400/502/503/504).
4. Capture ids and logprobs and check them (:mod:`.capture`): a capture that cannot be trained on is
   recorded with ``status: error``, and the agent still gets its answer.
5. Record to Redis (:mod:`.recording`; 503 if Redis fails), before the agent has the whole answer.
6. Reply. An answer cut by a weight update (``finish_reason: abort``) is recorded and the call is retried
   once the gate reopens (at most :data:`MAX_ABORT_RETRIES` tries), as long as the agent has seen nothing.

The reply is delivered as JSON, as a stream synthesized from the complete answer (Anthropic, Responses,
chat with tools or ``n > 1``), or live (:mod:`.streaming`, chat with ``stream: true``): the same pipeline
in each case, run in its own task for a live stream so that an agent that goes away still leaves a record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from agl_common.schemas import MAX_JSON_DEPTH, Policy, UnknownRole, route_call, too_deep
from agl_common.store import RolloutNotFound
from fastapi import Request
from redis.exceptions import RedisError
from fastapi.responses import Response, StreamingResponse

from . import translate
from .capture import Captured, MalformedUpstream, StreamCapture, agent_view, capture_answer, unreadable
from .errors import ApiError, bad_request, store_down
from .gate import GateClosed, HeldTooLong, TooManyHeld
from .identity import Identity, caller_and_body, check_callable, header, not_current
from .recording import check_room, fill, new_record, observe, write, write_failure
from .state import GatewayState, state_of
from .streaming import DONE, LiveRelay, RelayResponse, read_stream
from .upstream import call_json, current_policy

log = logging.getLogger("agl.gateway")


@dataclass
class RouteSpec:
    """How one model route maps onto the engine's OpenAI routes.

    ``path``: the engine route (under ``/v1``); ``force``: fields forced on upstream so that every call
    can be trained on; ``to_upstream`` translates the agent's body into the engine's (None: pass
    through); ``to_agent`` translates the engine's answer back; ``sse`` encodes a complete answer as a
    stream; ``live_stream``: chat streams are relayed live (without tools, ``n == 1``).
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


def was_aborted(cap: Captured) -> bool:
    """Whether the engine aborted the generation of any choice (a weight update cut it)."""
    return any(f in ABORTED for f in cap.finishes())


MAX_ABORT_RETRIES = 3


async def enter_gate(st: GatewayState, who: str = "") -> bool:
    """Take a slot in the pause gate (pair with ``st.gate.leave()``) for attempt ``who``; returns whether the call
    was held. ``ApiError`` 503 if held too long, if ``who`` has too many calls held, or if the gateway is shutting
    down."""
    try:
        return await st.gate.enter(who)
    except TooManyHeld:
        raise ApiError(503, f"this attempt has {st.gate.max_held_per_attempt} calls held or in flight already",
                       "server_error", "too_many_in_flight", {"Retry-After": "5"}) from None
    except HeldTooLong:
        raise ApiError(503, f"gateway paused for a weight update; call held over {st.settings.max_hold:g} s",
                       "server_error", "paused", {"Retry-After": "5"}) from None
    except GateClosed:
        raise ApiError(503, "gateway shutting down; retry (another replica, or this one once restarted)",
                       "server_error", "shutting_down", {"Retry-After": "1"}) from None


def check_not_displaced(st: GatewayState) -> None:
    """``ApiError`` 503 ``replica_displaced`` if another gateway took this replica's id: no drain counts this
    replica any more, so a call forwarded now could cross a weight update. Checked inside the gate."""
    if st.displaced:
        raise ApiError(503, f"gateway replica {st.settings.replica_id!r} lost its id to another gateway; retry (on "
                       "another replica)", "server_error", "replica_displaced", {"Retry-After": "1"})


def route(policy: Policy, body: dict[str, Any], role: str | None) -> tuple[str | None, str]:
    """``(role, served model name)`` of a call (:func:`agl_common.schemas.route_call` on its body's ``model``
    and its ``X-AGL-Role`` header); ``ApiError`` 400 ``unknown_role`` naming the known roles."""
    try:
        return route_call(policy, body.get("model"), role)
    except UnknownRole as exc:
        raise bad_request(str(exc), "unknown_role") from None


def check_conversation(messages: Any) -> None:
    """The engine's chat request holds a conversation: a non-empty list of objects with a string ``role``.
    Checked after translation, for every route that ends on the engine's chat route, so that nothing
    the agent sent is silently turned into an empty or unreadable conversation (the engine would answer
    one with text nobody asked for, or a 5xx). Raises ``ApiError`` 400."""
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of messages")
    if not messages:
        raise bad_request("the request holds no message to answer")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"message {i} must be an object with a string 'role', got {message!r:.40}")


def _token_ids(value: Any) -> bool:
    """``value`` is a non-empty list of token ids (JSON integers)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


#: Most choices (``n``) one call may ask for: the caps on calls in flight and records count calls, and one call of
#: ``n: 100000`` would queue that many generations on the engine before any answer bound could refuse it.
MAX_CHOICES = 16


def upstream_body(spec: RouteSpec, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's request for the agent's ``body`` (translated, stream fields removed, ``force`` set);
    ``ApiError`` 400 if it cannot be made (also for a ``stream``, or a chat ``logprobs``, that is not a JSON
    boolean: ``"false"`` would otherwise read as true; for an ``n`` that is not a JSON integer from 1 to
    :data:`MAX_CHOICES`; for a
    completions ``prompt`` that is not one prompt; and for a ``stream_options`` that is not an object, which the engine or a synthesized stream would fail on after the
    call)."""
    for flag in ("stream", "logprobs") if spec.route == "chat" else ("stream",):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise bad_request(f"'{flag}' must be true or false, got {body[flag]!r:.40}")
    if spec.route == "completions" and body.get("logprobs") is not None and not (
            type(body["logprobs"]) is int and body["logprobs"] >= 0):
        raise bad_request(f"'logprobs' must be a non-negative integer, got {body['logprobs']!r:.40}")
    if body.get("n") is not None and not (type(body["n"]) is int and 1 <= body["n"] <= MAX_CHOICES):  # (the engine
        raise bad_request(f"'n' must be an integer from 1 to {MAX_CHOICES}, got {body['n']!r:.40}")  # reads 2.0 as 2)
    prompt = body.get("prompt")
    if spec.route == "completions" and not (isinstance(prompt, str) or _token_ids(prompt) or (
            isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _token_ids(prompt[0])))):
        raise bad_request("'prompt' must be one prompt (a string or a list of token ids): a batch of prompts "
                          f"would be answered as several choices, got {prompt!r:.40}")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise bad_request(f"'stream_options' must be an object, got {body['stream_options']!r:.40}")
    for name, value in (body.get("stream_options") or {}).items():  # the gateway asks the engine for its own
        if name not in ("include_usage", "include_obfuscation") and value not in (None, False):
            raise bad_request(f"'stream_options.{name:.40}' is not carried by this gateway (only include_usage)")
    upstream = spec.to_upstream(body) if spec.to_upstream else dict(body)
    if spec.path == "/chat/completions":
        check_conversation(upstream.get("messages"))
    if not isinstance(body.get("model", ""), str):
        raise bad_request("'model' must be a string")
    if spec.to_upstream:
        try:  # a translated body must be forwardable (chat/completions bodies are parsed JSON already)
            orjson.dumps(upstream)
        except TypeError as exc:
            raise bad_request(f"request cannot be translated for the engine: {exc}") from None
    for name in ("stream", "stream_options"):
        upstream.pop(name, None)
    upstream.update(spec.force)
    if spec.route == "completions" and body.get("logprobs") is not None:
        upstream["logprobs"] = body["logprobs"]  # the sampled token's logprob comes with any top-k the agent asks
    return upstream


async def model_call(request: Request, spec: RouteSpec) -> Response:
    """The full path of one call on a model route; returns the agent's answer (JSON or SSE)."""
    st = state_of(request)
    t_call = time.perf_counter()
    ident, body = await caller_and_body(request, st)
    check_callable(ident)
    if spec.to_upstream is not None:
        await translate.ready()  # LiteLLM is imported off the event loop
    upstream = upstream_body(spec, body)
    stream = bool(body.get("stream"))
    if stream and not (spec.sse or spec.live_stream):
        raise bad_request(f"stream=true is not supported on the {spec.route} route", "stream_unsupported")
    role = header(request, "x-agl-role")
    if st.policy is not None:
        route(st.policy, body, role)  # a call of no known role is refused now, not after a pause
    call = Call(st, ident, spec, body, upstream, t_call, role, AgentWatch(request))
    if stream and spec.live_stream and not body.get("tools") and body.get("n", 1) == 1:
        relay = LiveRelay()
        call.watch = None  # (the relay knows whether its agent is there: RelayResponse listens once it answers)
        task = asyncio.create_task(call.run_live(relay))
        st.tasks.add(task)
        task.add_done_callback(st.tasks.discard)
        left = asyncio.ensure_future(AgentWatch(request).left())
        try:
            await asyncio.wait({relay.started, left}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            relay.agent_gone()
            raise
        finally:
            left.cancel()
        if not relay.started.done():  # the agent left before the first event (held by a pause, or a slow engine)
            relay.agent_gone()
            return Response(status_code=499)
        relay.started.result()  # an error before the first event is raised here: its own status
        return RelayResponse(relay)
    out = await call.run(None, sse=stream)
    if out is None:  # the agent went away (nobody reads this; 499 as nginx logs it)
        return Response(status_code=499)
    if isinstance(out, list):
        return StreamingResponse(iter(out), media_type="text/event-stream")
    return Response(out, media_type="application/json")


T = TypeVar("T")


class AgentWatch:
    """Whether the agent of a call that is not a live stream is still there: once the whole body is read, the
    ASGI server's ``receive`` gives ``http.disconnect`` when the agent's connection closes (and only then, or once
    the answer is sent)."""

    def __init__(self, request: Request):
        self.request, self.gone = request, False

    async def left(self) -> None:
        """Return once the agent went away (raced against the engine's answer: :meth:`Call.run`)."""
        while not self.gone:
            if (await self.request.receive()).get("type") == "http.disconnect":
                self.gone = True
            else:  # (no ASGI server sends more after the whole body; never spin if one did)
                await asyncio.sleep(0.1)

    async def disconnected(self) -> bool:
        """Whether the agent went away, without waiting (Starlette's ``is_disconnected``)."""
        self.gone = self.gone or await self.request.is_disconnected()
        return self.gone


async def _unless_gone(answer: Awaitable[T], watch: AgentWatch | LiveRelay | None) -> T | None:
    """``await answer``, or ``None`` as soon as the agent went away first (``watch.left()`` returned): ``answer`` is
    then cancelled. An engine call's connection closes (vLLM aborts the generation), so an abandoned call neither
    keeps the engine busy nor holds a pause's drain; a call held by a pause gives its slot back at once."""
    task = asyncio.ensure_future(answer)
    if watch is None:
        return await task
    gone = asyncio.ensure_future(watch.left())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # (its cancellation reached the engine's connection)
    return None


class Call:
    """One call going through the pipeline (see the module docstring)."""

    def __init__(self, st: GatewayState, ident: Identity, spec: RouteSpec, body: dict[str, Any],
                 upstream: dict[str, Any], t_call: float, role: str | None = None, watch: AgentWatch | None = None):
        self.st, self.ident, self.spec, self.body, self.upstream, self.t_call = st, ident, spec, body, upstream, t_call
        self.role = role  # the X-AGL-Role header, if sent
        self.watch = watch  # whether the agent went away (not for a live stream: its relay knows)

    async def disconnected(self) -> bool:
        return self.watch is not None and await self.watch.disconnected()

    async def run_live(self, relay: LiveRelay) -> None:
        """:meth:`run` as the task of a live stream: every outcome ends the relay."""
        try:
            await self.run(relay)
        except ApiError as err:
            relay.fail(err)
        except asyncio.CancelledError:
            relay.fail(ApiError(503, "gateway shutting down", "server_error", "shutting_down", {"Retry-After": "1"}))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: answered 500, logged
            log.exception("live stream failed")
            relay.fail(ApiError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error"))

    async def run(self, relay: LiveRelay | None, sse: bool = False) -> bytes | list[bytes] | None:
        """Gate → forward (abort retries) → capture and check → record. Returns the encoded answer
        (JSON bytes, or SSE events with ``sse``); with a ``relay``, delivers to it and returns ``None``.
        Raises ``ApiError``."""
        st = self.st
        waited = 0.0  # seconds held by a pause or spent on aborted tries: not added by the gateway
        for _ in range(MAX_ABORT_RETRIES):
            t_gate = time.perf_counter()
            who = f"{self.ident.rollout_id}/{self.ident.attempt_id}"
            held = await _unless_gone(enter_gate(st, who), self.watch if relay is None else relay)
            if held is None:  # the agent left while a pause held its call: its slot is free, nothing forwarded
                return None
            waited += time.perf_counter() - t_gate
            try:
                check_not_displaced(st)
                if held:  # minutes may have passed: the rollout may have ended, the agent may have left
                    await self._still_wanted(relay)
                await check_room(st, self.ident.rollout_id, self.ident.attempt_id)
                policy = await current_policy(st)
                role, served = route(policy, self.body, self.role)
                rec = new_record(self.ident.rollout_id, self.ident.attempt_id, self.spec.route, self.body, policy,
                                 served, role)
                payload = {**self.upstream, "model": served}
                t0 = time.perf_counter()
                try:
                    if relay is None:
                        data = await _unless_gone(call_json(st, self.ident.rollout_id, self.spec.path, payload),
                                                  self.watch)
                        if data is None:  # the agent went away first: nothing to answer, the call is recorded
                            await write_failure(st, rec, "abandoned: the agent went away before the engine answered",
                                                t0)
                            return None
                        cap, answer, out = self._complete(data, sse)
                        tail: list[bytes] = []
                    else:
                        got = await self._stream(relay, payload, rec, t0)
                        if got is None:  # the agent went away: recorded as abandoned
                            return None
                        cap, answer, tail = got
                        out = None
                except ApiError as err:
                    await write_failure(st, rec, err, t0)
                    raise
                upstream_s = time.perf_counter() - t0
                if was_aborted(cap):
                    aborted = ApiError(503, "upstream aborted the request (weight update); retry", "server_error",
                                       "upstream_aborted", {"Retry-After": "1"})
                    if relay is None or relay.sent == 0:  # the agent saw nothing: retry once the gate reopens
                        await write_failure(st, rec, aborted, t0)
                        waited += time.perf_counter() - t0
                        continue
                    fill(rec, cap, answer, t0, error=f"{aborted.status} {aborted.code}: {aborted.message}")
                    await write(st, rec)
                    relay.fail(aborted)
                    return None
                # a stream the agent can read no answer from ends with an upstream error (a non-stream answer
                # like it is one already: _complete); the engine's own error event has reached the agent
                broken = None if relay is None or cap.error else unreadable(cap)
                gone = (relay is not None and relay.gone) or await self.disconnected()
                # an answer the agent never received is not part of its trajectory (an SDK timeout then retries:
                # two ok records for one turn): kept, as an error (a live stream's agent leaving mid-stream: see
                # _stream; one that left before the first event, and the engine's answer came whole: here)
                fill(rec, cap, answer, t0, error="abandoned: the agent went away before its answer" if gone else None)
                await write(st, rec)
                observe(st, rec)
                st.metrics.route(st.metrics.added_seconds, self.spec.route).observe(
                    time.perf_counter() - self.t_call - waited - upstream_s)
            finally:
                st.gate.leave(who)
            if broken:
                relay.fail(ApiError(502, f"upstream engine sent no usable answer: {broken}"[:500], "server_error",
                                    "upstream_error"))
            elif relay is not None:
                relay.end(tail + [DONE])
            return out
        raise ApiError(503, f"upstream aborted the request {MAX_ABORT_RETRIES} times", "server_error",
                       "upstream_aborted", {"Retry-After": "5"})

    async def _still_wanted(self, relay: LiveRelay | None) -> None:
        """After a pause held the call: ``ApiError`` 409/404 if its rollout finished, was retried or is gone
        meanwhile (as :func:`agl_gateway.identity.check_callable` would have answered), 400
        ``client_disconnected`` if the agent went away while it was held. Nothing is forwarded then."""
        rid, aid = self.ident.rollout_id, self.ident.attempt_id
        if (relay is not None and relay.gone) or await self.disconnected():
            raise bad_request("the agent went away while its call was held", "client_disconnected")
        try:
            rollout = await self.st.store.get_rollout(rid)
        except RolloutNotFound:
            raise ApiError(404, f"unknown rollout {rid!r}", "not_found_error", "rollout_not_found") from None
        except RedisError:
            raise store_down() from None
        if rollout.attempt_id != aid:
            raise not_current(rid, aid, rollout.attempt_id)
        check_callable(Identity(rid, aid, rollout))

    def _complete(self, data: dict[str, Any], sse: bool) -> tuple[Captured, dict[str, Any] | None, Any]:
        """Capture of a complete answer, the agent's answer and its encoding (encoded now, so that nothing
        can fail once the agent's answer has started); ``ApiError`` 502 for a malformed answer."""
        spec, body = self.spec, self.body
        try:
            cap = capture_answer("completions" if spec.path == "/completions" else "chat", data,
                                 self.upstream.get("n") or 1)  # (checked by upstream_body)
            if was_aborted(cap):
                return cap, None, None
            why = unreadable(cap)
            if why:
                raise MalformedUpstream(why)
            answer = agent_view(spec.route, data, body)
            if spec.to_agent:
                answer = spec.to_agent(answer, body)
            if too_deep(answer):
                raise MalformedUpstream(f"answer nested deeper than {MAX_JSON_DEPTH} levels")
            out = list(spec.sse(answer, body)) if sse and spec.sse else translate.dumps(answer)
        except Exception as exc:  # noqa: BLE001 -- wrong types from the engine, or LiteLLM refusing its answer
            raise ApiError(502, f"upstream engine sent a malformed answer ({type(exc).__name__}: {exc})"[:500],
                           "server_error", "upstream_error") from None
        return cap, answer, out

    async def _stream(self, relay: LiveRelay, payload: dict[str, Any], rec: dict[str, Any],
                      t0: float) -> tuple[Captured, dict[str, Any], list[bytes]] | None:
        """Relay the engine's stream (:func:`read_stream`, in its own task so that the agent going away can
        stop it); returns the capture, the complete answer and the held-back events, or ``None`` once a
        call the agent abandoned is recorded (with what was captured, ``status: error``)."""
        sc = StreamCapture(self.body, payload["model"])
        reader = asyncio.create_task(read_stream(
            self.st, self.ident.rollout_id, self.spec.path,
            {**payload, "stream": True, "stream_options": {"include_usage": True}}, sc, relay))
        relay.reader = reader
        if relay.gone:
            reader.cancel()
        try:
            tail = await reader
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not relay.gone or (task is not None and task.cancelling()):
                raise
            cap, answer = sc.result()
            fill(rec, cap, answer, t0, error=f"abandoned: the agent closed the stream after {relay.sent} events")
            await write(self.st, rec)
            return None
        finally:
            relay.reader = None
        cap, answer = sc.result()
        return cap, answer, tail
