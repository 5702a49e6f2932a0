"""The pause gate: holds new calls while paused, counts in-flight calls, reports the drain.

Single-threaded asyncio: the check "gate open?" and the in-flight increment run without an ``await``
between them, so no call can start upstream after a drain was acknowledged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agl_common.aio import wait_until


class HeldTooLong(Exception):
    """A call was held longer than ``max_hold`` seconds during a pause."""


class GateClosed(Exception):
    """The gateway is shutting down: held and new calls are turned away (503, retry elsewhere)."""


class TooManyHeld(Exception):
    """One rollout attempt already has ``max_held_per_attempt`` calls held by the pause or in flight."""


class PauseGate:
    """Admission control for model calls.

    Args:
        max_hold_s: longest a call may wait for resume before :class:`HeldTooLong` (seconds).
        on_change: called (synchronously) whenever paused / in-flight / drained state changes.
        max_held_per_attempt: most calls of one rollout attempt held or in flight at once (each holds its
            request body in memory: one harness must not park any number of them); beyond, :class:`TooManyHeld`.
    """

    def __init__(self, max_hold_s: float, on_change: Callable[[], None] | None = None,
                 max_held_per_attempt: int = 64):
        self.max_hold_s = max_hold_s
        self.max_held_per_attempt = max_held_per_attempt
        self._held_by: dict[str, int] = {}
        self._open = asyncio.Event()
        self._open.set()
        self.in_flight = 0
        self.held = 0
        self.pause_ids: frozenset[str] = frozenset()  # the pauses held (owned pauses: see agl_common.control)
        self.drained_ids: frozenset[str] = frozenset()
        self.paused_at: float | None = None
        self.last_drain_s: float | None = None  # seconds from the last pause to its drain
        self._on_change = on_change or (lambda: None)
        self.closed = False

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def hold(self, pause_ids: frozenset[str]) -> None:
        """Hold new calls while ``pause_ids`` (the pauses held now) is not empty; acknowledge each of them
        drained once in-flight calls reach 0. An empty set releases every held call."""
        pause_ids = frozenset(pause_ids)
        if pause_ids == self.pause_ids:
            return
        if not pause_ids:
            self.pause_ids = self.drained_ids = frozenset()
            self.paused_at = None
            self._open.set()
        else:
            if not self.paused:
                self.paused_at = time.monotonic()
            self._open.clear()
            self.pause_ids = pause_ids
            self.drained_ids = pause_ids if self.in_flight == 0 else self.drained_ids & pause_ids
        self._on_change()

    def close(self) -> None:
        """Shutting down: every held call and every later one raises :class:`GateClosed` (calls already in
        flight finish). Without this a gateway stopped during a pause would wait for its held calls."""
        self.closed = True
        self._open.set()  # wake the held calls; they see ``closed``

    async def enter(self, who: str = "") -> bool:
        """Wait while paused (re-checking after every wake-up), then count the call as in flight; ``who``: the
        calling attempt (its calls held or in flight are counted). Returns whether the call was held.

        Raises :class:`HeldTooLong` after ``max_hold_s`` seconds of waiting, :class:`GateClosed` once
        :meth:`close` was called, :class:`TooManyHeld` if ``who`` has ``max_held_per_attempt`` calls held or in
        flight already. Pair with :meth:`leave` (same ``who``).
        """
        if self.closed:
            raise GateClosed()
        if self._held_by.get(who, 0) >= self.max_held_per_attempt:
            raise TooManyHeld()
        self._held_by[who] = self._held_by.get(who, 0) + 1  # until leave(who), or a failure to enter
        held = self.paused
        if held:
            self.held += 1
            deadline = time.monotonic() + self.max_hold_s
            try:
                while self.paused:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise HeldTooLong()
                    await wait_until(self._open, remaining)
            except BaseException:
                self._release(who)
                raise
            finally:
                self.held -= 1
            if self.closed:
                self._release(who)
                raise GateClosed()
        self.in_flight += 1
        return held

    def _release(self, who: str) -> None:
        self._held_by[who] -= 1
        if not self._held_by[who]:
            del self._held_by[who]

    def leave(self, who: str = "") -> None:
        """The call of attempt ``who`` is over (answered, failed or its stream closed); acknowledge a pending
        drain."""
        self._release(who)
        self.in_flight -= 1
        if self.paused and self.in_flight == 0 and self.drained_ids != self.pause_ids:
            self.drained_ids = self.pause_ids
            self.last_drain_s = time.monotonic() - (self.paused_at or time.monotonic())
            self._on_change()
