"""Anthropic Messages and OpenAI Responses ⇄ Chat Completions, through LiteLLM's own adapters.

The gateway forwards every translated call to the engine's chat route itself (so token ids and logprobs
are kept: LiteLLM's SDK paths drop them), and uses LiteLLM only for the request and response shapes.
LiteLLM takes ~4 s to import: it is loaded on first use, in a daemon thread that translated calls
``await ready()`` for (the event loop itself never imports it).

Also here: the server-sent-event encodings of a *complete* answer, used when a stream is synthesized
from a non-streamed upstream call (Anthropic and Responses streams, chat streams with tools).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from functools import cache
from typing import Any

import orjson

from .errors import bad_request

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@cache
def _litellm():
    import litellm
    from litellm.llms.anthropic.messages.adapters.transformation import AnthropicAdapter
    from litellm.responses.litellm_completion_transformation.transformation import (
        LiteLLMCompletionResponsesConfig,
    )

    litellm.suppress_debug_info = True
    return litellm, AnthropicAdapter(), LiteLLMCompletionResponsesConfig


# The event loop never imports LiteLLM itself: an import running in another thread holds that module's
# import lock, and a loop thread waiting on it answers nothing (not even /healthz) until the import ends:
# seconds when idle, minutes on a machine busy with other work (measured, issue 14). Translated routes
# ``await ready()`` first; the import runs in a daemon thread (a stopping process does not wait for it).
_loaded = threading.Event()
_lock = threading.Lock()
_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
_thread: threading.Thread | None = None
_error: BaseException | None = None


def warm() -> None:
    """Import LiteLLM now, in the calling thread (blocking; for tests and scripts, not the event loop)."""
    _litellm()
    _loaded.set()


def _import_and_wake() -> None:
    global _error
    try:
        _litellm()
    except BaseException as exc:  # noqa: BLE001 - reported to every waiter
        _error = exc
    with _lock:
        _loaded.set()
        waiters, _waiters[:] = _waiters[:], []
    for loop, fut in waiters:
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
            loop.call_soon_threadsafe(_settle, fut)


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def warm_in_background() -> None:
    """Start importing LiteLLM in a daemon thread (once); returns at once."""
    global _thread
    with _lock:
        if _thread is None and not _loaded.is_set():
            _thread = threading.Thread(target=_import_and_wake, name="litellm-import", daemon=True)
            _thread.start()


async def ready() -> None:
    """Return once LiteLLM is imported, without blocking the event loop (starts the import if needed).

    Raises ``RuntimeError`` if the import failed."""
    if not _loaded.is_set():
        warm_in_background()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with _lock:
            if _loaded.is_set():
                fut.set_result(None)
            else:
                _waiters.append((loop, fut))
        await fut
    if _error is not None:
        raise RuntimeError(f"LiteLLM could not be imported: {_error!r}")


def _dump(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    return orjson.loads(obj.model_dump_json(by_alias=True, exclude_none=False))


def _check_turns(turns: Any, roles: tuple[str, ...], what: str, content_required: bool) -> None:
    """Every turn of a translated conversation names a known role and, where required, has a content
    (a string or a list of blocks). LiteLLM's adapters drop a turn they cannot read without a word: a
    ``"robot"`` turn, or an Anthropic ``content: 5``, would reach the engine as a conversation without
    it, and the agent would get an answer to a question it did not ask. Raises ``ApiError`` 400."""
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise bad_request(f"invalid {what} request: item {i} must be an object, got {turn!r:.40}")
        if "role" in turn or content_required:
            if turn.get("role") not in roles:
                raise bad_request(f"invalid {what} request: item {i} has role {turn.get('role')!r:.40}; "
                                  f"expected one of {', '.join(roles)}")
            content = turn.get("content")
            if (content_required or "content" in turn) and not isinstance(content, str | list):
                raise bad_request(f"invalid {what} request: item {i} content must be a string or a list of "
                                  f"blocks, got {content!r:.40}")


# --------------------------------------------------------------------------------------- Anthropic
def anthropic_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic Messages request → Chat Completions request. Raises ``ApiError`` 400 for a turn with a role
    other than ``user``/``assistant`` or without a string/list content, or if LiteLLM refuses it."""
    _, adapter, _ = _litellm()
    if isinstance(body.get("messages"), list):
        _check_turns(body["messages"], ("user", "assistant"), "Anthropic Messages", content_required=True)
    try:
        req = adapter.translate_completion_input_params(
            {k: v for k, v in body.items() if k not in ("stream",)})
    except Exception as exc:  # LiteLLM raises ValueError/KeyError/pydantic errors on bad shapes
        raise bad_request(f"invalid Anthropic Messages request: {exc}") from None
    if req is None:
        raise bad_request("invalid Anthropic Messages request")
    return dict(req)


def chat_to_anthropic(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Chat Completions answer → Anthropic message (``model`` as the agent asked)."""
    litellm, adapter, _ = _litellm()
    out = _dump(adapter.translate_completion_output_params(litellm.ModelResponse(**answer)))
    out["model"] = body.get("model", out.get("model"))
    return out


def anthropic_sse(message: dict[str, Any], body: dict[str, Any] | None = None) -> Iterator[bytes]:
    """The Anthropic streaming events of a complete ``message`` (text and tool_use blocks)."""

    def event(name: str, data: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    usage = message.get("usage") or {}
    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": usage.get("input_tokens", 0), "output_tokens": 0}}
    yield event("message_start", {"type": "message_start", "message": start})
    for i, block in enumerate(message.get("content") or []):
        if block.get("type") == "tool_use":
            yield event("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {**block, "input": {}}})
            yield event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": orjson.dumps(block.get("input") or {}).decode()}})
        else:
            yield event("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"type": "content_block_delta", "index": i,
                                                "delta": {"type": "text_delta", "text": block.get("text", "")}})
        yield event("content_block_stop", {"type": "content_block_stop", "index": i})
    yield event("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": message.get("stop_reason"),
                                            "stop_sequence": message.get("stop_sequence")},
                                  "usage": {"output_tokens": usage.get("output_tokens", 0)}})
    yield event("message_stop", {"type": "message_stop"})


# --------------------------------------------------------------------------------------- Responses
def _responses_params(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("model", "input", "stream")}


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI Responses request → Chat Completions request. Raises ``ApiError`` 400 on a bad request: no
    ``input``, one that is neither a string nor a list of items, an item that is not an object, or a message
    item with a role other than ``user``/``assistant``/``system``/``developer``."""
    _, _, config = _litellm()
    if "input" not in body:
        raise bad_request("invalid Responses request: 'input' is required")
    if not isinstance(body["input"], str | list):
        raise bad_request(f"invalid Responses request: 'input' must be a string or a list of items, "
                          f"got {body['input']!r:.40}")
    if isinstance(body["input"], list):
        _check_turns(body["input"], ("user", "assistant", "system", "developer"), "Responses",
                     content_required=False)
    try:
        req = config.transform_responses_api_request_to_chat_completion_request(
            model=str(body.get("model") or "m"), input=body["input"], responses_api_request=_responses_params(body))
    except Exception as exc:
        raise bad_request(f"invalid Responses request: {exc}") from None
    return {k: v for k, v in dict(req).items() if v is not None and not k.startswith("litellm")}


def chat_to_responses(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Chat Completions answer → Responses API response object."""
    _, _, config = _litellm()
    out = _dump(config.transform_chat_completion_response_to_responses_api_response(
        request_input=body.get("input"), responses_api_request=_responses_params(body),
        chat_completion_response=answer))
    out["model"] = body.get("model", out.get("model"))
    return out


def responses_sse(response: dict[str, Any], body: dict[str, Any] | None = None) -> Iterator[bytes]:
    """The Responses streaming events of a complete ``response``."""
    seq = 0

    def event(name: str, data: dict) -> bytes:
        nonlocal seq
        seq += 1
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(
            {"type": name, "sequence_number": seq, **data}) + b"\n\n"

    yield event("response.created", {"response": {**response, "status": "in_progress", "output": []}})
    for i, item in enumerate(response.get("output") or []):
        yield event("response.output_item.added", {"output_index": i, "item": {**item, "content": []}
                                                   if item.get("type") == "message" else item})
        if item.get("type") == "message":
            for j, part in enumerate(item.get("content") or []):
                yield event("response.content_part.added", {"item_id": item.get("id"), "output_index": i,
                                                            "content_index": j, "part": {**part, "text": ""}})
                yield event("response.output_text.delta", {"item_id": item.get("id"), "output_index": i,
                                                           "content_index": j, "delta": part.get("text", ""),
                                                           "logprobs": []})
                yield event("response.output_text.done", {"item_id": item.get("id"), "output_index": i,
                                                          "content_index": j, "text": part.get("text", ""),
                                                          "logprobs": []})
                yield event("response.content_part.done", {"item_id": item.get("id"), "output_index": i,
                                                           "content_index": j, "part": part})
        yield event("response.output_item.done", {"output_index": i, "item": item})
    yield event("response.completed", {"response": response})


# --------------------------------------------------------------------------------------- chat
def chat_sse(answer: dict[str, Any], body: dict[str, Any]) -> Iterator[bytes]:
    """Chat Completions chunks of a complete ``answer`` (one content/tool-call chunk per choice)."""
    base = {"id": answer.get("id"), "object": "chat.completion.chunk",
            "created": answer.get("created", int(time.time())), "model": answer.get("model")}
    for choice in answer.get("choices") or []:
        msg = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
        yield b"data: " + orjson.dumps({**base, "choices": [{"index": choice.get("index", 0), "delta": delta,
                                                             "logprobs": choice.get("logprobs"),
                                                             "finish_reason": None}]}) + b"\n\n"
        yield b"data: " + orjson.dumps({**base, "choices": [{"index": choice.get("index", 0), "delta": {},
                                                             "finish_reason": choice.get("finish_reason")}]}) + b"\n\n"
    if (body.get("stream_options") or {}).get("include_usage"):
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": answer.get("usage")}) + b"\n\n"
    yield b"data: [DONE]\n\n"
