"""Every wire type of AGL, and the rollout state machine.

This is the project's only shared vocabulary: the gateway writes these records, the controller moves
rollouts through their states, the trainer reads both. Nothing else invents its own dict shapes.
Field names follow ``docs/contract.md`` section 3.
"""

from __future__ import annotations

import re
import time
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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


def check_rollout_id(rollout_id: str) -> str:
    """Return ``rollout_id`` if it can name a rollout: 1 to :data:`ROLLOUT_ID_MAX` characters of
    :data:`ROLLOUT_ID_CHARS`, the first a letter, digit or ``_``. Raises ``ValueError`` saying which rule it
    breaks (and the first character that breaks it)."""
    if not isinstance(rollout_id, str) or not 0 < len(rollout_id) <= ROLLOUT_ID_MAX:
        n = len(rollout_id) if isinstance(rollout_id, str) else type(rollout_id).__name__
        raise ValueError(f"rollout id must be 1 to {ROLLOUT_ID_MAX} characters, got {n}")
    if not _ROLLOUT_ID.fullmatch(rollout_id):
        bad = next((c for i, c in enumerate(rollout_id)
                    if not _ROLLOUT_ID.fullmatch(c if i == 0 else "a" + c)), "?")
        raise ValueError(f"rollout id may hold only ASCII letters, digits and . _ ~ : @ - (starting with a letter, "
                         f"a digit or _): {rollout_id!r:.60} holds {bad!r}")
    return rollout_id


class Rollout(BaseModel):
    """One run of the harness on one input; ``group_id`` ties the n rollouts of a GRPO group."""

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


class GroupInfo(BaseModel):
    """One GRPO group as registered in the store when its rollouts are created.

    ``owner`` is the trainer run (its scheduler tag) that trains the group; ``None`` for groups no trainer
    trains (evaluations). A restarted trainer adopts the groups it owns from this record, never from ids.
    """

    group_id: str
    rollout_ids: list[str]
    policy_version: int = 0
    owner: str | None = None
    created_at: float = Field(default_factory=time.time)


Route = Literal["chat", "completions", "messages", "responses"]


class CallRecord(BaseModel):
    """One model call as the gateway recorded it (CONTRACT §3).

    ``response_token_ids`` and ``response_logprobs`` are aligned: ``len(response_logprobs) ==
    len(response_token_ids)`` whenever logprobs are present. Logprobs are natural-log probabilities
    (float, nats) of each sampled token under the serving policy, as the engine reported them.
    ``started_at`` / ``ended_at`` are Unix seconds; ``latency_ms`` is milliseconds.
    """

    model_config = ConfigDict(extra="allow")

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
    latency_ms: float = 0.0
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    started_at: float = 0.0
    ended_at: float = 0.0


class RewardIn(BaseModel):
    """Body of ``POST .../reward``."""

    model_config = ConfigDict(extra="forbid")
    value: float
    message: str | None = None


class EventIn(BaseModel):
    """Body of ``POST .../events``."""

    model_config = ConfigDict(extra="forbid")
    type: str
    data: dict[str, Any] = Field(default_factory=dict)


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


class Policy(BaseModel):
    """The policy the gateway routes new calls to: a served model name and its version number."""

    model: str
    version: PolicyVersion = 0


def policy_name(version: int) -> str:
    """The name policy ``version`` is served and stored under when it is not the base model: ``policy-v{N}``
    (a LoRA adapter's served name, its directory under a run's ``adapters/``)."""
    return f"policy-v{version}"


def policy_version(name: str) -> int | None:
    """The version in a :func:`policy_name` (``policy-v3`` → 3), None for any other name."""
    m = re.fullmatch(r"policy-v(\d+)", name)
    return int(m[1]) if m else None
