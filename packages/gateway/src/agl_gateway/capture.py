"""What the recorder takes from an engine answer, and what the agent gets back.

Pure functions over parsed JSON: token ids and logprobs are validated strictly (a record that could
not be read back is never written), and the fields only the recorder asked for are removed from the
agent's answer. A complete answer (:func:`capture_answer`) and a stream (:class:`StreamCapture`) give the
same :class:`Captured`, checked the same way (:func:`check`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from agl_common.schemas import MAX_JSON_DEPTH, logprob_fault, token_id_fault, too_deep
from openai.lib.streaming._deltas import accumulate_delta  # (pinned through litellm: openai 3.57)
from pydantic import TypeAdapter, ValidationError


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


def token_logprobs(entries: list[Any], what: str) -> list[float] | None:
    """One logprob per entry of a chat ``logprobs.content`` list, or ``None`` if any entry lacks a number
    there (a missing logprob is never invented: it would feed the PPO ratio). Raises
    :class:`MalformedUpstream` for entries that are not objects or logprobs that are not numbers."""
    try:  # of parsed JSON values, only objects (dicts) have .get
        raw = [t.get("logprob") for t in entries]
    except AttributeError:
        raise MalformedUpstream(f"'{what}' is not a list of objects") from None
    return None if any(x is None for x in raw) else float_list(raw, "logprobs")


def ordered_choices(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's ``choices`` in ``index`` order (a choice without ``index`` takes its position). Raises
    :class:`MalformedUpstream` unless they are objects whose indexes are 0..n-1, each once: the record is the
    choice with index 0, wherever the engine put it."""
    choices = data.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MalformedUpstream("'choices' is not a list of objects")
    indexes = [c.get("index", k) for k, c in enumerate(choices)]
    if any(type(i) is not int for i in indexes) or sorted(indexes) != list(range(len(choices))):
        raise MalformedUpstream(f"the choices' indexes are not 0 to {len(choices) - 1}, each once: {indexes!r:.60}")
    return [c for _, c in sorted(zip(indexes, choices), key=lambda pair: pair[0])]


def extract_tokens(route: str, data: dict[str, Any]) -> tuple[list[int], list[int], list[float] | None, str | None,
                                                                 int]:
    """Token ids and logprobs from a vLLM answer with ``return_token_ids``/``logprobs`` on.

    Returns ``(prompt_token_ids, response_token_ids, response_logprobs, finish_reason, sampled)`` of choice 0,
    ``sampled`` being the token ids of every choice together (what ``usage.completion_tokens`` counts when
    ``n > 1``). ``response_logprobs`` is ``None`` if the engine returned none, a list of another length, or
    a token without its logprob. Missing fields give empty lists; fields of the wrong type raise
    :class:`MalformedUpstream`.
    """
    choices = ordered_choices(data)
    choice = choices[0] if choices else {}
    top, own = (int_list(data.get("prompt_token_ids"), "prompt_token_ids"),
                int_list(choice.get("prompt_token_ids"), "prompt_token_ids"))
    if top and own and top != own:  # (vLLM's completions put them in the choice, its chat at the top)
        raise MalformedUpstream("two different 'prompt_token_ids' in one answer (top level and choice 0)")
    prompt_ids = top or own
    response_ids = int_list(choice.get("token_ids"), "token_ids")
    sampled = len(response_ids) + sum(len(int_list(c.get("token_ids"), "token_ids")) for c in choices[1:])
    logprobs = None
    lp = choice.get("logprobs")
    if lp is not None and not isinstance(lp, dict):
        raise MalformedUpstream("'logprobs' is not an object")
    if isinstance(lp, dict):
        if route == "chat" and isinstance(lp.get("content"), list):
            logprobs = token_logprobs(lp["content"], "logprobs.content")
        elif route == "completions" and isinstance(lp.get("token_logprobs"), list):
            raw = lp["token_logprobs"]
            logprobs = None if any(x is None for x in raw) else float_list(raw, "logprobs")
    if logprobs is not None and len(logprobs) != len(response_ids):
        logprobs = None
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise MalformedUpstream("'finish_reason' is not a string")
    return prompt_ids, response_ids, logprobs, finish, sampled


def agent_view(route: str, data: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The engine's answer minus what only the recorder asked for (token ids; logprobs unless requested)."""
    out = dict(data)
    out.pop("prompt_token_ids", None)
    for field in ("prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params"):
        out.pop(field, None)
    if "model" in request:
        out["model"] = request["model"]
    # chat asks with a boolean; completions with a count (0: the sampled tokens' own logprobs)
    wants_logprobs = (request.get("logprobs") is not None) if route == "completions" else bool(request.get("logprobs"))
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




@dataclass
class Captured:
    """What one engine answer gives the record: choice 0's ids, logprobs and finish reason, the usage.

    ``response_logprobs`` is ``None`` unless there is exactly one per response token id. ``sampled``: token
    ids of all choices together (``n > 1``; ``None``: as many as choice 0's). ``error``: what the engine
    reported in the answer itself (an ``error`` event in a stream).
    """

    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = None
    finish_reason: str | None = None
    sampled: int | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    said: bool = False  # choice 0 holds text (content, reasoning, refusal) or tool calls: not from no token ids
    shape: str | None = None  # why the agent can read no answer (no choices, or not n; a stream that fails check_choice)
    finish_reasons: list[str | None] = field(default_factory=list)  # every choice's, in index order (empty: one)

    def finishes(self) -> list[str | None]:
        """The finish reason of every choice, in index order (choice 0's is :attr:`finish_reason`)."""
        return self.finish_reasons or [self.finish_reason]


#: Message fields other than ``content`` that hold text when set (a live stream sends them in pieces).
TEXT_FIELDS = ("refusal", "reasoning_content", "reasoning")


_KINDS = {list: "a list", dict: "an object", str: "a string"}


def _given(obj: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """``obj[name]``, or an empty ``kind`` where it is absent or null. Raises :class:`MalformedUpstream` if it is
    of another type: a falsy one too (``0``, ``false``, ``[]`` where an object belongs), which ``obj.get(name) or
    default`` had replaced with the default before the type check, so a stream chunk of the wrong shape was
    recorded ``ok`` where the same field in a complete answer was refused (round 15)."""
    value = obj.get(name)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise MalformedUpstream(f"{what} is not {_KINDS[kind]}")
    return value


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_logprob_entry(entry: Any, top: bool) -> None:
    """:class:`MalformedUpstream` unless ``entry`` is a chat ``logprobs.content`` entry (``top``) or one of its
    ``top_logprobs`` as the OpenAI SDK types it: an object, a string ``token``, a number ``logprob``, ``bytes``
    null or a list of integers, and (``top``) ``top_logprobs`` null or a list of such entries. A missing or null
    ``token`` or ``logprob`` passes here: :func:`token_logprobs` makes that an error record (the agent still gets
    its answer)."""
    if not isinstance(entry, dict) or entry.get("token") is not None and not isinstance(entry["token"], str) \
            or entry.get("logprob") is not None and not _number(entry["logprob"]):
        raise MalformedUpstream("a 'logprobs.content' entry is not a string token with a number logprob")
    b = entry.get("bytes")
    if b is not None and (not isinstance(b, list) or b and {type(x) for x in b} != {int}):
        raise MalformedUpstream("a 'logprobs.content' entry's 'bytes' is not a list of integers")
    if top:
        tops = entry.get("top_logprobs")
        if tops is not None and not isinstance(tops, list):
            raise MalformedUpstream("a 'logprobs.content' entry's 'top_logprobs' is not a list")
        for t in tops or []:
            _check_logprob_entry(t, top=False)


#: Top-level fields of an answer (and of each stream chunk) and their types, as OpenAI's SDKs and LiteLLM (the
#: Anthropic and Responses routes) type them: chat answered 200 what the translated routes refused (502).
ENVELOPE = {"id": str, "created": int, "system_fingerprint": str}
#: Message fields beside the text ones, likewise.
MESSAGE_FIELDS = {"annotations": list, "audio": dict, "function_call": dict}


_KIND_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "an object"}


def _typed(obj: dict[str, Any], fields: dict[str, type | tuple[type, ...]], where: str) -> None:
    """:class:`MalformedUpstream` unless each of ``fields`` present in ``obj`` is null or of its type(s) (no bool)."""
    for name, kind in fields.items():
        v = obj.get(name)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise MalformedUpstream(f"'{where}{name}' is not {' or '.join(_KIND_NAMES[k] for k in kinds)}")


def _check_logprob_entries(content: Any) -> None:
    """:class:`MalformedUpstream` unless ``content`` (a chat ``logprobs.content``, of a complete answer or of one
    stream chunk) is null or a list of :func:`_check_logprob_entry` entries."""
    if content is not None and not isinstance(content, list):
        raise MalformedUpstream("'logprobs.content' is not a list")
    for entry in content or []:
        _check_logprob_entry(entry, top=True)


def check_envelope(data: dict[str, Any]) -> None:
    """:class:`MalformedUpstream` unless ``data`` (a complete answer or a stream chunk) has :data:`ENVELOPE`'s
    types and its ``usage`` is an object or null. One verdict on every route: before, only the translated routes
    refused these (at translation). Usage counts of another type stay what round 9 made them: the agent gets
    its answer on chat, the record is an error (:func:`check`)."""
    _typed(data, ENVELOPE, "")
    if data.get("usage") is not None and not isinstance(data["usage"], dict):
        raise MalformedUpstream("'usage' is not an object")


def check_choice(route: str, choice: dict[str, Any]) -> None:
    """:class:`MalformedUpstream` unless ``choice`` is one an agent's SDK can read: on ``chat`` a ``message``
    object of role ``assistant`` (or none) with a ``content`` (a string or null) or tool calls, its ``refusal``,
    ``reasoning_content`` and ``reasoning`` strings or null, its :data:`MESSAGE_FIELDS` of their types, its
    ``tool_calls`` (if any) objects with a non-empty ``id`` (no two alike), ``type`` ``function`` (or none) and a
    ``function`` of a non-empty printable ``name`` and string ``arguments``, and tool calls if its finish reason says so; on ``completions`` a string ``text``; on both,
    ``logprobs`` null or an object whose lists are lists (chat: of :func:`_check_logprob_entry` entries).
    Complete answers and streams (:meth:`StreamCapture.result`) are checked alike."""
    lp = choice.get("logprobs")  # what an agent that asked for logprobs reads: the shape its SDK parses
    lists = ("tokens", "token_logprobs", "top_logprobs", "text_offset") if route == "completions" else ("content",)
    if lp is not None and (not isinstance(lp, dict) or any(lp.get(k) is not None and not isinstance(lp[k], list)
                                                             for k in lists)):
        raise MalformedUpstream(f"choice {choice.get('index', 0)}'s 'logprobs' is not an object of lists")
    if route == "chat" and lp is not None:
        _check_logprob_entries(lp.get("content"))
    if route == "completions":
        if not isinstance(choice.get("text"), str):
            raise MalformedUpstream(f"choice {choice.get('index', 0)} holds no text")
        return
    message = choice.get("message")
    if not isinstance(message, dict):
        raise MalformedUpstream(f"choice {choice.get('index', 0)} holds no message object")
    for field in ("content", *TEXT_FIELDS):  # (the translated routes failed on these)
        if message.get(field) is not None and not isinstance(message[field], str):
            raise MalformedUpstream(f"'message.{field}' is not a string")
    if message.get("role", "assistant") != "assistant":
        raise MalformedUpstream(f"'message.role' is {message['role']!r:.30}, not 'assistant'")
    _typed(message, MESSAGE_FIELDS, "message.")
    calls = message.get("tool_calls")
    if "content" not in message and not calls:  # (translated: Anthropic `content: []`, Responses `output: []`)
        # (a null content is an answer: vLLM's reasoning parsers give one for an empty visible output)
        raise MalformedUpstream("the message holds neither content nor tool calls")
    if choice.get("finish_reason") == "tool_calls" and not calls:
        raise MalformedUpstream("finish reason 'tool_calls' without a tool call")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise MalformedUpstream("'message.tool_calls' is not a list")
    for tc in calls:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"] \
                or not isinstance(fn.get("arguments"), str):
            raise MalformedUpstream("a tool call in 'message.tool_calls' has no function name or string arguments")
        if not fn["name"].isprintable():
            raise MalformedUpstream(f"a tool call's function name holds control characters: {fn['name']!r:.60}")
        if not isinstance(tc.get("id"), str) or not tc["id"]:  # the agent answers the call by its id
            raise MalformedUpstream("a tool call in 'message.tool_calls' has no id")
        if tc.get("type", "function") != "function":
            raise MalformedUpstream(f"a tool call of type {tc.get('type')!r:.30} (only 'function' is one)")
    ids = [tc["id"] for tc in calls]
    if len(set(ids)) < len(ids):  # the agent answers each call by its id: two of one id cannot both be answered
        raise MalformedUpstream(f"two tool calls share an id: {next(i for i in ids if ids.count(i) > 1)!r:.40}")


def capture_answer(route: str, data: dict[str, Any], n: int = 1) -> Captured:
    """:class:`Captured` of a complete answer (``route``: ``"chat"`` or ``"completions"``, the engine's
    answer shape) to a request for ``n`` choices: another number of choices is no answer (an extra choice would
    reach the agent, merged into its message by the translated routes, though the record holds choice 0 only).
    Raises :class:`MalformedUpstream` for fields of the wrong type (:func:`check_envelope`, :func:`check_choice`)."""
    check_envelope(data)
    usage = data.get("usage")
    choices = ordered_choices(data)
    first = choices[0] if choices else {}
    message = first.get("message") if isinstance(first.get("message"), dict) else {}
    said = bool(first.get("text") or message.get("content") or message.get("tool_calls")
                or any(message.get(k) for k in TEXT_FIELDS))
    for choice in choices:
        check_choice(route, choice)
    shape = None
    if not first:
        shape = "no choices: the agent got no answer"
    elif len(choices) != n:
        shape = f"{len(choices)} choices for a request of n={n}"
    finishes = [c.get("finish_reason") for c in choices]
    if any(f is not None and not isinstance(f, str) for f in finishes):
        raise MalformedUpstream("'finish_reason' is not a string")
    return Captured(*extract_tokens(route, data), usage=usage, error=error_text(data.get("error")), said=said,
                    shape=shape, finish_reasons=finishes)


def error_text(err: Any) -> str | None:
    """What an engine's ``error`` field (beside its choices, or as a stream event) says, or ``None`` if absent."""
    if err is None:
        return None
    msg = err.get("message") if isinstance(err, dict) else err
    return str(msg if msg is not None else err)[:300] or "error event"


#: Finish reasons of a generation that ended as an answer: OpenAI's, and vLLM's ``repetition`` (its repetition
#: detector stopped a sampled reply). vLLM's ``abort`` (the request was aborted: a cut generation) and ``error``
#: (an internal failure) are not, nor is any other string.
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call", "repetition"})


def unreadable(cap: Captured) -> str | None:
    """Why the agent can read no answer from the capture, or ``None``: an error the engine reported within its
    answer (a stream that failed mid-generation, an ``error`` beside the choices); no choices, another number than
    the request's ``n``, or a choice without an answer (a stream whose answer fails :func:`check_choice`; a complete
    one raises there); for any choice, no finish reason (a generation that did not end) or one not in
    :data:`FINISH_REASONS` (vLLM's ``abort`` or ``error``, an unknown one). Such an answer is an upstream failure
    for the agent (502, CONTRACT §1), never a 200."""
    if cap.error:
        return f"engine error during generation: {cap.error}"[:500]
    if cap.shape:
        return cap.shape
    for k, finish in enumerate(cap.finishes()):  # every choice reaches the agent
        of = f" (choice {k})" if k else ""
        if not finish:  # None, or "" (a stream's "" was already None: one rule for both)
            return f"no finish reason{of}: the generation did not end"
        if finish not in FINISH_REASONS:
            return f"finish reason {finish!r:.40}{of}: the generation did not end as an answer"
    return None


def sent_prompt_ids(route: str, request: dict[str, Any]) -> list[int] | None:
    """The token ids of the prompt the agent sent, where it sent ids: a completions ``prompt`` that is a list of
    token ids, or one such list in a list (the one prompt the gateway forwards: a batch is refused before the
    engine). ``None`` otherwise: a text prompt or a chat call, whose ids only the engine's tokenizer knows."""
    prompt = request.get("prompt") if route == "completions" else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def prompt_fault(sent: list[int], got: list[int], truncated: bool = False) -> str | None:
    """Why the engine's prompt ids ``got`` are not the token ids the agent sent (``sent``: vLLM answers a token-id
    prompt for exactly those ids), or ``None``. With ``truncated`` (the agent asked the engine to cut the prompt:
    ``truncate_prompt_tokens``), the engine's ids must be the end of the agent's."""
    if got == sent or (truncated and got and len(got) <= len(sent) and sent[len(sent) - len(got):] == got):
        return None
    at = next((k for k, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
    return (f"prompt token ids are not the agent's: it sent {len(sent)} token ids, the engine answered for "
            f"{len(got)} ({'the end of the prompt' if truncated else 'the prompt'} differs from position {at}: "
            f"sent {sent[at:at + 4]}, engine {got[at:at + 4]})")


def check(cap: Captured, sent_prompt: list[int] | None = None, truncated: bool = False) -> str | None:
    """Why the capture must not become training data, or ``None``. In order: an answer the agent cannot read
    (:func:`unreadable`); no prompt token ids; prompt ids other than ``sent_prompt``, the token ids the agent sent
    as its prompt (:func:`sent_prompt_ids`, :func:`prompt_fault`; ``truncated``: the agent asked for the prompt to
    be cut); no ``usage`` counts; prompt ids other than ``usage.prompt_tokens``
    counts; no response token ids while the reply holds text or ``usage`` does not say it was empty; token ids
    that do not add up to
    the engine's own ``usage.completion_tokens`` (e.g. ids lost to tool-call parsing; with ``n > 1`` usage counts
    every choice); token ids without one logprob each (the gateway always asks for both, and a missing one is
    never invented); token ids outside ``[0, TOKEN_ID_LIMIT)``; logprobs above :data:`LOGPROB_CEILING` or at
    or below :data:`LOGPROB_FLOOR`."""
    why = unreadable(cap)
    if why:
        return why
    if not cap.prompt_token_ids:
        return "prompt token ids missing: the engine returned none (is it vLLM with return_token_ids?)"
    if sent_prompt is not None:
        why = prompt_fault(sent_prompt, cap.prompt_token_ids, truncated)
        if why:
            return why
    for name in ("prompt_tokens", "completion_tokens"):  # a count missing or of another type would switch its
        value = (cap.usage or {}).get(name)  # check off (vLLM sends usage with every answer, and streams it when
        if type(value) is not int or value < 0:  # asked: the gateway always asks)
            return (f"usage.{name} missing: the engine's own count is what the token ids are checked against"
                    if value is None else f"usage.{name} is not a count: {value!r:.40}")
    n = (cap.usage or {}).get("completion_tokens")
    p = (cap.usage or {}).get("prompt_tokens")
    if p is not None and p != len(cap.prompt_token_ids):
        return f"prompt token ids incomplete: {len(cap.prompt_token_ids)} of usage.prompt_tokens {p}"
    if not cap.response_token_ids and (cap.said or n != 0):
        return ("response token ids missing: the engine returned none, and the reply holds text or no usage says "
                "it is empty")
    sampled = len(cap.response_token_ids) if cap.sampled is None else cap.sampled
    if n is not None and n != sampled:
        return f"token ids incomplete: {sampled} of {n}"
    if cap.response_token_ids and cap.response_logprobs is None:
        return f"logprobs missing: not one per token id ({len(cap.response_token_ids)} ids)"
    return token_id_fault(cap.prompt_token_ids, cap.response_token_ids) or logprob_fault(cap.response_logprobs or [])


def _take_strings(fields: dict[str, Any], path: tuple[str, ...], pieces: dict[tuple[str, ...], list[str]]) -> None:
    """Move every string of ``fields`` (at any depth of objects, not inside lists) into ``pieces`` under its path:
    the OpenAI SDK's merge joins strings (``acc += piece``), which copied the whole string at each chunk — quadratic in
    a stream's length, for ``reasoning_content``, a legacy ``function_call``'s arguments or any unknown string field
    (round 23: 64 MB took minutes on the event loop). The rest is merged by the SDK; :func:`_put` puts them back."""
    for name in list(fields):
        value = fields[name]
        if isinstance(value, str) and name not in ("index", "type"):  # (the SDK replaces those two, never joins)
            pieces.setdefault((*path, name), []).append(fields.pop(name))
        elif isinstance(value, dict):
            _take_strings(value, (*path, name), pieces)


def _put(obj: dict[str, Any], path: tuple[str, ...], value: str) -> bool:
    """Set ``value`` at ``path`` in ``obj`` (objects made where missing, a ``null`` replaced as the SDK's merge
    replaces it). ``False``, nothing set, where the path holds a value of another type: a field the engine sent as a
    string and as something else, which the SDK's merge reads by arrival order (the record is then an error)."""
    for name in path[:-1]:
        if obj.get(name) is None:
            obj[name] = {}
        obj = obj[name]
        if not isinstance(obj, dict):
            return False
    if not isinstance(obj.get(path[-1], ""), (str, type(None))):
        return False
    obj[path[-1]] = value
    return True


class StreamCapture:
    """Accumulates a live chat stream (vLLM chunks with ``return_token_ids`` and ``logprobs`` on) into a
    :class:`Captured` and the complete ``chat.completion`` the agent was sent, and cleans each chunk for
    the agent (:meth:`feed`). Live streams have ``n == 1``: a choice with another index is a malformed stream."""

    def __init__(self, request: dict[str, Any], model: str):
        self.request, self.model = request, model
        self.wants_logprobs = bool(request.get("logprobs"))
        options = request.get("stream_options")
        self.wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.cap = Captured()
        self.lps: list[float] = []
        self.lps_missing = False  # a chunk's token came without its logprob: the capture has none
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.other: dict[str, Any] = {}  # the delta's other fields (``function_call``, ``audio``...), as the agent got them
        # (the string fields' pieces, joined once at the end: joining them per chunk, as the SDK's merge does, was
        # quadratic in a stream's length; round 23)
        self.pieces: dict[tuple[str, ...], list[str]] = {}  # (each string's path in the message: its pieces)
        self.first: dict[str, Any] | None = None

    def feed(self, chunk: Any) -> tuple[dict[str, Any] | None, int]:
        """Capture one parsed chunk; returns ``(chunk for the agent or None to send nothing, token ids it
        carried)``. Raises :class:`MalformedUpstream` for a chunk of the wrong shape."""
        if not isinstance(chunk, dict):
            raise MalformedUpstream("a stream chunk is not an object")
        cap = self.cap
        if chunk.get("error") is not None:  # vLLM's error event (with choices too): the generation failed
            cap.error = error_text(chunk["error"])
            if not chunk["error"]:  # "" or {}: an SDK raises only for a truthy error, and would read on
                chunk = {**chunk, "error": {"message": cap.error, "type": "server_error", "code": None}}
            return chunk, 0
        check_envelope(chunk)
        self.first = self.first or chunk
        prompt = int_list(chunk.pop("prompt_token_ids", None), "prompt_token_ids")
        if prompt and cap.prompt_token_ids and prompt != cap.prompt_token_ids:
            raise MalformedUpstream("two different 'prompt_token_ids' in one stream")
        cap.prompt_token_ids = prompt or cap.prompt_token_ids
        for name in ("prompt_text", "prompt_logprobs", "kv_transfer_params", "ec_transfer_params"):
            chunk.pop(name, None)
        choices = _given(chunk, "choices", list, "'choices'")
        if not all(isinstance(c, dict) for c in choices):
            raise MalformedUpstream("'choices' is not a list of objects")
        n_ids = 0
        for ch in choices:
            index = ch.get("index", 0)
            if type(index) is not int or index != 0:  # a live stream has n == 1: another choice is not ours
                raise MalformedUpstream(f"a stream chunk's choice has index {index!r:.20} (a live stream has one "
                                        "choice, index 0)")
            ids = int_list(ch.get("token_ids"), "token_ids")
            delta = _given(ch, "delta", dict, "'delta'")
            late = [k for k, v in delta.items() if k != "role" and v not in (None, "", [], {})]
            if cap.finish_reason and (ids or late or ch.get("finish_reason")):  # (any field: a late `function_call`
                raise MalformedUpstream(f"tokens, a message field or a second finish reason after the stream's "
                                        f"finish reason {cap.finish_reason!r:.20}")  # was relayed and recorded ok)
            n_ids += len(ids)
            cap.response_token_ids += ids
            lp = _given(ch, "logprobs", dict, "'logprobs'")
            content = lp.get("content") or []
            _check_logprob_entries(content)  # as a complete answer's (check_choice): what the agent's SDK reads
            got = token_logprobs(content, "logprobs.content")
            if got is None or len(got) != len(ids):  # each chunk's logprobs belong to its own ids:
                self.lps_missing = True  # counts that differ per chunk but add up are still misaligned
            else:
                self.lps += got
            piece = _given(delta, "content", str, "'delta.content'")
            self.text.append(piece)
            if delta.get("role", "assistant") not in ("assistant", None):
                raise MalformedUpstream(f"'delta.role' is {delta['role']!r:.30}, not 'assistant'")
            fields = {name: value for name, value in delta.items()
                      if name not in ("role", "content", "tool_calls") and value is not None}
            for name in fields.keys() & set(TEXT_FIELDS):
                if not isinstance(fields[name], str):  # (as check_choice: what the agent got)
                    raise MalformedUpstream(f"'delta.{name}' is not a string")
            fields = copy.deepcopy(fields)  # (the chunk itself goes to the agent as it came)
            _take_strings(fields, (), self.pieces)  # (the SDK's merge of strings, joined once in result())
            try:  # the OpenAI SDK's own merge of a delta: the record holds the message the agent's SDK built (a
                # function_call streamed in pieces kept its last piece; a late "" replaced a recorded object)
                accumulate_delta(self.other, fields)
            except (TypeError, RuntimeError) as exc:  # (a list of pieces without their index)
                raise MalformedUpstream(f"a stream delta the OpenAI SDK cannot merge: {exc}"[:300]) from None
            for tc in _given(delta, "tool_calls", list, "'delta.tool_calls'"):
                if not isinstance(tc, dict):
                    raise MalformedUpstream("'delta.tool_calls' is not a list of objects")
                if tc.get("type", "function") not in ("function", None):  # (check_choice reads the merged call)
                    raise MalformedUpstream(f"a tool call of type {tc.get('type')!r:.30} (only 'function' is one)")
                index, fn = tc.get("index", 0), _given(tc, "function", dict, "'delta.tool_calls[].function'")
                if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                    raise MalformedUpstream("'delta.tool_calls[].index' is not a non-negative integer")
                if not isinstance(fn, dict) or not all(fn.get(k) is None or isinstance(fn[k], str)
                                                       for k in ("name", "arguments")):
                    raise MalformedUpstream("'delta.tool_calls[].function' is not an object of strings")
                acc = self.tool_calls.setdefault(index, {  # (name and arguments as pieces, joined in result())
                    "id": None, "type": "function", "function": {"name": [], "arguments": []}})
                if tc.get("id") and acc["id"] and tc["id"] != acc["id"]:  # (the OpenAI SDK joins the two)
                    raise MalformedUpstream(f"tool call {index} changed its id from {acc['id']!r:.40} to "
                                            f"{tc['id']!r:.40}")
                acc["id"] = tc.get("id") or acc["id"]
                acc["function"]["name"].append(fn.get("name") or "")
                acc["function"]["arguments"].append(fn.get("arguments") or "")
            finish = ch.get("finish_reason")
            if finish is not None and not isinstance(finish, str):
                raise MalformedUpstream("'finish_reason' is not a string")
            cap.finish_reason = finish or cap.finish_reason
            ch.pop("token_ids", None)
            if not self.wants_logprobs:
                ch["logprobs"] = None
        if _given(chunk, "usage", dict, "'usage'"):
            cap.usage = chunk["usage"]
            if not self.wants_usage:  # the agent did not ask for it: the usage goes, the chunk's choices stay
                chunk.pop("usage")
                if not choices:
                    return None, n_ids
        if "model" in self.request:
            chunk["model"] = self.request["model"]
        return chunk, n_ids

    def result(self) -> tuple[Captured, dict[str, Any] | None]:
        """The :class:`Captured` and the complete ``chat.completion`` the stream amounts to (``None``, with
        ``error`` set, if it nests deeper than :data:`MAX_JSON_DEPTH`)."""
        cap = self.cap
        other = copy.deepcopy(self.other)
        for path, pieces in self.pieces.items():
            if not _put(other, path, "".join(pieces)):
                cap.shape = cap.shape or (f"the stream's field {'.'.join(path)!r:.80} came as a string and as "
                                          "another type")
        cap.said = bool("".join(self.text) or self.tool_calls or any(other.get(k) for k in TEXT_FIELDS))
        whole = not self.lps_missing and len(self.lps) == len(cap.response_token_ids)
        cap.response_logprobs = self.lps if whole else None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text), **other}
        if self.tool_calls:
            message["tool_calls"] = [{**self.tool_calls[k], "function": {
                part: "".join(pieces) for part, pieces in self.tool_calls[k]["function"].items()}}
                for k in sorted(self.tool_calls)]
        first = self.first or {}
        answer = {"id": first.get("id"), "object": "chat.completion", "created": first.get("created"),
                  "model": self.request.get("model", self.model),
                  "choices": [{"index": 0, "message": message, "finish_reason": cap.finish_reason}],
                  "usage": cap.usage}
        if too_deep(answer):  # the engine's own values (usage, ids) are in it: never a record no reader can read
            cap.error = cap.error or f"the stream's answer nests JSON deeper than {MAX_JSON_DEPTH} levels"
            return cap, None
        try:  # what a complete answer must be, a stream must amount to (a nameless tool call: no answer)
            check_choice("chat", answer["choices"][0])
        except MalformedUpstream as exc:
            cap.shape = cap.shape or str(exc)
        return cap, answer
