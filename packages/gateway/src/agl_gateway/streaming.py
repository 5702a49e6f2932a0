"""Live relay of a streamed chat call (``stream: true``), and the gate slot such a stream holds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from fastapi.responses import StreamingResponse

from .capture import MalformedUpstream, float_list, int_list
from .engines import NoEngine
from .errors import ApiError
from .gate import PauseGate
from .proxy import (ABORTED, JSON_HEADERS, GatewayState, Identity, RouteSpec, new_record, observe, record,
                    record_failure)


class GateSlot:
    """One call's place in the pause gate, released exactly once."""

    def __init__(self, gate: PauseGate):
        self.gate = gate
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.gate.leave()


class SlotStreamingResponse(StreamingResponse):
    """A stream that releases its gate slot when the response ends, however it ends: also when its body
    iterator never started (the agent went away first), where the iterator's own ``finally`` never runs."""

    def __init__(self, content: Any, slot: GateSlot, **kw: Any):
        super().__init__(content, **kw)
        self.slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()


def _sse_error(err: ApiError) -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}}) + b"\n\n"


async def stream_chat(st: GatewayState, ident: Identity, spec: RouteSpec, body: dict[str, Any],
                      upstream: dict[str, Any], slot: GateSlot) -> AsyncIterator[bytes]:
    """Relay a live chat stream, capturing prompt ids (first chunk), per-chunk ids and logprobs.

    The record is written before ``[DONE]`` is sent; if the engine's ids do not add up to
    ``usage.completion_tokens`` the record is kept with ``status: "error"`` (no training row). A stream
    that ends without ``[DONE]``, or with chunks of the wrong shape, is an error (recorded; the agent gets
    an error event, never ``[DONE]``). The gate slot taken by the caller is released when the stream ends,
    however it ends.
    """
    policy = st.policy
    rec = new_record(ident, spec, body, policy)
    t0 = time.perf_counter()
    try:
        wants_logprobs = bool(body.get("logprobs"))
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        prompt_ids: list[int] = []
        ids: list[int] = []
        lps: list[float] = []
        text: list[str] = []
        tool_calls: dict[int, dict[str, Any]] = {}
        finish = usage = first = None
        done = False
        payload = {**upstream, "model": policy.model, "stream": True, "stream_options": {"include_usage": True}}
        try:
            try:
                engine = st.engines.pick(ident.rollout_id)
            except NoEngine:
                raise ApiError(502, "no upstream engine reachable", "server_error", "upstream_unreachable") from None
            async with st.http.post(engine + spec.path, data=orjson.dumps(payload), headers=JSON_HEADERS) as resp:
                if resp.status != 200:
                    await resp.read()
                    raise ApiError(502 if resp.status >= 500 else resp.status,
                                   f"upstream refused the request ({resp.status})", "server_error",
                                   "upstream_error")
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = orjson.loads(data)
                    if not isinstance(chunk, dict):
                        raise MalformedUpstream("a stream chunk is not an object")
                    first = first or chunk
                    prompt_ids = int_list(chunk.pop("prompt_token_ids", None), "prompt_token_ids") or prompt_ids
                    for field in ("prompt_text", "prompt_logprobs", "kv_transfer_params", "ec_transfer_params"):
                        chunk.pop(field, None)
                    choices = chunk.get("choices") or []
                    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                        raise MalformedUpstream("'choices' is not a list of objects")
                    for ch in choices:
                        if ch.get("index", 0) == 0:
                            ids += int_list(ch.get("token_ids"), "token_ids")
                            lp = ch.get("logprobs") or {}
                            content = lp.get("content") or []
                            lps += float_list([t.get("logprob", 0.0) for t in content], "logprobs")
                            delta = ch.get("delta") or {}
                            piece = delta.get("content") or ""
                            if not isinstance(piece, str):
                                raise MalformedUpstream("'delta.content' is not a string")
                            text.append(piece)
                            for tc in delta.get("tool_calls") or []:
                                acc = tool_calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                                  "function": {"name": "", "arguments": ""}})
                                acc["id"] = tc.get("id") or acc["id"]
                                fn = tc.get("function") or {}
                                acc["function"]["name"] += fn.get("name") or ""
                                acc["function"]["arguments"] += fn.get("arguments") or ""
                            finish = ch.get("finish_reason") or finish
                            if finish is not None and not isinstance(finish, str):
                                raise MalformedUpstream("'finish_reason' is not a string")
                        ch.pop("token_ids", None)
                        if not wants_logprobs:
                            ch["logprobs"] = None
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        if not isinstance(usage, dict):
                            raise MalformedUpstream("'usage' is not an object")
                        if not wants_usage:
                            continue
                    if "model" in body:
                        chunk["model"] = body["model"]
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except TimeoutError:
            raise ApiError(504, "upstream engine timed out", "server_error", "upstream_timeout") from None
        except aiohttp.ClientError as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                st.engines.mark_down(engine)
            raise ApiError(502, f"upstream stream failed: {type(exc).__name__}", "server_error",
                           "upstream_unreachable") from None
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # JSON errors, MalformedUpstream...
            raise ApiError(502, f"upstream sent a malformed stream ({type(exc).__name__})", "server_error",
                           "upstream_error") from None
        if not done:
            raise ApiError(502, "upstream stream ended before [DONE]", "server_error", "upstream_error")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if tool_calls:
            message["tool_calls"] = [tool_calls[k] for k in sorted(tool_calls)]
        rec["response"] = {"id": (first or {}).get("id"), "object": "chat.completion",
                        "created": (first or {}).get("created"), "model": body.get("model", policy.model),
                        "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
        rec["prompt_token_ids"], rec["response_token_ids"] = prompt_ids, ids
        rec["response_logprobs"] = lps if len(lps) == len(ids) else None
        rec["finish_reason"] = finish
        rec["latency_ms"] = (time.perf_counter() - t0) * 1000
        rec["ended_at"] = time.time()
        if usage and usage.get("completion_tokens") != len(ids):
            rec["status"] = "error"
            rec["error"] = f"stream token ids incomplete: {len(ids)} of {usage.get('completion_tokens')}"
        if finish in ABORTED:
            rec["status"], rec["error"] = "error", "upstream aborted the request"
            await record(st, rec)
            yield _sse_error(ApiError(503, "upstream aborted the request (weight update); retry", "server_error",
                                      "upstream_aborted"))
            return
        await record(st, rec)
        observe(st, rec)
        yield b"data: [DONE]\n\n"
    except ApiError as err:
        if rec["ended_at"] == 0.0:
            with contextlib.suppress(ApiError):
                await record_failure(st, rec, err, t0)
        yield _sse_error(err)
    finally:
        slot.release()
