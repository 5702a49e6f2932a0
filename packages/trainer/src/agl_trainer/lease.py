"""One trainer per prefix: the lease a training run holds on its Redis prefix while it lives.

A prefix has one policy, one control channel and one consumer group per run: a second trainer on it (a second
``train --resume`` of a live run, another run with ``gateway_url``) would take over the first one's pending
completions, train its groups again and publish its policy over the first one's. The lease
(:meth:`agl_common.store.Store.hold_trainer`, an owner token with a TTL of
:data:`~agl_common.store.TRAINER_LEASE_S`) is taken before the run starts anything another trainer uses (the
engine's weights, the gateway, the controller, the run's ``config.json``) and renewed from a thread of its own,
so that it lives through the minutes of a vLLM start or an update, whatever the run's event loop does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid

from agl_common.store import TRAINER_LEASE_S, Store

log = logging.getLogger("agl.trainer")


class TrainerLive(RuntimeError):
    """Another trainer holds the prefix: at start, or it took the prefix while this one's renewals were late."""


class TrainerLease:
    """This trainer's lease of ``prefix`` in the Redis at ``redis_url``, for run ``run`` (its id, shown to a trainer
    that is refused). :meth:`take` it, :meth:`confirm` it before acting on the prefix, :meth:`let_go` at the end
    (also a context manager). Renewed every :attr:`renew_s` seconds in a daemon thread with its own event loop."""

    renew_s = TRAINER_LEASE_S / 6

    def __init__(self, redis_url: str, prefix: str, run: str):
        self.redis_url, self.prefix, self.run, self.owner = redis_url, prefix, run, uuid.uuid4().hex
        #: the run that took the prefix while this one's renewals were late (then this trainer must stop)
        self.lost: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: Store | None = None
        self._renewing: asyncio.Future | None = None

    def _call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def take(self) -> None:
        """Take the prefix and start renewing it. Raises :class:`TrainerLive` if another trainer holds it (nothing
        is left running then), or what Redis raises."""
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="agl-trainer-lease", daemon=True).start()
        try:
            self._store = Store(self.redis_url, self.prefix, max_connections=2)
            holder = self._call(self._store.hold_trainer(self.owner, self.run))
        except BaseException:
            self._stop_loop()
            raise
        if holder is not None:
            self._stop_loop()
            raise TrainerLive(f"prefix {self.prefix!r} is being trained by run {holder} (another trainer): stop it "
                              "first, or give this run another prefix")
        self._renewing = asyncio.run_coroutine_threadsafe(self._renew(), self._loop)

    async def _renew(self) -> None:
        while self.lost is None:
            await asyncio.sleep(self.renew_s)
            try:
                self.lost = await self._store.hold_trainer(self.owner, self.run)
            except Exception as exc:  # noqa: BLE001 - Redis down: the run's own calls fail and say so; keep trying
                log.warning("trainer lease not renewed: %s", exc)

    async def confirm(self) -> None:
        """Renew the lease now (one Redis round trip, from the caller's loop through the lease's own). Raises
        :class:`TrainerLive` if another trainer holds the prefix: this one must not pause, publish or commit."""
        if self.lost is None and self._loop is not None:
            self.lost = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self._store.hold_trainer(self.owner, self.run), self._loop))
        if self.lost is not None:
            raise TrainerLive(f"run {self.lost} took prefix {self.prefix!r} while this trainer's lease lapsed (its "
                              "renewals came late): stopping; resume this run once the other has stopped")

    def let_go(self) -> None:
        """Stop renewing and end the lease if it is still this trainer's (another's is left alone). Never raises."""
        if self._loop is None:
            return
        if self._renewing is not None:
            self._renewing.cancel()
        try:
            self._call(self._store.let_go_trainer(self.owner), timeout_s=10.0)
        except Exception as exc:  # noqa: BLE001 - it lapses by itself within TRAINER_LEASE_S
            log.warning("trainer lease not ended (it lapses in %.0f s): %s", TRAINER_LEASE_S, exc)
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._store is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._store.close(), loop).result(10.0)
            except Exception:  # noqa: BLE001 - closing connections of a lease that is over
                pass
        loop.call_soon_threadsafe(loop.stop)

    def __enter__(self) -> TrainerLease:
        self.take()
        return self

    def __exit__(self, *exc) -> None:
        self.let_go()
