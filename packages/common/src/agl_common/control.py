"""The pause / drain / resume protocol between the trainer and every gateway replica.

1. The trainer publishes ``ControlCommand(cmd="pause", id=N)``.
2. Each replica stops forwarding new calls (they are *held*, not rejected), lets in-flight calls
   finish, and once its in-flight count is 0 reports ``drained_id=N`` in its heartbeat.
3. :func:`pause_and_drain` returns when every member replica reports ``drained_id == N``: live ones and those
   whose heartbeat is late (a starved replica is not taken for dead until ``REPLICA_LATE_S``).
4. ``resume`` releases held calls, optionally switching new calls to a new policy (served model name
   and version).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from .schemas import ControlCommand, ReplicaStatus
from .store import REPLICA_TTL_S, Store


class DrainTimeout(TimeoutError):
    """Not every live gateway replica acknowledged the drain in time."""


#: Longest a pause lasts if its publisher never resumes (killed mid-update): replicas resume on their own.
MAX_PAUSE_S = 3600.0


async def pause_and_drain(store: Store, timeout_s: float = 60.0, poll_s: float = 0.05,
                          max_pause_s: float = MAX_PAUSE_S) -> list[ReplicaStatus]:
    """Pause all gateway replicas and wait until each reports its in-flight calls drained.

    Returns the replicas' statuses at the moment of the acknowledgement. With no live replica, returns
    ``[]`` at once (nothing can be in flight). A replica whose heartbeat is late (its event loop starved under
    CPU contention) is waited for like a live one, until it acknowledges or leaves the registry
    (:data:`agl_common.store.REPLICA_LATE_S` after its last heartbeat). Raises :class:`DrainTimeout` after
    ``timeout_s`` seconds, naming the replicas that did not acknowledge (late ones marked).

    A pause that does not complete (timeout, Redis error, cancellation) is withdrawn before the error
    propagates: a ``resume`` on the same policy is published, so no replica stays paused and replicas
    started later do not come up paused. The pause itself expires ``max_pause_s`` seconds after it was
    published (:attr:`ControlCommand.expires_at`), in case its publisher dies before resuming.
    Replica statuses come from the store's registry (two round trips per poll, every ``poll_s`` seconds).
    """
    command = ControlCommand(cmd="pause", id=uuid.uuid4().hex, expires_at=time.time() + max_pause_s)
    try:
        await store.publish_control(command)
        deadline = time.monotonic() + timeout_s
        while True:
            replicas = await store.replicas(include_late=True)
            if all(r.paused and r.drained_id == command.id for r in replicas):
                return replicas
            if time.monotonic() > deadline:
                now = time.time()
                waiting = [r.replica_id + (f" (heartbeat {now - r.updated_at:.0f} s late)"
                                           if now - r.updated_at >= REPLICA_TTL_S else "")
                           for r in replicas if r.drained_id != command.id]
                raise DrainTimeout(f"replicas not drained after {timeout_s} s (pause withdrawn): {waiting}")
            await asyncio.sleep(poll_s)
    except BaseException:
        await asyncio.shield(_withdraw(store))
        raise


async def _withdraw(store: Store) -> None:
    """Best effort: resume on the same policy (a Redis that is down will also expire the pause)."""
    try:
        await resume(store)
    except Exception:  # noqa: BLE001 - the original error matters more; the pause still expires
        pass


async def resume(store: Store, model: str | None = None, version: int | None = None) -> ControlCommand:
    """Release held calls on every replica; with ``model`` set, route new calls to that policy.

    Raises ``pydantic.ValidationError`` (nothing published) for a version outside :data:`PolicyVersion`.
    """
    command = ControlCommand(cmd="resume", id=uuid.uuid4().hex, model=model, version=version)
    await store.publish_control(command)
    return command
