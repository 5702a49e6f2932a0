"""What every runner shares: claims, the controller lease, crash recovery, and ending an attempt.

Ownership. A runner takes a queued rollout with :meth:`Store.claim_queued` (BLMOVE from ``P queue`` into
its own ``P processing:{controller_id}`` list) and keeps it there until the attempt has ended and its
outcome is written. While it lives it renews ``P controller:{controller_id}`` (TTL ``lease_ttl_s``). So a
crash loses nothing: the ids stay in the dead controller's processing list, and once its lease has
expired any live controller adopts them (:meth:`Runner.reconcile_claims`, run at start-up and every
``lease_ttl_s`` seconds). A controller restarted with the same ``controller_id`` adopts its own previous
list at start-up without waiting for the lease.

Adopting an id: missing or finished rollout → dropped; ``queuing`` → put back at the queue's head;
``running`` → :meth:`Runner.adopt_running` (the local runner cannot reattach to processes of another
controller: the attempt ends with ``controller_lost``; the Kubernetes runner keeps watching its Job).

Ending an attempt (:meth:`Runner.finish_attempt`) is fenced: it writes only if the rollout is still
``running`` on that attempt, so a controller that lost its lease cannot overwrite the outcome of a newer
attempt. A failure whose reason matches ``retry_on`` starts a new attempt while fewer than
``max_attempts`` have run (the old attempt's late calls and rewards then get 409 from the gateway);
other failures, and the last attempt's, leave the rollout ``failed`` with its reason. An infrastructure
failure is never turned into a reward of 0.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from agl_common.aio import wait_until
from agl_common.schemas import CallRecord, Rollout, RolloutStatus, answer_text, check_rollout_id
from agl_common.store import CallsRecordedSince, RolloutNotFound, Store, UnreadableRecord

from .reward import RewardFunctionError, RewardPool, load_reward_fn  # noqa: F401 (re-exported)

log = logging.getLogger("agl.controller")

#: Times a rollout may be handed back by stopping controllers beyond its ``max_attempts`` (see ``hand_back``).
HAND_BACKS_MAX = 8


#: Failures retried by default (when ``max_attempts > 1``): infrastructure, not the agent's own result.
#: An entry matches the reason itself or any ``entry:...`` (``signal`` matches ``signal:15``).
DEFAULT_RETRY_ON = ("timeout", "signal", "oom_killed", "spawn_error", "controller_lost", "evicted",
                    "deadline_exceeded", "job_lost")


#: Every failure reason a runner writes (``exit_code``, ``signal`` and ``job_failed`` carry a detail:
#: ``exit_code:3``, ``job_failed:BackoffLimitExceeded``).
FAILURE_REASONS = ("timeout", "exit_code", "signal", "oom_killed", "spawn_error", "template_error", "image_pull",
                   "controller_lost", "evicted", "deadline_exceeded", "job_failed", "job_lost", "no_model_calls",
                   "no_reward", "reward_error", "controller_error", "log_limit", "calls_after_exit")


#: Reasons whose failures carry a number (``exit_code:75``, ``signal:15``), and those with another detail.
NUMBERED_REASONS = ("exit_code", "signal")
DETAILED_REASONS = ("job_failed",)


def _can_match(entry: str) -> bool:
    """Whether a runner can write a failure ``entry`` matches (:func:`matches`): a detail is a number as written by
    ``str(int)`` for ``exit_code`` (non-zero, 32-bit: Kubernetes' ``exitCode``; a local run's is 1–255) and
    ``signal`` (1 to ``NSIG - 1``, not SIGKILL, which is written ``oom_killed``), any non-empty text for
    :data:`DETAILED_REASONS`, none for the others."""
    reason, colon, detail = entry.partition(":")
    if not colon:
        return True
    if reason == "exit_code":
        return bool(re.fullmatch(r"-?[1-9][0-9]{0,9}", detail)) and -2**31 <= int(detail) < 2**31
    if reason == "signal":
        return bool(re.fullmatch(r"[1-9][0-9]?", detail)) and int(detail) < signal.NSIG \
            and int(detail) != signal.SIGKILL
    return reason in DETAILED_REASONS and detail != ""


def check_retry_on(entries: Iterable[str]) -> tuple[str, ...]:
    """``entries`` as a tuple, each checked to name a reason of :data:`FAILURE_REASONS` (alone or with a
    detail, ``exit_code:75``). Raises ``ValueError`` naming the unknown entries: a misspelt reason would
    otherwise never match, and the failures it was meant to retry would end their rollouts."""
    entries = tuple(entries)
    unknown = [e for e in entries if e.partition(":")[0] not in FAILURE_REASONS]
    if unknown:
        raise ValueError(f"unknown failure reason(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(FAILURE_REASONS)}")
    never = [e for e in entries if not _can_match(e)]
    if never:
        raise ValueError(f"failure reason(s) {', '.join(map(repr, never))} can never match: exit_code takes a "
                         f"non-zero exit status (exit_code:75; a 32-bit one on Kubernetes), signal a signal number "
                         f"other than 9 (signal:15; SIGKILL is oom_killed), {', '.join(DETAILED_REASONS)} a "
                         "detail, the others none")
    return entries


class ControllerIdLive(RuntimeError):
    """Another controller runs under this controller id (its lease is being renewed)."""


class Stale(Exception):
    """The rollout moved on (another attempt, or finished): this runner's result is dropped."""


class _RewardArrived(Exception):
    """A reward was posted between the outcome's read and its write: the attempt has one after all."""


def final_output(calls: list[CallRecord]) -> str:
    """Text of the last successful answer of an attempt, whatever its route (:func:`agl_common.schemas.answer_text`)."""
    for call in reversed(calls):
        if call.status == "ok" and call.response:
            return answer_text(call)
    return ""


def matches(failure: str, patterns: Iterable[str]) -> bool:
    """True if ``failure`` equals a pattern or starts with ``pattern + ':'``."""
    return any(failure == p or failure.startswith(p + ":") for p in patterns)


#: The suffix of the list a restarted controller rotates its own leftover claims through (``{id}.restart``).
RESTART_SUFFIX = ".restart"


def check_controller_id(controller_id: str) -> str:
    """Return ``controller_id`` if it can name a controller: a rollout id's characters and length
    (:func:`agl_common.schemas.check_rollout_id`: it is part of Redis keys and log lines), not ending in
    :data:`RESTART_SUFFIX` (controller ``x.restart`` and the restart of ``x`` would share one list of claims, and
    ``x`` would adopt the other's running rollouts). Raises ``ValueError``."""
    check_rollout_id(controller_id, "controller id")
    if controller_id.endswith(RESTART_SUFFIX):
        raise ValueError(f"controller id {controller_id!r:.60} must not end in {RESTART_SUFFIX!r} (the list a "
                         "restarted controller of the id before it uses)")
    return controller_id


class Runner:
    """Base of the local and Kubernetes runners.

    Args:
        store: the experiment's store.
        reward_fn: ``module:function`` used when a successful run reported no reward itself.
        reward_fn_always: the reward function scores every run that ended well, replacing a reward the harness
            posted (kept as an event ``reward_replaced``): a judge the harness (or a tool its model runs with the
            harness's environment and scoped key) cannot overrule.
        max_attempts: attempts per rollout, the first included (1: never retry).
        retry_on: failure reasons that start a new attempt (see :func:`matches`).
        controller_id: this controller's name in Redis; default ``{hostname}-{random}``. Reuse it on a
            restart to adopt the previous life's claims at once.
        lease_ttl_s: seconds after the last renewal at which this controller counts as dead; the lease
            is renewed every ``lease_ttl_s / 3`` s and dead controllers are looked for every ``lease_ttl_s``.
    """

    def __init__(self, store: Store, reward_fn: str | None = None, max_attempts: int = 1,
                 retry_on: Iterable[str] = DEFAULT_RETRY_ON, controller_id: str | None = None,
                 lease_ttl_s: float = 15.0, reward_timeout_s: float = 300.0, reward_fn_always: bool = False):
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.store = store
        self.reward_fn = RewardPool(reward_fn) if reward_fn else None
        self.reward_fn_always = reward_fn_always
        self.max_attempts = max_attempts
        self.retry_on = check_retry_on(retry_on)
        self.controller_id = check_controller_id(controller_id) if controller_id is not None \
            else f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.lease_ttl_s = lease_ttl_s
        self.reward_timeout_s = reward_timeout_s
        #: rollout id → the attempt this controller runs now (its claim in our processing list is that attempt's)
        self._attempts: dict[str, str] = {}
        self._lease_owner = uuid.uuid4().hex  # this process's token in its lease (Store.renew_lease)
        #: set when another controller took this id while our lease lapsed: we claim nothing more and stop
        self.lease_lost = asyncio.Event()

    def close(self) -> None:
        """Stop the reward function's idle worker processes (:class:`agl_controller.reward.RewardPool`)."""
        if self.reward_fn is not None:
            self.reward_fn.close()

    # ---------------------------------------------------------------- lease and recovery
    async def take_lease(self, stop: asyncio.Event | None = None) -> bool:
        """Take this controller id's lease and adopt leftover claims (the start of ``run_forever``). Returns
        whether it was taken: ``False`` if ``stop`` was set while waiting (a SIGTERM then ends the controller).

        A lease of this id left by an earlier run (a crash) is waited for until it expires (its own remaining
        life, whatever this controller's ``lease_ttl_s``; said in the log, and ``stop`` ends the wait); one that
        is renewed meanwhile belongs to a live controller running under the same id, whose work adopting would
        kill: raises :class:`ControllerIdLive`.
        """
        stop = stop or asyncio.Event()
        lease = await self.store.lease_of(self.controller_id)
        deadline = time.monotonic() + (lease[1] if lease else 0) + 0.5
        if lease is not None:
            log.warning("controller id %r holds a lease left by an earlier run (a crash?): waiting up to %.0f s for "
                        "it to expire", self.controller_id, lease[1])
        while lease is not None and time.monotonic() < deadline:
            if await wait_until(stop, min(0.5, max(0.05, lease[1] / 6))):
                return False
            now = await self.store.lease_of(self.controller_id)
            if now is not None and now[0] != lease[0]:
                raise ControllerIdLive(f"controller id {self.controller_id!r} is live: another controller renews "
                                       "its lease; give this one another --controller-id (or stop the other)")
            lease = now
        if not await self.store.renew_lease(self.controller_id, self.lease_ttl_s, owner=self._lease_owner):
            raise ControllerIdLive(f"controller id {self.controller_id!r} is live: another controller took its lease "
                                   "as this one started; give this one another --controller-id (or stop the other)")
        await self.reconcile_claims(startup=True)
        return True

    async def still_mine(self) -> bool:
        """Renew this controller's lease with its owner token; ``False`` (and :attr:`lease_lost` set) if another
        controller holds this id now: this one was frozen past its lease and another started under the id, adopting
        its claims. It must then claim nothing more (every claim would go to that one's processing list) and stop;
        its runs end as stale. Raises what Redis raises."""
        if self.lease_lost.is_set():
            return False
        if await self.store.renew_lease(self.controller_id, self.lease_ttl_s, owner=self._lease_owner):
            return True
        log.error("controller id %r was taken by another controller while this one's lease lapsed: stopping",
                  self.controller_id)
        self.lease_lost.set()
        return False

    async def lease_loop(self, stop: asyncio.Event, run_stop: asyncio.Event | None = None) -> None:
        """Renew the lease every ``lease_ttl_s / 3`` s and reconcile every ``lease_ttl_s`` s, until ``stop``. If
        another controller took this id meanwhile (this one was frozen past its lease), sets :attr:`lease_lost` and
        ``run_stop`` (the controller stops; its runs are stale) and returns."""
        last_reconcile = time.monotonic()
        while not stop.is_set():
            try:
                if not await self.still_mine():
                    if run_stop is not None:
                        run_stop.set()
                    return
                if time.monotonic() - last_reconcile >= self.lease_ttl_s:
                    last_reconcile = time.monotonic()
                    await self.reconcile_claims()
            except Exception as exc:  # Redis down: keep trying
                log.warning("lease/reconcile failed: %s", exc)
            await wait_until(stop, self.lease_ttl_s / 3)

    async def reconcile_claims(self, startup: bool = False) -> int:
        """Adopt the claims of dead controllers (and, with ``startup``, this id's own leftover claims).

        Returns the number of ids adopted.
        """
        owners = await self.store.claim_owners()
        adopted = 0
        for cid, alive in owners.items():
            if cid == self.controller_id:
                if not startup:
                    continue
            elif alive:
                continue
            source = cid
            if cid == self.controller_id:  # rotate our own leftovers through a temporary list
                source = cid + RESTART_SUFFIX
                while await self.store.adopt_claim(cid, source):
                    pass
            while (rid := await self.store.adopt_claim(source, self.controller_id)) is not None:
                adopted += 1
                try:
                    await self.adopt(rid)
                except Exception:
                    log.exception("adopting rollout %s failed; it stays claimed by %s", rid, self.controller_id)
        if adopted:
            log.info("adopted %d claim(s) of dead controllers", adopted)
        return adopted

    async def adopt(self, rollout_id: str) -> None:
        """Decide what to do with a claim adopted from a dead controller (now in our processing list)."""
        try:
            rollout = await self.store.get_rollout(rollout_id)
        except (RolloutNotFound, UnreadableRecord) as exc:  # (another version's record: left as it is, unclaimed)
            if isinstance(exc, UnreadableRecord):
                log.warning("%s: its claim is released, the rollout left as it is", exc)
            await self.store.release_claim(self.controller_id, rollout_id)
            return
        if rollout.status == RolloutStatus.queuing:
            await self.store.requeue_claim(self.controller_id, rollout_id)
        elif rollout.status == RolloutStatus.running:
            await self.adopt_running(rollout)
        else:  # finished: its owner may have died between the status and the announcement (harmless twice)
            await self.store.announce_completed(rollout)
            await self.store.release_claim(self.controller_id, rollout_id)

    async def adopt_running(self, rollout: Rollout) -> None:
        """A running rollout of a dead controller: by default its attempt ends with ``controller_lost``."""
        log.warning("rollout %s attempt %s was running on a lost controller", rollout.rollout_id, rollout.attempt_id)
        await self.finish_attempt(rollout.rollout_id, rollout.attempt_id, "controller_lost", check_calls=False)

    # ---------------------------------------------------------------- attempts
    async def start_attempt(self, rollout_id: str) -> Rollout | None:
        """Move a claimed ``queuing`` rollout to ``running``; ``None`` (claim released) if it is not queuing."""

        def change(r: Rollout) -> None:
            if r.status != RolloutStatus.queuing:
                raise Stale(r.status.value)
            r.status = RolloutStatus.running
            r.started_at = time.time()
            r.failure = None

        try:
            rollout = await self.store.update_rollout(rollout_id, change)
        except (Stale, RolloutNotFound):
            log.info("claimed rollout %s is missing or not queuing; skipped", rollout_id)
            await self.store.release_claim(self.controller_id, rollout_id)
            return None
        except UnreadableRecord as exc:  # (another version's record, or a hand's: round 23, a traceback per reconcile)
            log.warning("%s: skipped, its claim released", exc)
            await self.store.release_claim(self.controller_id, rollout_id)
            return None
        self._attempts[rollout_id] = rollout.attempt_id
        return rollout

    async def _let_go(self, rollout_id: str, attempt_id: str, requeue: bool = False) -> None:
        """Release (or with ``requeue``, queue again) the claim of ``rollout_id`` once attempt ``attempt_id``'s outcome
        is written or dropped as stale, unless this controller runs a newer attempt of it now: the one entry of the
        rollout in our processing list is then that attempt's (a controller frozen past its lease whose old attempt
        was ended ``controller_lost`` elsewhere, then claimed the retry), and releasing it would leave the running
        attempt claimed by nobody: never adopted, ``running`` for ever."""
        if self._attempts.get(rollout_id, attempt_id) != attempt_id:
            log.info("rollout %s attempt %s: its claim is attempt %s's now; kept", rollout_id, attempt_id,
                     self._attempts[rollout_id])
            return
        self._attempts.pop(rollout_id, None)
        if requeue:
            await self.store.requeue_claim(self.controller_id, rollout_id)
        else:
            await self.store.release_claim(self.controller_id, rollout_id)

    async def finish_attempt(self, rollout_id: str, attempt_id: str, failure: str | None,
                             check_calls: bool = True) -> Rollout | None:
        """Write the outcome of one attempt, retry it if allowed, and release its claim.

        ``failure``: ``None`` when the run itself ended well; then no model call → ``no_model_calls``,
        no reward (reported or from ``reward_fn``) → ``no_reward``, a raising ``reward_fn`` →
        ``reward_error``; anything else failing while the outcome is written → ``controller_error`` (raised if
        that cannot be written either). Returns the rollout as written, or ``None`` if the attempt was stale.
        """
        try:
            return await self._finish(rollout_id, attempt_id, failure, check_calls)
        except (Stale, RolloutNotFound, ValueError) as exc:
            log.info("outcome of rollout %s attempt %s dropped: %s", rollout_id, attempt_id, exc or "stale")
            await self._let_go(rollout_id, attempt_id)
            return None
        except Exception:  # noqa: BLE001 - a bug or Redis failing mid-outcome: never leave the attempt running
            log.exception("outcome of rollout %s attempt %s failed; ending it as controller_error", rollout_id,
                          attempt_id)
            if failure == "controller_error":
                raise
            return await self.finish_attempt(rollout_id, attempt_id, "controller_error", check_calls=False)

    async def hand_back(self, rollout_id: str, attempt_id: str, reason: str) -> Rollout | None:
        """An attempt interrupted by this controller's own shutdown: start a new attempt and queue it (whatever
        ``max_attempts``), so the next controller runs it. Returns the rollout, or ``None`` if stale.

        A rollout that has had ``max_attempts + HAND_BACKS_MAX`` attempts is not handed back again: it ends
        ``failed`` with failure ``interrupted`` (a run that stops its own controller would otherwise run again
        at every restart, for ever)."""
        if int(attempt_id) + 1 >= self.max_attempts + HAND_BACKS_MAX:
            log.warning("rollout %s attempt %s interrupted (%s) after %d attempts: ended, not handed back",
                        rollout_id, attempt_id, reason, int(attempt_id) + 1)
            return await self.finish_attempt(rollout_id, attempt_id, "interrupted", check_calls=False)
        try:
            rollout = await self.store.retry_attempt(rollout_id, attempt_id, running_only=True)
        except (RolloutNotFound, ValueError) as exc:
            log.info("rollout %s attempt %s not handed back: %s", rollout_id, attempt_id, exc)
            await self._let_go(rollout_id, attempt_id)
            return None
        await self.store.add_event(rollout_id, attempt_id, "attempt_interrupted", {"failure": reason})
        await self._let_go(rollout_id, attempt_id, requeue=True)
        log.info("rollout %s attempt %s interrupted by shutdown (%s): queued as attempt %s", rollout_id,
                 attempt_id, reason, rollout.attempt_id)
        return rollout

    async def _retry(self, rollout_id: str, attempt_id: str, failure: str,
                     check: Callable[[Rollout], None] | None = None) -> Rollout:
        """Retry a running attempt that failed with ``failure`` as the next attempt (queued again); ``check`` is
        :meth:`Store.retry_attempt`'s (what it raises aborts the retry and reaches the caller)."""
        rollout = await self.store.retry_attempt(rollout_id, attempt_id, running_only=True, check=check)
        await self.store.add_event(rollout_id, attempt_id, "attempt_failed", {"failure": failure})
        await self._let_go(rollout_id, attempt_id, requeue=True)
        log.info("rollout %s attempt %s failed (%s): retried as attempt %s", rollout_id, attempt_id, failure,
                 rollout.attempt_id)
        return rollout

    async def _finish(self, rollout_id: str, attempt_id: str, failure: str | None, check_calls: bool) -> Rollout:
        def current(r: Rollout) -> None:
            if r.attempt_id != attempt_id or r.status != RolloutStatus.running:
                raise Stale(f"rollout is {r.status.value} on attempt {r.attempt_id}")

        calls = await self.store.read_calls(rollout_id, attempt_id) if check_calls else []
        if failure is None and not any(c.status == "ok" for c in calls):  # (error records train nothing)
            failure = "no_model_calls"
        rollout = await self.store.get_rollout(rollout_id)
        current(rollout)
        judged: float | None = None
        if failure is None and self.reward_fn is not None and (rollout.reward is None or self.reward_fn_always):
            try:
                # in a worker process: a slow judge, a test run or a GIL-holding regex must not freeze the event
                # loop (lease renewals, other runs' outcomes): a frozen loop let the lease expire and another
                # controller end them (agl_controller.reward)
                judged = await self.reward_fn.score(rollout.input, final_output(calls), self.reward_timeout_s)
            except (RewardFunctionError, TimeoutError) as exc:  # TimeoutError: past reward_timeout_s
                log.warning("reward function failed on %s: %r", rollout_id, exc)
                failure = "reward_error"
        if failure is None and rollout.reward is None and judged is None:
            failure = "no_reward"

        def reward_arrived(r: Rollout) -> None:
            if failure == "no_reward" and r.reward is not None and r.attempt_id == attempt_id:
                raise _RewardArrived  # posted since the read above: decided again, on the rollout as written

        if failure and matches(failure, self.retry_on) and int(attempt_id) + 1 < self.max_attempts:
            try:
                return await self._retry(rollout_id, attempt_id, failure, check=reward_arrived)
            except _RewardArrived:  # (the reward the run's processes posted stands, as its 200 told them)
                failure = None

        replaced: dict[str, Any] = {}

        def end(r: Rollout) -> None:
            current(r)
            reward_arrived(r)
            replaced.clear()
            if judged is not None and not failure:  # in the step that ends the attempt: a process the run left
                # behind (setsid) can no longer post over the judge between the two (its key works until then)
                if r.reward is not None:
                    replaced.update(posted=r.reward, message=r.reward_message, reward_fn=judged)
                r.reward, r.reward_message = judged, None  # a posted message goes with the posted value
            r.status = RolloutStatus.failed if failure else RolloutStatus.succeeded
            r.ended_at = time.time()
            r.failure = failure

        seen = len(calls)
        while True:  # a success ends only on the calls its judge (and the check above) saw
            try:
                rollout = await self.store.update_rollout(
                    rollout_id, end, calls_seen=(attempt_id, seen) if check_calls and not failure else None)
                break
            except _RewardArrived:  # (the reward the run's processes posted stands, as its 200 told them)
                failure = None
                continue
            except CallsRecordedSince:
                later = (await self.store.read_calls(rollout_id, attempt_id))[seen:]
                if not any(c.status == "ok" for c in later):  # an abandoned call's error record: trains nothing
                    seen += len(later)
                    continue
            log.warning("rollout %s attempt %s: model calls were recorded after its harness exited", rollout_id,
                        attempt_id)
            failure = "calls_after_exit"  # (something the run left behind, setsid, kept calling with its key)
            if matches(failure, self.retry_on) and int(attempt_id) + 1 < self.max_attempts:
                return await self._retry(rollout_id, attempt_id, failure)
        if replaced:
            await self.store.add_event(rollout_id, attempt_id, "reward_replaced", replaced)
        await self._let_go(rollout_id, attempt_id)
        return rollout
