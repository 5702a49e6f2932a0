"""What the recorder takes from an engine answer, and what the agent gets back.

Pure functions over parsed JSON: token ids and logprobs are validated strictly (a record that could
not be read back is never written), and the fields only the recorder asked for are removed from the
agent's answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

#: Deepest JSON nesting accepted in a request body or an upstream answer. A record embeds both one level
#: down and must stay readable by ``CallRecord.model_validate_json`` (whose parser stops at ~200 levels).
MAX_JSON_DEPTH = 64


def too_deep(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if the parsed JSON value ``obj`` nests containers more than ``limit`` levels deep."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        for v in (o.values() if isinstance(o, dict) else o):
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return False


class MalformedUpstream(ValueError):
    """The engine answered 2xx with fields of the wrong type (or unserializable / too deeply nested)."""


_INTS = TypeAdapter(list[int])
_FLOATS = TypeAdapter(list[float])


def int_list(value: Any, what: str) -> list[int]:
    """``value`` as a list of ints (``None`` or missing: ``[]``); strict, so a bad record is never written."""
    if value is None:
        return []
    try:
        return _INTS.validate_python(value, strict=True)
    except ValidationError:
        raise MalformedUpstream(f"{what} is not a list of integers") from None


def float_list(value: Any, what: str) -> list[float]:
    """``value`` as a list of floats (strict); raises :class:`MalformedUpstream`."""
    try:
        return _FLOATS.validate_python(value, strict=True)
    except ValidationError:
        raise MalformedUpstream(f"{what} are not numbers") from None


def extract_tokens(route: str, data: dict[str, Any]) -> tuple[list[int], list[int], list[float] | None, str | None]:
    """Token ids and logprobs from a vLLM answer with ``return_token_ids``/``logprobs`` on.

    Returns ``(prompt_token_ids, response_token_ids, response_logprobs, finish_reason)`` of choice 0.
    ``response_logprobs`` is ``None`` if the engine returned none or a list of another length. Missing
    fields give empty lists; fields of the wrong type raise :class:`MalformedUpstream`.
    """
    choices = data.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MalformedUpstream("'choices' is not a list of objects")
    choice = choices[0] if choices else {}
    prompt_ids = int_list(data.get("prompt_token_ids") or choice.get("prompt_token_ids"), "prompt_token_ids")
    response_ids = int_list(choice.get("token_ids"), "token_ids")
    logprobs = None
    lp = choice.get("logprobs")
    if lp is not None and not isinstance(lp, dict):
        raise MalformedUpstream("'logprobs' is not an object")
    raw = None
    if isinstance(lp, dict):
        if route == "chat" and isinstance(lp.get("content"), list):
            try:  # of parsed JSON values, only objects (dicts) have .get
                raw = [t.get("logprob", 0.0) for t in lp["content"]]
            except AttributeError:
                raise MalformedUpstream("'logprobs.content' is not a list of objects") from None
        elif route == "completions" and isinstance(lp.get("token_logprobs"), list):
            raw = [x if x is not None else 0.0 for x in lp["token_logprobs"]]
    if raw is not None:
        logprobs = float_list(raw, "logprobs")
    if logprobs is not None and len(logprobs) != len(response_ids):
        logprobs = None
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise MalformedUpstream("'finish_reason' is not a string")
    return prompt_ids, response_ids, logprobs, finish


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


