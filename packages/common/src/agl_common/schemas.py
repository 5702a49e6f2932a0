"""Every wire type of AGL, and the rollout state machine.

This is the project's only shared vocabulary: the gateway writes these records, the controller moves
rollouts through their states, the trainer reads both. Nothing else invents its own dict shapes.
Field names follow ``docs/contract.md`` section 3.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class RolloutStatus(str, Enum):
    """Lifecycle of a rollout (CONTRACT §3)."""

    queuing = "queuing"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


#: Allowed transitions, checked in one place (:func:`check_transition`). A retry moves a finished
#: rollout back to ``queuing`` with a new attempt id.
TRANSITIONS: dict[RolloutStatus, set[RolloutStatus]] = {
    RolloutStatus.queuing: {RolloutStatus.running, RolloutStatus.failed},
    RolloutStatus.running: {RolloutStatus.succeeded, RolloutStatus.failed, RolloutStatus.queuing},
    RolloutStatus.succeeded: set(),
    RolloutStatus.failed: {RolloutStatus.queuing},
}

TERMINAL = {RolloutStatus.succeeded, RolloutStatus.failed}


class InvalidTransition(ValueError):
    """A rollout was asked to move to a state its current state does not allow."""


def check_transition(old: RolloutStatus, new: RolloutStatus) -> None:
    """Raise :class:`InvalidTransition` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(f"rollout cannot move from {old.value} to {new.value}")


#: Longest rollout id, in characters.
ROLLOUT_ID_MAX = 256


#: What a rollout id may hold: RFC 3986's unreserved characters plus ``:`` and ``@`` (all literal in a URL path
#: segment, a file name and a Redis key), starting with a letter, digit or ``_``. So an id is the same string
#: in the path form of a route, in the ``X-AGL-Rollout-Id`` header, in a log file name and in Redis: no
#: ``/``, ``%``, ``?`` or ``#`` (misrouted or cut in URLs), no ``.``/``..`` path segments, no whitespace,
#: no hash-tag braces ``{}`` (Redis Cluster: every key of a rollout is tagged ``{rollout_id}``).
ROLLOUT_ID_CHARS = "A-Za-z0-9._~:@-"
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._~:@-]*")


def check_rollout_id(rollout_id: str, what: str = "rollout id") -> str:
    """Return ``rollout_id`` if it can name a rollout (or, ``what="group id"``, a group: the same rules, since a
    group id is part of its rollouts' ids, of URLs and of terminal output): 1 to :data:`ROLLOUT_ID_MAX`
    characters of :data:`ROLLOUT_ID_CHARS`, the first a letter, digit or ``_``. Raises ``ValueError`` saying
    which rule it breaks (and the first character that breaks it)."""
    if not isinstance(rollout_id, str) or not 0 < len(rollout_id) <= ROLLOUT_ID_MAX:
        n = len(rollout_id) if isinstance(rollout_id, str) else type(rollout_id).__name__
        raise ValueError(f"{what} must be 1 to {ROLLOUT_ID_MAX} characters, got {n}")
    if not _ROLLOUT_ID.fullmatch(rollout_id):
        bad = next((c for i, c in enumerate(rollout_id)
                    if not _ROLLOUT_ID.fullmatch(c if i == 0 else "a" + c)), "?")
        raise ValueError(f"{what} may hold only ASCII letters, digits and . _ ~ : @ - (starting with a letter, "
                         f"a digit or _): {rollout_id!r:.60} holds {bad!r}")
    return rollout_id


#: Most digits of an attempt id (a rollout is retried a handful of times, never 10**9).
ATTEMPT_ID_MAX_DIGITS = 9


def check_attempt_id(attempt_id: str) -> str:
    """Return ``attempt_id`` if it names an attempt: a canonical decimal (ASCII digits, no leading zero: ``0``,
    ``1``, ``12``; ``01``, ``²`` and ``٣`` are not) of at most :data:`ATTEMPT_ID_MAX_DIGITS` digits; else
    ``ValueError``."""
    if not (isinstance(attempt_id, str) and attempt_id.isascii() and attempt_id.isdigit()
            and (attempt_id == "0" or attempt_id[0] != "0") and len(attempt_id) <= ATTEMPT_ID_MAX_DIGITS):
        raise ValueError(f"attempt id must be a decimal of 1 to {ATTEMPT_ID_MAX_DIGITS} digits without leading zeros, "
                         f"got {attempt_id!r:.40}")
    return attempt_id


#: Deepest JSON nesting accepted in a request body, an upstream answer or a rollout's input. A record embeds both one level
#: down and must stay readable by ``CallRecord.model_validate_json`` (whose parser stops at ~200 levels).
MAX_JSON_DEPTH = 64


#: A run of digits that can spell an integer beyond 64 bits (``-2**63 - 1`` and ``2**64`` have 19 and 20 digits).
_LONG_DIGITS = re.compile(r"\d{19,}")


def long_integer(raw: str | bytes | bytearray) -> str | None:
    """The first integer outside ``[-2**63, 2**64)`` in the valid JSON text ``raw`` (cut to 24 characters), or
    ``None``: orjson reads such a number as the nearest double, so it would be stored changed (``2**64 + 1`` as
    ``1.8446744073709552e19``). Only a text with a long run of digits (maybe inside a string) is parsed again."""
    import json

    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else raw
    if not _LONG_DIGITS.search(text):
        return None
    found: list[str] = []

    def parse_int(digits: str) -> int:
        if not found and (len(digits.lstrip("-")) > 20 or not -(2**63) <= int(digits) < 2**64):
            found.append(digits[:24] + ("..." if len(digits) > 24 else ""))
        return 0

    json.loads(text, parse_int=parse_int)
    return found[0] if found else None


def no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of ``json.loads``: the object as a dict; ``ValueError`` if a key is given twice."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the key {twice!r:.60} is given twice in one object (one would silently replace the "
                         "other)")
    return dict(pairs)


def parse_input(text: str) -> dict[str, Any]:
    """A rollout input given as JSON text (``rollouts create --input``, ``agl-controller run --dry-run --input``):
    strict JSON, as the gateway reads bodies (``NaN``, ``Infinity`` and ``1e999`` are refused, never stored as
    null or rendered into a manifest; an integer beyond 64 bits is refused, never stored bent), an object, nested
    at most :data:`MAX_JSON_DEPTH` levels, no key given twice in one object. Raises ``ValueError`` saying why."""
    import orjson

    import json

    value = orjson.loads(text)  # (orjson.JSONDecodeError is a ValueError)
    if not isinstance(value, dict):
        raise ValueError("input must be a JSON object")
    if too_deep(value):
        raise ValueError(f"input nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if (big := long_integer(text)) is not None:
        raise ValueError(f"input holds the integer {big}, beyond 64 bits: it cannot be stored exactly (give it as "
                         "a string)")
    json.loads(text, object_pairs_hook=no_repeated_keys)
    return value


def too_deep(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if the parsed value ``obj`` (a dict or list) nests containers more than ``limit`` levels deep.

    Walked without recursion; a container reached again (a YAML alias: one list under many keys) is walked again
    only at a greater depth than before, so a document of nested aliases that expands to billions of items (a
    "billion laughs" config) costs at most ``limit`` visits per distinct container."""
    deepest: dict[int, int] = {}  # id of a container -> the greatest depth it was walked at
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        if deepest.get(id(o), 0) >= depth:
            continue
        deepest[id(o)] = depth
        for v in (o.values() if isinstance(o, dict) else o):
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return False


class Rollout(BaseModel):
    """One run of the harness on one input; ``group_id`` ties the n rollouts of a GRPO group. Its floats are
    finite (``ValueError`` otherwise: JSON has no NaN; one written as ``null`` made every listing fail)."""

    model_config = ConfigDict(allow_inf_nan=False)

    rollout_id: str
    input: dict[str, Any] = Field(default_factory=dict)
    status: RolloutStatus = RolloutStatus.queuing
    attempt_id: str = "0"
    reward: float | None = None
    reward_message: str | None = None
    failure: str | None = None
    group_id: str | None = None
    policy_version: int = 0
    created_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    env_map: dict[str, str] = Field(default_factory=dict)

    @field_validator("input")
    @classmethod
    def _input(cls, v: dict[str, Any]) -> dict[str, Any]:
        # deeper inputs were stored (pydantic writes up to 255 levels) and then no reader could parse them back:
        # every list/export/show of the prefix failed and the controller left the rollout claimed for ever
        if too_deep(v):
            raise ValueError(f"input nests JSON deeper than {MAX_JSON_DEPTH} levels")
        return v

    @field_validator("group_id")
    @classmethod
    def _group_id(cls, v: str | None) -> str | None:
        return v if v is None else check_rollout_id(v, "group id")

    @field_validator("attempt_id")
    @classmethod
    def _attempt_id(cls, v: str) -> str:
        return check_attempt_id(v)


def env_map_fault(rollout: Rollout) -> str | None:
    """Why ``rollout.env_map`` cannot become environment variables of its harness, or ``None``: a name that is
    empty, longer than 256 characters, holds ``=`` or anything but printable ASCII (a NUL, a newline, a space, ``É``:
    an OS or the Kubernetes API server refuses it, even its relaxed names of 1.32); a string input value it maps that
    holds a NUL (no environment can hold one). Checked when the rollout is created, so that it is refused then, not
    at every attempt."""
    for name, field in rollout.env_map.items():
        if not name or len(name) > 256 or "=" in name or any(not 0x21 <= ord(ch) <= 0x7E for ch in name):
            return f"env_map name {name[:60]!r} is not an environment variable name"
        value = rollout.input.get(field)
        if isinstance(value, str) and "\x00" in value:
            return f"env_map {name[:60]!r}: input field {field[:60]!r} holds a NUL, which no environment can"
    return None


class GroupInfo(BaseModel):
    """One GRPO group as registered in the store when its rollouts are created.

    ``owner`` is the trainer run (its scheduler tag) that trains the group; ``None`` for groups no trainer
    trains (evaluations). A restarted trainer adopts the groups it owns from this record, never from ids.
    ``run`` is the run the group belongs to, its evaluations included (a trainer run's id, or an ``eval-...``
    directory's name): ``rollouts list/export --run`` and the dashboard select a run's rollouts by it
    (:meth:`agl_common.store.Store.run_rollout_ids`), never by id prefix. ``None``: no run. Floats are finite.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    group_id: str
    rollout_ids: list[str]
    policy_version: int = 0
    owner: str | None = None
    run: str | None = None
    created_at: float = Field(default_factory=time.time)

    @field_validator("group_id")
    @classmethod
    def _group_id(cls, v: str) -> str:
        return check_rollout_id(v, "group id")

    @field_validator("run")
    @classmethod
    def _run(cls, v: str | None) -> str | None:
        return v if v is None else check_rollout_id(v, "run id")


Route = Literal["chat", "completions", "messages", "responses"]


#: Token ids a record may hold: ``[0, 2**31)`` (every vocabulary fits; torch, Parquet and the trainer's int64
#: tensors take them).
TOKEN_ID_LIMIT = 2**31
#: A sampled token's logprob is at most 0 (this much above it is float rounding) and above vLLM's floor for -inf
#: (``max(logprob, -9999.0)`` in its OpenAI server): a token the engine gave probability 0 cannot have been sampled.
LOGPROB_CEILING = 1e-3
LOGPROB_FLOOR = -9999.0


def token_id_fault(*id_lists: list[int]) -> str | None:
    """Why token ids (``(T,)`` lists of ints) cannot be a record's: the first outside ``[0, TOKEN_ID_LIMIT)``, or
    ``None``."""
    bad = next((t for ids in id_lists for t in ids if not 0 <= t < TOKEN_ID_LIMIT), None)
    return None if bad is None else f"token id {bad} out of range (0 to {TOKEN_ID_LIMIT - 1})"[:200]


def logprob_fault(logprobs: list[float]) -> str | None:
    """Why sampled tokens' logprobs (``(T,)``, nats) cannot be a record's: the first outside ``(LOGPROB_FLOOR,
    LOGPROB_CEILING]``, or ``None``."""
    bad = next((x for x in logprobs if not LOGPROB_FLOOR < x <= LOGPROB_CEILING), None)
    return None if bad is None else (f"logprob {bad!r} is not a log-probability of a sampled token (above 0, or at "
                                     f"or below the engine's {LOGPROB_FLOOR} floor for -inf)")


def record_fault(record: CallRecord) -> str | None:
    """Why ``record`` breaks the rules the gateway keeps for every record it writes, or ``None``: token ids in
    ``[0, TOKEN_ID_LIMIT)`` (any status); for an ``ok`` record also one logprob per response token id (or none),
    each in ``(LOGPROB_FLOOR, LOGPROB_CEILING]``. :meth:`agl_common.store.Store.record_call` (in-process writers)
    refuses such a record; the gateway writes none (``agl_gateway.capture.check``, with the same two checks)."""
    why = token_id_fault(record.prompt_token_ids, record.response_token_ids)
    lps = record.response_logprobs
    if why or record.status != "ok" or lps is None:
        return why
    if len(lps) != len(record.response_token_ids):
        return f"{len(lps)} logprobs for {len(record.response_token_ids)} response token ids"
    return logprob_fault(lps)


class CallRecord(BaseModel):
    """One model call as the gateway recorded it (CONTRACT §3).

    ``response_token_ids`` and ``response_logprobs`` are aligned: ``len(response_logprobs) ==
    len(response_token_ids)`` whenever logprobs are present. Logprobs are natural-log probabilities
    (float, nats) of each sampled token under the serving policy, as the engine reported them.
    ``started_at`` / ``ended_at`` are Unix seconds; ``latency_ms`` is milliseconds. Every float is finite
    (``ValueError`` otherwise): JSON has no NaN, so a NaN written as ``null`` made the rollout's records unreadable.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    rollout_id: str
    attempt_id: str
    seq: int
    route: Route
    request: dict[str, Any]
    response: dict[str, Any] | None
    prompt_token_ids: list[int] = Field(default_factory=list)
    response_token_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] | None = None
    finish_reason: str | None = None
    model_version: int = 0
    model: str | None = None
    #: the role of the harness's sub-agent that made the call (:attr:`Policy.roles`); None without roles
    role: str | None = None
    latency_ms: float = 0.0
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    started_at: float = 0.0
    ended_at: float = 0.0


#: Request fields that change the sampling distribution, each with the values that leave it plain (softmax of the
#: raw logits: temperature 1, no truncation, penalty, bias, mask or constraint). OpenAI chat/completions and vLLM's
#: extras; Anthropic and Responses bodies use the same names for what they share (``top_k``, ``text``); a dotted
#: name is a field of an object (``output_config.format``).
PLAIN_SAMPLING: dict[str, tuple[Any, ...]] = {
    "temperature": (None, 1), "top_p": (None, 1), "top_k": (None, -1, 0), "min_p": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "allowed_token_ids": (None, []), "bad_words": (None, []), "min_tokens": (None, 0),
    "response_format": (None,), "response_format.type": (None, "text"), "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "use_beam_search": (None, False),
    "tool_choice": (None, "auto", "none"), "tool_choice.type": (None, "auto", "none"),
    "text": (None,), "text.format": (None,), "text.format.type": (None, "text"),  # Responses
    "output_format": (None,), "output_config.format": (None,),  # Anthropic structured outputs (constrained)
    # vLLM's own: a thinking budget forces the end-of-thinking tokens, extra args feed custom logits processors,
    # a watermark biases the logits, a length penalty is beam search's
    "thinking_token_budget": (None,), "vllm_xargs": (None, {}), "watermarking": (None, False),
    "length_penalty": (None, 1),
}


def sampling_not_plain(request: dict[str, Any]) -> str | None:
    """Why the logprobs an engine records for a call of ``request`` are not those of the distribution its tokens
    were sampled from, or ``None`` when they are: vLLM reports *raw* logprobs (``log_softmax`` of the logits
    before temperature, top-k/top-p, penalties, biases, masks and structured outputs: its default
    ``logprobs_mode``), and a trainer scores the policy the same way; so only a call that sampled from that very
    distribution (:data:`PLAIN_SAMPLING`) gives on-policy behaviour logprobs for PPO's ratio. Names the first
    differing fields, e.g. ``"temperature=0.7"`` (a ``tool_choice`` that requires a tool is a constraint). An object
    with listed fields (``tool_choice.type``, ``text.format.type``) is judged by those alone: ``{"type": "auto",
    "disable_parallel_tool_use": false}`` and ``{"format": {"type": "text"}, "verbosity": "medium"}`` are plain."""
    def same(value: Any, plain: Any) -> bool:  # (true is not 1 here)
        return value == plain and isinstance(value, bool) == isinstance(plain, bool)

    def value(name: str) -> Any:  # "a.b": field b of object a (None where absent)
        obj: Any = request
        for part in name.split("."):
            obj = obj.get(part) if isinstance(obj, dict) else None
        return obj

    def judged_by_fields(name: str) -> bool:  # an object whose listed fields are judged one by one
        return isinstance(value(name), dict) and any(k.startswith(name + ".") for k in PLAIN_SAMPLING)

    odd = [f"{name}={value(name)!r:.30}" for name, plain in PLAIN_SAMPLING.items()
           if value(name) is not None and not judged_by_fields(name) and not any(same(value(name), v) for v in plain)]
    return ", ".join(odd[:3]) or None


def first_choice(call: CallRecord) -> dict[str, Any]:
    """The choice of ``index`` 0 of a recorded chat or completions answer (the one whose token ids the record holds,
    wherever the engine put it in ``choices``; a choice without ``index`` takes its position), ``{}`` when the
    answer has no such object (an error, another route, an odd shape). Its ``message`` (chat) may still be
    anything: check before use. The one reading of "the answer" for reward functions, the dashboard and export."""
    resp = call.response if isinstance(call.response, dict) else {}
    choices = resp.get("choices") if call.route in ("chat", "completions") else None
    for k, choice in enumerate(choices if isinstance(choices, list) else ()):
        if isinstance(choice, dict) and choice.get("index", k) == 0 and type(choice.get("index", k)) is int:
            return choice
    return {}


def answer_text(call: CallRecord) -> str:
    """The assistant's text in a recorded answer, whatever the route: chat ``choices[0].message.content`` (a
    string or a list of text parts), completions ``choices[0].text``, Anthropic Messages ``content`` text blocks,
    Responses ``output_text`` or the ``output_text`` parts of its ``output`` messages. Always a ``str`` ("" when
    the answer holds no text: a tool call, an error, an odd shape); a non-string content is never passed on.
    The one definition used by reward functions (the controller) and the dashboard."""
    resp = call.response if isinstance(call.response, dict) else {}

    def texts(parts: Any, kinds: tuple[str, ...]) -> str:
        if isinstance(parts, str):
            return parts
        if not isinstance(parts, list):
            return ""
        return "".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") in kinds
                       and isinstance(p.get("text"), str))

    if call.route in ("chat", "completions"):
        first = first_choice(call)
        msg = first.get("message")
        if isinstance(msg, dict):
            return texts(msg.get("content"), ("text",))
        return first["text"] if isinstance(first.get("text"), str) else ""
    if call.route == "messages":
        return texts(resp.get("content"), ("text",))
    if call.route == "responses":
        if isinstance(resp.get("output_text"), str):
            return resp["output_text"]
        output = resp.get("output")
        return "".join(texts(item.get("content"), ("output_text", "text")) for item in output
                       if isinstance(item, dict) and item.get("type") == "message") if isinstance(output, list) else ""
    return ""


#: Largest |reward| accepted (from a harness, a reward function or a CLI): far above any reward scale in use,
#: and small enough that a group's advantage statistics cannot overflow.
REWARD_LIMIT = 1e9
#: Longest reward message, event type (characters) and event (bytes of JSON), and most events one attempt may post.
REWARD_MESSAGE_MAX = 4096
EVENT_TYPE_MAX = 128
EVENT_BYTES_MAX = 64 * 1024
EVENTS_PER_ATTEMPT_MAX = 1000


def check_reward(value: Any) -> float:
    """``value`` as a float if it can be a reward: a real number (``int``, ``float``, a NumPy scalar; not a bool,
    a string, bytes or a NumPy ``timedelta64``, which NumPy registers as an integer: a duration is no score),
    finite, with ``|value| <=`` :data:`REWARD_LIMIT`; else ``ValueError`` saying why (NaN and inf would be stored
    as null; a huge one overflows the advantage). The gateway's reward route and the
    controller's ``--reward-fn`` both use it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or getattr(getattr(value, "dtype", None), "kind", None) not in (None, "i", "u", "f"):
        raise ValueError(f"a reward must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except (OverflowError, TypeError, ValueError) as exc:  # an int beyond float range (10**400), an odd Real
        raise ValueError(f"a reward must be a finite number within ±{REWARD_LIMIT:g}: {exc}") from None
    if not math.isfinite(value) or abs(value) > REWARD_LIMIT:
        raise ValueError(f"a reward must be a finite number within ±{REWARD_LIMIT:g}, got {value!r}")
    return value


class RewardIn(BaseModel):
    """Body of ``POST .../reward``: ``value`` a JSON number (:func:`check_reward`), ``message`` optional text."""

    model_config = ConfigDict(extra="forbid")
    value: Annotated[float, Field(strict=True)]
    message: str | None = Field(None, max_length=REWARD_MESSAGE_MAX)

    @field_validator("value")
    @classmethod
    def _a_reward(cls, v: float) -> float:
        return check_reward(v)


#: Event types only the controller writes (a retried or interrupted attempt, a posted reward its reward function
#: replaced); ``POST .../events`` refuses them, so a harness cannot forge the controller's record of its run.
CONTROLLER_EVENTS = frozenset({"attempt_failed", "attempt_interrupted", "reward_replaced"})


class EventIn(BaseModel):
    """Body of ``POST .../events``: a harness's event (not one of :data:`CONTROLLER_EVENTS`)."""

    model_config = ConfigDict(extra="forbid")
    type: str = Field(max_length=EVENT_TYPE_MAX)
    data: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _printable(cls, v: str) -> str:
        """Printable text, not only spaces: no control, format (bidi overrides, zero-width) or line-separator
        characters that a terminal or a log reader would act on (``str.isprintable``)."""
        if not v.strip() or not v.isprintable():
            raise ValueError(f"an event type is printable text, got {v!r:.60}")
        if v in CONTROLLER_EVENTS:
            raise ValueError(f"event type {v!r} is the controller's (reserved: {', '.join(sorted(CONTROLLER_EVENTS))})")
        return v


#: A policy version number: 0 (the base model) and up, within a signed 64-bit integer (what msgpack, Parquet
#: and the trackers store); a resume with any other version is refused before it reaches a gateway.
PolicyVersion = Annotated[int, Field(ge=0, lt=2**63)]


class ControlCommand(BaseModel):
    """A message on the gateway control channel.

    Pauses have owners: ``pause`` with ``id`` N adds pause N to the store's set of held pauses; a replica
    holds new calls while that set is not empty and acknowledges N (``ReplicaStatus.drained_ids``) once
    its in-flight calls reach 0. ``resume`` ends the pause named by ``release`` (every pause with
    ``release_all``: an operator's override; neither: no pause ends) and, if ``model`` is set, routes new
    calls to that served model name, tagged with ``version``. So when two pauses overlap (a trainer and an
    operator, two trainers), the end of one never releases the other.
    """

    cmd: Literal["pause", "resume"]
    id: str
    model: str | None = None
    version: PolicyVersion | None = None
    #: resume only: the id of the pause it ends
    release: str | None = None
    #: resume only: end every pause, whoever holds it
    release_all: bool = False
    #: pause only: Unix time (s) after which the pause is over on its own, so that a trainer killed
    #: between pause and resume cannot leave replicas (or replicas started later) paused for good.
    expires_at: float | None = None
    #: resume with ``model`` only: the policy's roles (:attr:`Policy.roles`, :attr:`Policy.role_models`)
    roles: dict[str, str] = Field(default_factory=dict)
    role_models: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _a_policy_or_none(self) -> "ControlCommand":
        if (self.roles or self.role_models) and (self.cmd != "resume" or self.model is None):
            raise ValueError("roles travel only with a resume that names a model")
        self.policy()  # a resume's policy must be valid: refused when built and when parsed, never applied half
        return self

    def policy(self) -> "Policy | None":
        """The policy a resume with a ``model`` switches to (None for any other command); raises
        ``pydantic.ValidationError`` for a policy that is not valid (an empty model name, roles that do not fit
        together)."""
        if self.cmd != "resume" or self.model is None:
            return None
        return Policy(model=self.model, version=self.version or 0, roles=self.roles, role_models=self.role_models)


class ReplicaStatus(BaseModel):
    """What one gateway replica reports in its heartbeat (refreshed every second, with a TTL)."""

    replica_id: str
    paused: bool = False
    in_flight: int = 0
    held: int = 0
    #: the pauses held when its in-flight calls last reached 0 while paused (each acknowledged drained)
    drained_ids: list[str] = Field(default_factory=list)
    model: str | None = None
    version: int = 0
    updated_at: float = Field(default_factory=time.time)


#: What a role's name may hold (it becomes part of a served model name and of a directory name).
_ROLE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


def check_role_name(role: str) -> str:
    """Return ``role`` if it can name a role: 1 to 64 ASCII letters, digits or ``_``; else ``ValueError``."""
    if not isinstance(role, str) or not _ROLE_NAME.fullmatch(role):
        raise ValueError(f"a role name is 1 to 64 ASCII letters, digits or _, got {role!r:.70}")
    return role


class UnknownRole(ValueError):
    """A call names no role of the policy, or an unknown one, or two that disagree (the gateway answers 400)."""


def check_served_name(name: str) -> str:
    """``name`` if it can be a served model name (what every replica routes calls to, shown on every status
    line): 1 to 256 printable characters (no terminal escapes), no spaces around; else ``ValueError``."""
    if not name or len(name) > 256 or not name.isprintable() or name != name.strip():
        raise ValueError(f"served model name {name[:80]!r}: 1-256 printable characters, no spaces around")
    return name


def listed_models(raw: bytes | None, where: str) -> list:
    """The entries of an engine's ``GET /v1/models`` answer body ``raw`` (OpenAI's ``{"data": [{"id": ...}]}``), as
    parsed (entries are not checked). Raises ``ValueError`` naming ``where`` if ``raw`` is no such list (not JSON, too
    deeply nested, an HTML page of a web server at a mistyped port, no model). The one parser of a models list: the
    gateway's discovery (:func:`first_listed_model`) and the trainer's engine check read it alike."""
    import orjson

    try:
        data = orjson.loads(raw)["data"] if raw else None  # (orjson: nesting past 1024 is an error)
    except (orjson.JSONDecodeError, TypeError, KeyError, IndexError):
        data = None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where} listed no model (no OpenAI models list: is it an engine?)")
    return data


def served_names(raw: bytes | None, where: str) -> list[str]:
    """Every model id of an engine's ``GET /v1/models`` answer that can be a served name (:func:`check_served_name`),
    in the engine's order: its base model's names and the adapters it has loaded. ``ValueError`` as
    :func:`listed_models`."""
    names = [entry.get("id") for entry in listed_models(raw, where) if isinstance(entry, dict)]
    return [name for name in names if isinstance(name, str) and _is_served_name(name)]


def _is_served_name(name: str) -> bool:
    """Whether :func:`check_served_name` takes ``name``."""
    try:
        check_served_name(name)
    except ValueError:
        return False
    return True


def first_listed_model(raw: bytes | None, where: str) -> str:
    """The first model id of an engine's ``GET /v1/models`` answer body ``raw`` (:func:`listed_models`): the name a
    gateway routes to when no policy is set. Raises ``ValueError`` naming ``where`` if ``raw`` is no models list or
    its first id can be no served name (:func:`check_served_name`); later entries are not read."""
    first = listed_models(raw, where)[0]
    name = first.get("id") if isinstance(first, dict) else None
    if name is None:
        raise ValueError(f"{where} listed no model (no OpenAI models list: is it an engine?)")
    if not isinstance(name, str):
        raise ValueError(f"{where} listed a model id that is not a string")
    try:
        return check_served_name(name)
    except ValueError:
        raise ValueError(f"{where} listed the model id {name[:80]!r}, which is no served name") from None


class Policy(BaseModel):
    """The policy the gateway routes new calls to: a served model name and its version number.

    With ``roles`` (a harness whose sub-agents each train their own adapter), each call is routed by its
    role: ``roles`` maps each role to the served model name of its current adapter (the base model's name
    until the role is first updated), ``role_models`` maps each model name a harness gives a sub-agent to
    its role. One ``version`` covers every role (the step that published it). See :func:`route_call`.
    """

    model: str = Field(min_length=1)
    version: PolicyVersion = 0
    roles: dict[str, str] = Field(default_factory=dict)
    role_models: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _roles_are_consistent(self) -> "Policy":
        check_served_name(self.model)
        for role, served in self.roles.items():
            check_role_name(role)
            if not served:
                raise ValueError(f"role {role!r} has an empty served model name")
            check_served_name(served)
        if "" in self.role_models:
            raise ValueError("role_models holds an empty model name")
        unknown = sorted({r for r in self.role_models.values() if r not in self.roles})
        if unknown:
            raise ValueError(f"role_models names roles that are not in roles: {unknown}")
        return self


def route_call(policy: Policy, model: str | None, role: str | None = None) -> tuple[str | None, str]:
    """``(role, served model name)`` for a call that asked for ``model`` (its body's ``model``) and named
    ``role`` (the ``X-AGL-Role`` header, or None).

    Without roles: ``(None, policy.model)`` whatever was asked. With roles, the role is the header's, or else
    the one ``model`` belongs to (:attr:`Policy.role_models`); the call goes to that role's served name.
    Raises :class:`UnknownRole` (its message names the known roles and their model names) for an unknown
    header role, a model name of no role with no header, or a header and a model name of two roles.
    """
    if not policy.roles:
        return None, policy.model
    by_model = policy.role_models.get(model) if isinstance(model, str) else None
    if role is not None:
        if role not in policy.roles:
            raise UnknownRole(f"unknown role {role!r:.70} (X-AGL-Role); {_known(policy)}")
        if by_model is not None and by_model != role:
            raise UnknownRole(f"X-AGL-Role says {role!r} but model {model!r:.70} is role {by_model!r}; "
                              f"{_known(policy)}")
        return role, policy.roles[role]
    if by_model is None:
        raise UnknownRole(f"model {model!r:.70} names no role (and no X-AGL-Role header was sent); {_known(policy)}")
    return by_model, policy.roles[by_model]


def _known(policy: Policy) -> str:
    names = {r: sorted(m for m, rr in policy.role_models.items() if rr == r) for r in policy.roles}
    return "known roles: " + ", ".join(f"{r} (model {', '.join(repr(m) for m in ms) or 'none: header only'})"
                                       for r, ms in sorted(names.items()))


def policy_name(version: int, role: str | None = None) -> str:
    """The name policy ``version`` is served and stored under when it is not the base model: ``policy-v{N}``
    (a LoRA adapter's served name, its directory under a run's ``adapters/``); a role's adapter is
    ``policy-v{N}-{role}``."""
    return f"policy-v{version}" + (f"-{check_role_name(role)}" if role is not None else "")


def policy_version(name: str) -> int | None:
    """The version in a :func:`policy_name` (``policy-v3`` → 3, ``policy-v3-solver`` → 3), None for any other
    name."""
    m = re.fullmatch(r"policy-v(\d+)(?:-[A-Za-z0-9_]{1,64})?", name)
    return int(m[1]) if m else None
