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
import json
import os
import threading
import time
from collections.abc import Iterator
from functools import cache
from typing import Any

import orjson

from .errors import ApiError, bad_request

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
    return json.loads(obj.model_dump_json(by_alias=True, exclude_none=False))  # (json: an integer > 64 bits exact)


def dumps(obj: Any) -> bytes:
    """``obj`` as JSON bytes: ``orjson``, or the standard library's encoder for what orjson cannot write (an integer
    beyond 64 bits a tool call's arguments held: translated exactly, not a 502). Raises ``ValueError`` for NaN or
    infinity (never JSON)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


class _Inexact(ValueError):
    """Tool-call arguments an Anthropic ``input`` cannot carry as the model wrote them."""


def _refused_constant(name: str) -> Any:
    raise _Inexact(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Inexact(f"the number {text[:40]} is beyond a double")
    return value


def check_tool_arguments(answer: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless each tool call's ``arguments`` in the Chat Completions ``answer`` is JSON an
    Anthropic ``input`` carries exactly: LiteLLM reads them leniently (``NaN``, ``Infinity``) and a number beyond a
    double (``1e400``) becomes infinity, and the answer wrote each as ``null``: the agent ran its tool with values the
    model never wrote, recorded ``ok`` (round 23). A lone surrogate (``"\\ud800"``) is no text either. Arguments
    that are no JSON at all are left to LiteLLM's own error, as before."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else None
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    for call in calls if isinstance(calls, list) else []:
        args = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
        if not isinstance(args, str) or not args.strip():
            continue
        try:
            json.dumps(json.loads(args, parse_constant=_refused_constant, parse_float=_finite),
                       ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("a tool call's arguments hold a lone surrogate (no text)") from None
        except _Inexact as exc:
            raise ValueError(f"a tool call's arguments: {exc}") from None
        except (ValueError, RecursionError):
            continue


# What each translated route carries to the engine faithfully. LiteLLM's adapters drop, without a word, a
# turn, block or tool they cannot read (a ``"robot"`` turn, an Anthropic ``content: 5``, a ``document`` block, a
# ``web_search`` server tool, a ``tool_result`` whose content is a number): the engine would answer a
# conversation other than the one the agent sent, and the record would train on it. Anything outside these
# tables is a 400 naming what is not supported. Earlier reasoning (Anthropic ``thinking``, Responses
# ``reasoning`` items) is accepted and not sent to the engine, as chat templates drop earlier reasoning.
_ANTHROPIC_BLOCKS = {"user": ("text", "image", "tool_result"),
                     "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
_TOOL_RESULT_BLOCKS = ("text", "image")
_RESPONSES_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
_RESPONSES_PARTS = ("input_text", "output_text", "input_image", "refusal")
#: field → required type, per block or item type (a missing field is refused as a wrong type)
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "text": {"text": str}, "image": {"source": dict}, "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str}, "input_text": {"text": str}, "output_text": {"text": str},
    "refusal": {"refusal": str}, "function_call": {"call_id": str, "name": str, "arguments": str},
    "function_call_output": {"call_id": str, "output": (str, list)},
}


def _refuse(what: str, where: str, problem: str) -> ApiError:
    return bad_request(f"invalid {what} request: {where} {problem}")


def _check_fields(obj: dict, kind: str, what: str, where: str) -> None:
    for field, kinds in _FIELDS.get(kind, {}).items():
        if not isinstance(obj.get(field), kinds):
            raise _refuse(what, where, f"({kind}) needs {field!r} of type "
                          f"{'/'.join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))}, "
                          f"got {obj.get(field)!r:.40}")


def _check_blocks(blocks: Any, allowed: tuple[str, ...], what: str, where: str) -> None:
    """``blocks`` is a string or a list of objects whose ``type`` is in ``allowed``, each with its fields."""
    if isinstance(blocks, str):
        return
    if not isinstance(blocks, list):
        raise _refuse(what, where, f"must be a string or a list of blocks, got {blocks!r:.40}")
    for j, block in enumerate(blocks):
        at = f"{where} block {j}"
        if not isinstance(block, dict):
            raise _refuse(what, at, f"must be an object, got {block!r:.40}")
        kind = block.get("type")
        if kind not in allowed:
            raise _refuse(what, at, f"has type {kind!r:.40}, which this gateway does not translate; "
                          f"supported here: {', '.join(allowed)}")
        _check_fields(block, kind, what, at)
        if kind == "tool_result" and "content" in block:
            _check_blocks(block["content"], _TOOL_RESULT_BLOCKS, what, f"{at} content")
        if kind == "image":
            _check_image_source(block["source"], what, at)
        if kind == "input_image" and not (isinstance(block.get("image_url"), str) and block["image_url"]):
            raise _refuse(what, at, "(input_image) needs a non-empty 'image_url' (a file_id is not translated)")


def _check_image_source(source: dict, what: str, where: str) -> None:
    """An Anthropic image source LiteLLM turns into an image URL: ``base64`` with ``media_type`` and ``data``, or
    ``url`` with ``url`` (a Files API ``file`` source, or one missing its data, was dropped without a word)."""
    need = {"base64": ("media_type", "data"), "url": ("url",)}.get(source.get("type"))
    if need is None or not all(isinstance(source.get(k), str) and source.get(k) for k in need):
        raise _refuse(what, f"{where} source", f"must be base64 (media_type, data) or url (url), got "
                      f"{source.get('type')!r:.20}: other image sources are not translated")


def check_anthropic(body: dict[str, Any]) -> None:
    """Raise ``ApiError`` 400 unless every turn, block, system prompt and tool of an Anthropic Messages request
    is one this gateway translates faithfully (see the tables above), with no ``mcp_servers`` or ``container``
    (Anthropic's servers run those) and no ``n`` above 1."""
    what = "Anthropic Messages"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _refuse(what, "'messages'", f"must be a list of at least one turn, got {messages!r:.40}")
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise _refuse(what, f"message {i}", f"must be an object, got {turn!r:.40}")
        role = turn.get("role")
        if role not in _ANTHROPIC_BLOCKS:
            raise _refuse(what, f"message {i}", f"has role {role!r:.40}; expected one of user, assistant")
        _check_blocks(turn.get("content"), _ANTHROPIC_BLOCKS[role], what, f"message {i} content")
        if turn.get("content") in ("", []):  # (LiteLLM drops the turn: two of one role follow, or a prefill is
            raise _refuse(what, f"message {i} content", "is empty")  # continued where the agent asked for an answer)
    if "system" in body and body["system"] is not None:
        _check_blocks(body["system"], ("text",), what, "'system'")
    _check_tools(body.get("tools"), what, lambda tool: tool.get("type", "custom") == "custom"
                 and isinstance(tool.get("name"), str))
    for field in ("mcp_servers", "container"):  # run by Anthropic's servers: no engine runs them
        if body.get(field) is not None:
            raise _refuse(what, f"{field!r}", "is not supported: no engine behind this gateway runs MCP servers or "
                          "containers (give the agent function tools it runs itself)")
    config = body.get("output_config")
    if config is not None and not (isinstance(config, dict) and config.keys() <= {"format"}):
        raise _refuse(what, "'output_config'", "is translated for its 'format' (structured outputs) only; other "
                      f"settings (effort) would be dropped without a word, got {config!r:.60}")
    if body.get("n") not in (None, 1):  # not an Anthropic field: LiteLLM forwarded it and the agent saw 1 of n
        raise _refuse(what, "'n'", f"is not an Anthropic Messages field (one answer per call), got {body['n']!r:.20}")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "any", "none", "tool")
                                   and (choice["type"] != "tool" or _name(choice.get("name")))):
        raise _refuse(what, "'tool_choice'", "must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": "
                      f"\"tool\", \"name\": ...}}, got {choice!r:.60}")
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):  # LiteLLM drops the flag
        raise _refuse(what, "'tool_choice'", "disable_parallel_tool_use is not translated (the engine would make "
                      "parallel tool calls anyway)")


def _name(value: Any) -> bool:
    """A tool name the engine can be asked for: a non-empty string."""
    return isinstance(value, str) and bool(value)


#: Responses options the translation to Chat Completions drops: only their default passes (LiteLLM 1.x leaves
#: out ``top_logprobs``, ``max_tool_calls`` and ``truncation``; the engine would answer as if they were unset)
_RESPONSES_DEFAULT_ONLY = {"top_logprobs": (None, 0), "max_tool_calls": (None, None),
                           "truncation": (None, "disabled")}


def check_responses(body: dict[str, Any]) -> None:
    """Raise ``ApiError`` 400 unless a Responses request is one this gateway translates faithfully: an
    ``input`` string or list of message / function_call / function_call_output / reasoning items, string
    ``instructions``, function tools only, no ``previous_response_id``, ``conversation`` or ``prompt`` (the
    gateway keeps no conversation state nor stored prompts: send the whole conversation in ``input``), and
    ``top_logprobs``, ``max_tool_calls``, ``truncation`` only at their defaults (:data:`_RESPONSES_DEFAULT_ONLY`), no
    ``background`` run (the answer comes with the call: there is no stored response to poll)."""
    what = "Responses"
    for field, defaults in _RESPONSES_DEFAULT_ONLY.items():
        if body.get(field) not in defaults:
            raise _refuse(what, f"{field!r}", f"is not carried by the translation (only {defaults[1]!r} or absent), "
                          f"got {body.get(field)!r:.40}")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise _refuse(what, "'include'", f"must be a list of strings, got {include!r:.40}")
    if "message.output_text.logprobs" in (include or ()):  # (the answer's parts carried none: an empty list)
        raise _refuse(what, "'include'", "'message.output_text.logprobs' is not carried by the translation")
    for field in ("previous_response_id", "conversation", "prompt"):
        if body.get(field) is not None:
            raise _refuse(what, f"{field!r}", "is not supported (the gateway keeps no conversation state and no "
                          "stored prompts): send the whole conversation in 'input'")
    if body.get("background") not in (None, False):  # (it was answered at once as completed, nothing to poll)
        raise _refuse(what, "'background'", "is not supported (the gateway answers each call when it is made and "
                      f"stores no response to poll): leave it out or false, got {body['background']!r:.40}")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise _refuse(what, "'instructions'", f"must be a string, got {body['instructions']!r:.40}")
    items = body.get("input")
    if "input" not in body:
        raise bad_request("invalid Responses request: 'input' is required")
    if not isinstance(items, str | list):
        raise _refuse(what, "'input'", f"must be a string or a list of items, got {items!r:.40}")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            raise _refuse(what, f"item {i}", f"must be an object, got {item!r:.40}")
        kind = item.get("type", "message")
        if kind not in _RESPONSES_ITEMS:
            raise _refuse(what, f"item {i}", f"has type {kind!r:.40}, which this gateway does not translate; "
                          f"supported here: {', '.join(_RESPONSES_ITEMS)}")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise _refuse(what, f"item {i}", f"has role {item.get('role')!r:.40}; expected one of user, "
                              "assistant, system, developer")
            _check_blocks(item.get("content"), _RESPONSES_PARTS, what, f"item {i} content")
        _check_fields(item, kind, what, f"item {i}")
        if kind == "function_call_output" and isinstance(item["output"], list):  # (LiteLLM sent [5] as "[5]")
            _check_blocks(item["output"], ("input_text", "input_image"), what, f"item {i} output")
    _check_tools(body.get("tools"), what, lambda tool: tool.get("type") == "function"
                 and isinstance(tool.get("name"), str))
    choice = body.get("tool_choice")  # (LiteLLM dropped a value it could not read, such as 5)
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function" and _name(choice.get("name"))):
        raise _refuse(what, "'tool_choice'", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      f"\"name\": ...}}, got {choice!r:.60}")
    text = body.get("text")  # (LiteLLM dropped a text that is no object, and always drops the verbosity)
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if (not isinstance(text, dict) or set(text) - {"format", "verbosity"}
                or text.get("verbosity") not in (None, "medium")
                or (fmt is not None and not (isinstance(fmt, dict)
                                             and fmt.get("type") in ("text", "json_object", "json_schema")))):
            raise _refuse(what, "'text'", "must be an object with 'format' (type text, json_object or json_schema) and "
                          f"'verbosity' only at its default (\"medium\"), got {text!r:.60}")


def _check_tools(tools: Any, what: str, is_function: Any) -> None:
    """Only tools the agent runs itself (functions): a provider's server tools (web search, code execution,
    computer use) have no engine to run them, and LiteLLM would turn some into other options."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _refuse(what, "'tools'", f"must be a list, got {tools!r:.40}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not is_function(tool):
            raise _refuse(what, f"tool {i}", f"is not a function tool with a name ({tool!r:.60}); server tools "
                          "are not supported: the engine cannot run them")


# --------------------------------------------------------------------------------------- Anthropic
def anthropic_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic Messages request → Chat Completions request. Raises ``ApiError`` 400 for anything
    :func:`check_anthropic` refuses, or if LiteLLM refuses it."""
    _, adapter, _ = _litellm()
    check_anthropic(body)
    try:
        req = adapter.translate_completion_input_params(
            {k: v for k, v in body.items() if k not in ("stream",)})
    except Exception as exc:  # LiteLLM raises ValueError/KeyError/pydantic errors on bad shapes
        raise bad_request(f"invalid Anthropic Messages request: {exc}") from None
    if req is None:
        raise bad_request("invalid Anthropic Messages request")
    req = _keep_empty_system(dict(req), body.get("system"))
    messages = req.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "assistant":
        # a prefill (Anthropic's way to start the answer): the engine continues that turn, it does not open a new
        # one (vLLM's chat template options; the answer, like Anthropic's, holds only the continuation)
        req["continue_final_message"], req["add_generation_prompt"] = True, False
    return req


def chat_to_anthropic(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Chat Completions answer → Anthropic message (``model`` as the agent asked)."""
    litellm, adapter, _ = _litellm()
    choices = answer.get("choices") or [{}]
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    if isinstance(message, dict) and isinstance(message.get("function_call"), dict) and not message.get("tool_calls"):
        # a legacy function_call is one tool call (LiteLLM drops it: the agent got an empty message, recorded ok)
        call = {"id": f"call_{answer.get('id') or 'legacy'}", "type": "function", "function": message["function_call"]}
        message = {k: v for k, v in message.items() if k != "function_call"} | {"tool_calls": [call]}
        finish = "tool_calls" if choices[0].get("finish_reason") == "function_call" else choices[0].get("finish_reason")
        answer = {**answer, "choices": [{**choices[0], "message": message, "finish_reason": finish}, *choices[1:]]}
    if isinstance(message, dict) and message.get("audio"):  # (dropped by LiteLLM too: no block carries it)
        raise ValueError("an answer holding 'audio' (the Anthropic route carries text, tool_use and thinking "
                         "blocks only)")
    check_tool_arguments(answer)
    out = _dump(adapter.translate_completion_output_params(litellm.ModelResponse(**answer)))
    ids = [b.get("id") for b in out.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_use"]
    if len(set(ids)) < len(ids):  # (LiteLLM rewrites ids to [A-Za-z0-9_-]: call<1 and call>1 became one)
        raise ValueError(f"two tool calls' ids read as one on the Anthropic route ({sorted(ids)[:4]!r:.200}): the agent "
                         "could not tell their results apart")
    out["model"] = body.get("model", out.get("model"))
    # an answer cut by one of the agent's stop sequences says so (vLLM names the matched string in the choice's
    # ``stop_reason``; LiteLLM's adapter reads only ``finish_reason`` and said ``end_turn``)
    choices = answer.get("choices") or [{}]
    matched = choices[0].get("stop_reason") if isinstance(choices[0], dict) else None
    stops = body.get("stop_sequences")
    if out.get("stop_reason") == "end_turn" and isinstance(matched, str) and isinstance(stops, list) \
            and matched in stops:
        out["stop_reason"], out["stop_sequence"] = "stop_sequence", matched
    return out


def anthropic_sse(message: dict[str, Any], body: dict[str, Any] | None = None) -> Iterator[bytes]:
    """The Anthropic streaming events of a complete ``message`` (text, tool_use, thinking and redacted_thinking
    blocks, each as Anthropic streams it)."""

    def event(name: str, data: dict) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    usage = message.get("usage") or {}
    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": usage.get("input_tokens", 0), "output_tokens": 0}}
    yield event("message_start", {"type": "message_start", "message": start})
    for i, block in enumerate(message.get("content") or []):
        if block.get("type") == "tool_use":
            yield event("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {**block, "input": {}}})
            yield event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": dumps(block.get("input") or {}).decode()}})
        elif block.get("type") == "thinking":  # as the complete answer holds it, not as an empty text block
            yield event("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            yield event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "thinking_delta", "thinking": block.get("thinking") or ""}})
            if block.get("signature"):
                yield event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "signature_delta", "signature": block["signature"]}})
        elif block.get("type") == "redacted_thinking":
            yield event("content_block_start", {"type": "content_block_start", "index": i, "content_block": block})
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
    """OpenAI Responses request → Chat Completions request. Raises ``ApiError`` 400 for anything
    :func:`check_responses` refuses, or if LiteLLM refuses it."""
    _, _, config = _litellm()
    check_responses(body)
    try:
        req = config.transform_responses_api_request_to_chat_completion_request(
            model=str(body.get("model") or "m"), input=body["input"], responses_api_request=_responses_params(body))
    except Exception as exc:
        raise bad_request(f"invalid Responses request: {exc}") from None
    return _keep_empty_system({k: v for k, v in dict(req).items() if v is not None and not k.startswith("litellm")},
                              body.get("instructions"))


def _keep_empty_system(req: dict[str, Any], system: Any) -> dict[str, Any]:
    """``req`` with an empty system message first where the agent gave an empty system prompt (Anthropic
    ``system: ""``, Responses ``instructions: ""``) and LiteLLM dropped it: without one, the chat template adds its
    own default system prompt, which the agent did not ask for (``[{"type": "text", "text": ""}]`` already comes
    through as an empty system message)."""
    messages = req.get("messages")
    if system == "" and isinstance(messages, list) and not (
            messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
        req["messages"] = [{"role": "system", "content": ""}, *messages]
    return req


def chat_to_responses(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Chat Completions answer → Responses API response object (its output items in OpenAI's shape:
    :func:`_openai_item`; a synthesized stream is encoded from this object, so its events carry the same items).
    ``store`` is ``false`` whatever the agent asked: the gateway stores no response (``previous_response_id`` is
    refused). Raises what LiteLLM raises for an answer it cannot translate (the caller's 502)."""
    _, _, config = _litellm()
    out = _dump(config.transform_chat_completion_response_to_responses_api_response(
        request_input=body.get("input"), responses_api_request=_responses_params(body),
        chat_completion_response=answer))
    out["model"] = body.get("model", out.get("model"))
    out["store"] = False  # (LiteLLM echoed the agent's ``store: true``: this gateway stores no response)
    if isinstance(out.get("output"), list):
        out["output"] = [_openai_item(item) for item in out["output"]]
    if isinstance(out.get("usage"), dict):
        out["usage"] = _openai_usage(out["usage"], answer.get("usage"))
    return out


def _openai_usage(usage: dict[str, Any], engine: Any) -> dict[str, Any]:
    """A Responses ``usage`` with the two detail objects OpenAI's ``ResponseUsage`` requires (LiteLLM left them
    ``null``: a client that parses strictly, as Codex does, refused the whole answer): ``cached_tokens``,
    ``cache_write_tokens`` and ``reasoning_tokens`` are the engine's own counts (``prompt_tokens_details`` / ``completion_tokens_details``) where
    it gives them, else 0 (vLLM reports none unless asked)."""
    engine = engine if isinstance(engine, dict) else {}

    def count(details: Any, name: str) -> int:
        value = details.get(name) if isinstance(details, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    out = dict(usage)
    if not isinstance(out.get("input_tokens_details"), dict):
        prompt = engine.get("prompt_tokens_details")
        out["input_tokens_details"] = {"cached_tokens": count(prompt, "cached_tokens"),
                                       "cache_write_tokens": count(prompt, "cache_write_tokens")}
    if not isinstance(out.get("output_tokens_details"), dict):
        out["output_tokens_details"] = {
            "reasoning_tokens": count(engine.get("completion_tokens_details"), "reasoning_tokens")}
    return out


def _openai_item(item: Any) -> Any:
    """A Responses output item as OpenAI's ``ResponseReasoningItem`` has it, for a reasoning item: LiteLLM
    wrote one like a message (a ``role``, parts of type ``output_text``, no ``summary``), which OpenAI's SDK
    types refuse. The engine's reasoning text becomes ``reasoning_text`` parts; ``summary`` is empty (the engine
    writes no summary); ``id``, ``encrypted_content`` and ``status`` are kept. Other items are returned as
    they are."""
    if not isinstance(item, dict) or item.get("type") != "reasoning":
        return item
    parts = item.get("content") if isinstance(item.get("content"), list) else []
    out: dict[str, Any] = {"id": item.get("id"), "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text", "text": part["text"]} for part in parts
                                       if isinstance(part, dict) and isinstance(part.get("text"), str)]}
    for field in ("encrypted_content", "status"):
        if item.get(field) is not None:
            out[field] = item[field]
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
    # a cut answer (max_output_tokens) ends as OpenAI ends it: agents branch on the event's type
    yield event("response.incomplete" if response.get("status") == "incomplete" else "response.completed",
                {"response": response})


# --------------------------------------------------------------------------------------- chat
def chat_sse(answer: dict[str, Any], body: dict[str, Any]) -> Iterator[bytes]:
    """Chat Completions chunks of a complete ``answer`` (one chunk per choice holding its whole message as the
    delta: content, tool calls, and every other field, such as ``reasoning_content``, as a live stream carries it;
    then its finish reason)."""
    base = {"id": answer.get("id"), "object": "chat.completion.chunk",
            "created": answer.get("created", int(time.time())), "model": answer.get("model")}
    for choice in answer.get("choices") or []:
        msg = choice.get("message") or {}
        delta: dict[str, Any] = {**{k: v for k, v in msg.items() if v is not None and k != "tool_calls"},
                                 "role": "assistant", "content": msg.get("content")}
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
