"""The pause / drain / resume protocol between the trainer and every gateway replica.

1. The trainer publishes ``ControlCommand(cmd="pause", id=N)``: pause N joins the store's set of held
   pauses (pauses have owners).
2. Each replica stops forwarding new calls (they are *held*, not rejected) while that set is not empty, lets
   in-flight calls finish, and once its in-flight count is 0 reports N among its ``drained_ids``.
3. :func:`pause_and_drain` returns when every member replica reports N drained: live ones and those
   whose heartbeat is late (a starved replica is not taken for dead until ``REPLICA_LATE_S``).
4. ``resume(release=N)`` ends pause N (held calls go on once no other pause is held), optionally switching
   new calls to a new policy (served model name and version). Ending one pause never ends another: a
   trainer's pause survives an operator's ``agl-trainer gateway pause`` timing out, and the other way round.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

from .schemas import ControlCommand, Policy, ReplicaStatus
from .store import REPLICA_TTL_S, Store


class DrainTimeout(TimeoutError):
    """Not every live gateway replica acknowledged the drain in time."""


#: Longest a pause lasts if its publisher never resumes (killed mid-update): replicas resume on their own.
MAX_PAUSE_S = 3600.0


def new_pause_id() -> str:
    """A fresh pause id (the owner's name for its pause: pass it to :func:`pause_and_drain` and, to end the
    pause, to :func:`resume` as ``release``)."""
    return uuid.uuid4().hex


async def pause_and_drain(store: Store, pause_id: str | None = None, timeout_s: float = 60.0, poll_s: float = 0.05,
                          max_pause_s: float = MAX_PAUSE_S) -> list[ReplicaStatus]:
    """Hold pause ``pause_id`` (default: a new one; end it with ``resume(release=pause_id)``) on all gateway
    replicas and wait until each reports its in-flight calls drained.

    Returns the replicas' statuses at the moment of the acknowledgement. With no replica in the registry for
    :data:`agl_common.store.REPLICA_TTL_S` seconds, returns ``[]`` (nothing can be in flight; a registry found
    empty is not believed at once: Redis may have just come back without it; a ``timeout_s`` shorter than that
    raises :class:`DrainTimeout` then). A replica whose heartbeat is late (its event loop starved under
    CPU contention) is waited for like a live one, until it acknowledges or leaves the registry
    (:data:`agl_common.store.REPLICA_LATE_S` after its last heartbeat). Raises :class:`DrainTimeout` after
    ``timeout_s`` seconds, naming the replicas that did not acknowledge (late ones marked).

    A pause that does not complete (timeout, Redis error, cancellation) is withdrawn before the error
    propagates: a ``resume`` releasing ``pause_id`` alone (other owners' pauses stay held) is published. The pause itself expires ``max_pause_s`` seconds after it was
    published (:attr:`ControlCommand.expires_at`), in case its publisher dies before resuming.
    Replica statuses come from the store's registry (two round trips per poll, every ``poll_s`` seconds).
    Raises ``ValueError`` (nothing published) for a ``timeout_s`` that is not a positive finite number.
    """
    if not (math.isfinite(timeout_s) and timeout_s > 0):  # a NaN deadline would never pass: a pause held for good
        raise ValueError(f"timeout_s must be a number of seconds above 0, got {timeout_s!r}")
    command = ControlCommand(cmd="pause", id=pause_id or new_pause_id(), expires_at=time.time() + max_pause_s)
    try:
        await store.publish_control(command)
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            replicas = await store.replicas(include_late=True)
            now_m = time.monotonic()
            # an empty registry is believed only once a replica would have heartbeaten into it: right after Redis
            # came back empty (a restart, a failover) a replica with calls in flight is missing for a heartbeat
            settled = replicas or now_m - start >= REPLICA_TTL_S
            if settled and all(r.paused and command.id in r.drained_ids for r in replicas):
                return replicas
            if now_m > deadline:
                now = time.time()
                waiting = [r.replica_id + (f" (heartbeat {now - r.updated_at:.0f} s late)"
                                           if now - r.updated_at >= REPLICA_TTL_S else f" ({r.in_flight} in flight)")
                           for r in replicas if command.id not in r.drained_ids]
                if not replicas:
                    raise DrainTimeout(f"no gateway replica seen in {timeout_s} s (pause withdrawn): an empty registry "
                                       f"is believed only after {REPLICA_TTL_S} s; give a longer timeout")
                raise DrainTimeout(f"replicas not drained after {timeout_s} s (pause withdrawn): {waiting}")
            await asyncio.sleep(poll_s)
    except BaseException:
        await asyncio.shield(_withdraw(store, command.id))
        raise


async def _withdraw(store: Store, pause_id: str) -> None:
    """Best effort: end pause ``pause_id`` on the same policy (a Redis that is down will also expire it)."""
    try:
        await resume(store, release=pause_id)
    except Exception:  # noqa: BLE001 - the original error matters more; the pause still expires
        pass


async def resume(store: Store, model: str | None = None, version: int | None = None, release: str | None = None,
                 release_all: bool = False, policy: Policy | None = None) -> ControlCommand:
    """End pause ``release`` (``release_all``: every pause, whoever holds it); with ``policy`` (or ``model`` and
    ``version``) set, route new calls to that policy (its roles too). Held calls go on once no pause is held.
    With neither ``release`` nor ``release_all`` it only switches the policy.

    Raises ``pydantic.ValidationError`` (nothing published) for a version outside :data:`PolicyVersion`.
    """
    if policy is not None:
        model, version = policy.model, policy.version
    command = ControlCommand(cmd="resume", id=uuid.uuid4().hex, model=model, version=version, release=release,
                             release_all=release_all, roles=policy.roles if policy else {},
                             role_models=policy.role_models if policy else {})
    await store.publish_control(command)
    return command
