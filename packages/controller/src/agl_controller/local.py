"""The local runner: one process group per rollout attempt, with a concurrency limit and a timeout.

Outcome → rollout state:

=====================================  ==========  =======================
what happened                          status      failure
=====================================  ==========  =======================
exit 0, ≥1 model call, reward known    succeeded   ``null``
exit 0, no model call                  failed      ``no_model_calls``
exit 0, no reward reported or computed failed      ``no_reward``
exit N ≠ 0                             failed      ``exit_code:N``
killed by signal S (not by us)         failed      ``signal:S`` (``oom_killed`` for SIGKILL)
ran past the timeout                   failed      ``timeout`` (whole process group killed)
could not start                        failed      ``spawn_error``
its controller died while it ran       failed      ``controller_lost``
=====================================  ==========  =======================

A failure listed in ``retry_on`` starts a new attempt instead, while fewer than ``max_attempts`` have run
(see :mod:`agl_controller.base`, which also describes claims, leases and crash recovery).
An infrastructure failure is never turned into a reward of 0: the trainer decides what a failed rollout
means for its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import shlex
import signal
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from agl_common.aio import wait_until, within
from agl_common.auth import scoped_key
from agl_common.schemas import Rollout, RolloutStatus
from agl_common.settings import check_env_names, redacted_text
from agl_common.store import Store

from .base import DEFAULT_RETRY_ON, Runner, final_output, load_reward_fn  # noqa: F401 (re-exported)
from .spawn import ANONYMOUS_HOME, HarnessUser, LaunchError, Launcher, RunLog, UserLocks, check_user_runs, create_log, \
    end_user_processes, harness_users, no_new_privileges, reap_zombies_of, user_processes

log = logging.getLogger("agl.controller")


#: What a harness still gets of the controller's own environment unless told more (``pass_env``): what any
#: process needs to run, nothing that grants access. The controller's ``AGL_KEY`` (the admin key),
#: ``AGL_REDIS_URL`` (with its password) and whatever else it was started with stay out.
BASE_PASS_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "TMPDIR",
                 "PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR", "HF_HOME", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE")


#: Never passed to a harness, whatever ``pass_env`` names (``AGL_*`` or ``*`` too): the admin key, the Redis URL and
#: the engine's key.
NEVER_PASSED = frozenset({"AGL_KEY", "AGL_REDIS_URL", "AGL_UPSTREAM_KEY", "VLLM_API_KEY"})
#: Default most bytes of one attempt's log (stdout and stderr): past it the run is stopped, failure ``log_limit``.
DEFAULT_MAX_LOG_BYTES = 64 * 2**20
#: Seconds between two checks of a running attempt's log size.
LOG_CHECK_S = 0.25
#: Seconds a run past its ``timeout_s`` is given for its exit to be seen before it counts as a ``timeout`` (a run
#: that exited in time while this controller was stopped or starved was recorded ``timeout`` and retried).
EXIT_SEEN_S = 1.0


def passed_env(environ: dict[str, str], names: Iterable[str]) -> dict[str, str]:
    """The entries of ``environ`` whose names match one of ``names`` (exact names or ``fnmatch`` globs: ``LC_*``),
    never those in :data:`NEVER_PASSED`.

    Raises ``ValueError`` for an empty name or one with ``=``.
    """
    patterns = check_env_names(list(names))
    return {k: v for k, v in environ.items()
            if k not in NEVER_PASSED and any(fnmatch.fnmatchcase(k, pat) for pat in patterns)}


def harness_env(gateway_url: str, rollout: Rollout, model: str, key: str | None) -> dict[str, str]:
    """The environment of CONTRACT §2 for one run, plus the rollout's ``env_map`` (VAR → input field)."""
    gw = gateway_url.rstrip("/")
    base = f"{gw}/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt_id}"
    api_key = scoped_key(key, rollout.rollout_id, rollout.attempt_id) if key else "agl-no-auth"
    env = {
        "OPENAI_BASE_URL": base + "/v1",
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": api_key,
        "AGL_ROLLOUT_ID": rollout.rollout_id,
        "AGL_ATTEMPT_ID": rollout.attempt_id,
        "AGL_REWARD_URL": base + "/reward",
        "AGL_INPUT": json.dumps(rollout.input),
        "AGL_MODEL": model,
    }
    mapped = {}
    for var, field in rollout.env_map.items():
        value = rollout.input.get(field)
        if value is not None:
            mapped[var] = value if isinstance(value, str) else json.dumps(value)
    return {**mapped, **env}  # the contract's variables are never overwritten by an env_map


#: Exit statuses a shell (``bash -c``, ``sh script.sh``) reports for a child killed by signal N: 128 + N.
_SHELL_SIGNALLED = range(128 + 1, 128 + signal.NSIG)


def _outcome(returncode: int) -> str | None:
    """The failure of a run that exited with ``returncode`` (``None``: success). Killed by a signal directly
    (negative) or under a shell (128 + N: a harness started as ``bash run.sh`` was ``exit_code:137``, neither
    named nor retried as the same kill of a plain ``python`` harness): ``oom_killed`` for SIGKILL (what the
    kernel's OOM killer sends), else ``signal:N``."""
    if returncode == 0:
        return None
    if returncode < 0 or returncode in _SHELL_SIGNALLED:
        sig = -returncode if returncode < 0 else returncode - 128
        return "oom_killed" if sig == signal.SIGKILL else f"signal:{sig}"
    return f"exit_code:{returncode}"


#: Longest log file name kept as ``{rollout}.{attempt}.log`` (a file name holds at most 255 bytes; ids hold 256).
LOG_NAME_MAX = 200


def log_name(rollout_id: str, attempt_id: str) -> str:
    """The file name of an attempt's log: ``{rollout}.{attempt}.log``, or for an id too long for a file name its
    first 150 characters, ``+`` and 16 hex digits of its SHA-256 (``{head}+{hash}.{attempt}.log``: no rollout id
    holds ``+``, so no other id's plain name is the same file)."""
    name = f"{rollout_id}.{attempt_id}.log"
    if len(name) <= LOG_NAME_MAX:
        return name
    digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:16]
    return f"{rollout_id[:150]}+{digest}.{attempt_id}.log"


class LocalRunner(Runner):
    """Runs ``command`` once per queued rollout attempt as a local process group.

    Args:
        store: the experiment's store.
        gateway_url: base URL of the gateway, e.g. ``http://127.0.0.1:8080``.
        command: the harness command line (a string is split with ``shlex``).
        model: the model name handed to the harness as ``AGL_MODEL``.
        concurrency: most runs at once.
        timeout_s: wall-clock limit of one run, seconds; past it the process group gets SIGKILL.
        key: the gateway admin key, to derive rollout-scoped keys (None: auth off).
        reward_fn: ``module:function`` used when the run reported no reward itself.
        log_dir: stdout and stderr of each attempt go to ``{log_dir}/{rollout}.{attempt}.log`` (:func:`log_name`).
        cwd: where every run starts (default: this process's working directory when the runner is made; both
            are resolved then, whatever a reward function does to the working directory later).
        extra_env: variables set for every run (``NAME → value``), under the contract's own.
        pass_env: names (or globs) of the controller's variables a run gets besides :data:`BASE_PASS_ENV`;
            nothing else of the controller's environment reaches a harness.
        max_attempts, retry_on, controller_id, lease_ttl_s, reward_fn_always: see
            :class:`agl_controller.base.Runner`.
        preload: Python modules to import once and fork each run from (:mod:`agl_controller.spawn`);
            empty: exec the command for each run.
        max_log_bytes: most bytes an attempt's log may hold (stdout and stderr together); a run whose log grows
            past it (a harness printing in a loop would fill the disk over a long run) is stopped (its process
            group gets SIGKILL) and fails ``log_limit`` (also one that exits before the check, every
            :data:`LOG_CHECK_S` seconds, saw it); its log holds the first ``max_log_bytes`` (the copy of the run's
            pipe, :class:`~.spawn.RunLog`, keeps no more) and ends with a line saying so.
        run_as: Unix users (comma-separated names, uids and ranges of uids without users ``FIRST-LAST``,
            :func:`~.spawn.harness_users`), at least ``concurrency`` of them: each run becomes one that no other
            running run is (``HOME``, ``USER`` and ``LOGNAME`` its own), and every process of that user is killed
            when the run ends, before the user is given to another run; a run then reads neither this controller's
            memory, nor files of this user's, nor another run's environment. Needs root (docs/controller.md).

    Raises :class:`agl_controller.spawn.LaunchError` if ``preload`` is set for a command it cannot fork, or
    ``run_as`` names no user, one this process cannot become or one that cannot reach the command, or fewer users
    than ``concurrency``.
    """

    def __init__(self, store: Store, gateway_url: str, command: list[str] | str, model: str,
                 concurrency: int = 4, timeout_s: float = 300.0, key: str | None = None,
                 reward_fn: str | None = None, log_dir: Path | str = "runs/logs", cwd: str | None = None,
                 extra_env: dict[str, str] | None = None, max_attempts: int = 1,
                 retry_on: Iterable[str] = DEFAULT_RETRY_ON, controller_id: str | None = None,
                 lease_ttl_s: float = 15.0, preload: list[str] | None = None, pass_env: Iterable[str] = (),
                 reward_fn_always: bool = False, max_log_bytes: int = DEFAULT_MAX_LOG_BYTES,
                 run_as: str | None = None):
        super().__init__(store, reward_fn=reward_fn, max_attempts=max_attempts, retry_on=retry_on,
                         controller_id=controller_id, lease_ttl_s=lease_ttl_s, reward_fn_always=reward_fn_always,
                         reward_timeout_s=timeout_s)  # a reward function gets a run's time at most
        self.gateway_url = gateway_url
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.model = model
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        if not (isinstance(max_log_bytes, int) and max_log_bytes > 0):
            raise ValueError(f"max_log_bytes must be a positive number of bytes, got {max_log_bytes!r}")
        self.max_log_bytes = max_log_bytes
        self.key = key
        # resolved once: nothing later (a reward function that changed the working directory, when it ran in a
        # thread of this process) moves where later runs start or log
        self.log_dir = Path(log_dir).absolute()
        self.cwd = str(Path(cwd or os.getcwd()).absolute())
        self.extra_env = extra_env or {}
        self.pass_env = (*BASE_PASS_ENV, *pass_env)
        passed_env({}, self.pass_env)  # ValueError for a bad name, before anything runs
        self.users = harness_users(run_as, concurrency) if run_as is not None else []
        for user in self.users:
            check_user_runs(user, self.command, self.cwd)
        if self.users:
            self._check_log_dir()
            # every exec'd run inherits it (a forked one sets it itself): no setuid program left by another pool
            # user's run makes a run that user (spawn.no_new_privileges); this controller needs no such gain
            no_new_privileges()
        self._free_users: asyncio.Queue[HarnessUser] = asyncio.Queue()
        for user in self.users:
            self._free_users.put_nowait(user)
        # a forked run's /proc/self/environ is the forkserver's: start it with the allow-listed variables only (with
        # run-as users, a neutral HOME and no USER: a run's own are in its os.environ)
        forkserver_env = passed_env(dict(os.environ), self.pass_env)
        if self.users:
            forkserver_env = {k: v for k, v in forkserver_env.items() if k not in ("USER", "LOGNAME")}
            forkserver_env["HOME"] = ANONYMOUS_HOME
        self.launcher = Launcher(self.command, preload, env=forkserver_env)
        self._sem = asyncio.Semaphore(concurrency)
        # (rollout id, attempt id) → a process with ``pid`` (its process group): an attempt's own, never its retry's
        self._procs: dict[tuple[str, str], object] = {}
        self._interrupted: set[tuple[str, str]] = set()  # attempts whose run this controller's shutdown signalled
        self._tasks: set[asyncio.Task] = set()
        #: rollout id → how many of this controller's tasks hold its claim (claimed, running, writing its outcome)
        self._in_hand: Counter[str] = Counter()
        self._suspects: set[str] = set()  # claims in our list held by no task at the last reconcile
        self._stopping = False
        self._stop: asyncio.Event | None = None  # run_forever's
        self._lost_users: list[HarnessUser] = []  # users whose processes could not be ended

    def _check_log_dir(self) -> None:
        """With run-as users: the log directory (made if missing) must be this user's and writable by no one else
        (a harness user that could write it replaced or removed other runs' logs). Raises :class:`LaunchError`."""
        import stat

        self.log_dir.mkdir(parents=True, exist_ok=True)
        st = os.lstat(self.log_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise LaunchError(f"run-as: the log directory {self.log_dir} must be a directory of this user's that no one "
                              f"else can write (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})")

    @staticmethod
    def _own(env: dict[str, str], user: HarnessUser | None) -> dict[str, str]:
        """``env`` with ``user``'s ``HOME``, ``USER`` and ``LOGNAME`` (as it is without one)."""
        if user is None:
            return env
        return {**env, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}

    async def _release(self, user: HarnessUser) -> None:
        """End every process of ``user`` (a run's children that left its process group too), then give the user to
        the next run; one whose processes outlive that is not used again (logged)."""
        try:
            sent = await asyncio.to_thread(end_user_processes, [user.uid])
        except RuntimeError as exc:  # (a process stuck in the kernel): no run may become that user again; the
            # others go on with the rest of the pool, and with none left this controller stops (its running rollouts
            # are handed back): runs waiting for a user would wait for ever
            self._lost_users.append(user)
            left = len(self.users) - len(self._lost_users)
            log.error("%s: user %s is not used again (%d of the pool left)%s", exc, user.name, left,
                      "" if left else "; stopping this controller")
            if not left and self._stop is not None:
                self._stop.set()
            return
        if sent:
            log.info("ended %d process(es) of %s after its run", sent, user.name)
        await asyncio.to_thread(reap_zombies_of, [user.uid])  # (made this controller's children: CLONE_PARENT)
        self._free_users.put_nowait(user)

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Take queued rollouts until ``stop`` is set; then kill running groups and hand their rollouts back.

        First takes the lease and adopts the claims of dead controllers; meanwhile renews the lease and
        reconciles every ``lease_ttl_s`` s.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stop = stop
        locks = UserLocks(self.users)  # (LaunchError: another controller of this machine uses one of them)
        try:
            named = [u for u in self.users if not u.anonymous]
            if busy := user_processes([u.uid for u in named]):
                # a named user may be one the machine uses (nobody runs daemons): its processes are not ours to end
                raise LaunchError(f"run-as: {', '.join(u.name for u in named)}: process(es) {busy[:5]} already run as "
                                  "one of these users; harness users must be dedicated to harness runs (every process "
                                  "of a run's user is ended with the run): end them, or use a range of uids without "
                                  "users")
            if self.users:  # what runs of a controller that died left running as an anonymous uid
                try:
                    await asyncio.to_thread(end_user_processes, [u.uid for u in self.users])
                except RuntimeError as exc:
                    raise LaunchError(f"run-as: {exc} (left by an earlier run): end them, or use other uids") from None
            await self._run_forever(stop)
        finally:
            locks.close()

    async def _run_forever(self, stop: asyncio.Event) -> None:
        if not await self.take_lease(stop):  # stopped while an earlier run's lease lapsed
            return
        lease_stop = asyncio.Event()
        lease_task = asyncio.create_task(self.lease_loop(lease_stop, stop))
        try:
            while not stop.is_set():
                if self._sem.locked():  # all slots busy: wait for one, but keep watching ``stop``
                    await wait_until(stop, 0.2)
                    continue
                await self._sem.acquire()
                try:
                    if not await self.still_mine():  # (a claim would go to the list of the controller holding our id)
                        self._sem.release()
                        stop.set()
                        break
                    rid = await self.store.claim_queued(self.controller_id, timeout_s=0.5)
                except Exception as exc:  # Redis down: wait and retry
                    self._sem.release()
                    log.warning("queue unavailable: %s", exc)
                    await asyncio.sleep(1.0)
                    continue
                if rid is None:
                    self._sem.release()
                    continue
                self._in_hand[rid] += 1  # (no await since the claim: a reconcile never sees it held by nobody)
                task = asyncio.create_task(self._guarded(rid))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await self.shutdown()
            lease_stop.set()
            await lease_task
            with contextlib.suppress(Exception):
                await self.store.drop_lease(self.controller_id, owner=self._lease_owner)

    async def shutdown(self) -> None:
        """SIGTERM every running group, SIGKILL after 3 s, and wait until their rollouts are handed back
        (a new attempt, queued for the next controller: an interrupted run is not the agent's failure)."""
        self._stopping = True
        for run, proc in list(self._procs.items()):
            self._interrupted.add(run)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=3.0)
            for proc in list(self._procs.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5.0)

    async def _guarded(self, rollout_id: str) -> None:
        try:
            await self.run_one(rollout_id)
        except Exception:  # a bug: never leave a claimed rollout running on a live controller (nobody adopts it)
            log.exception("run of rollout %s failed unexpectedly; ending it as controller_error", rollout_id)
            with contextlib.suppress(Exception):  # (Redis gone too: the claim is an orphan, see reconcile_claims)
                rollout = await self.store.get_rollout(rollout_id)
                if rollout.status == RolloutStatus.running:
                    await self.finish_attempt(rollout_id, rollout.attempt_id, "controller_error", check_calls=False)
        finally:
            self._in_hand[rollout_id] -= 1
            if self._in_hand[rollout_id] <= 0:
                del self._in_hand[rollout_id]
            self._sem.release()

    async def reconcile_claims(self, startup: bool = False) -> int:
        """The base's (dead controllers' claims), then this controller's own orphan claims: ids in its processing
        list that no task of it holds, at two reconciles in a row (``lease_ttl_s`` apart: never one being claimed
        right now). A run whose outcome could not be written, not even as ``controller_error`` (Redis went away
        under it), or a claim whose answer was lost, left its rollout ``running`` (or ``queuing``) and claimed by a
        live controller, which nobody adopts: until a restart under the same id. Each is adopted as a dead
        controller's claim is (``queuing``: queued again; ``running``: ended ``controller_lost``, retried if
        ``retry_on`` says so; finished: released). Returns the number of ids adopted."""
        adopted = await super().reconcile_claims(startup)
        if startup or self._stopping:
            return adopted
        held_by_none = {rid for rid in await self.store.claimed(self.controller_id) if not self._in_hand[rid]}
        orphans, self._suspects = held_by_none & self._suspects, held_by_none - self._suspects
        for rid in sorted(orphans):
            if self._in_hand[rid] or self._stopping:  # claimed again meanwhile
                continue
            log.warning("rollout %s: claimed by this controller, held by none of its runs (its outcome or start was "
                        "not written: Redis went away?): adopted", rid)
            self._in_hand[rid] += 1
            try:
                await self.adopt(rid)
                adopted += 1
            except Exception:  # noqa: BLE001 - Redis still away: tried again at the next reconcile
                log.exception("adopting orphan claim %s failed", rid)
            finally:
                self._in_hand[rid] -= 1
                if self._in_hand[rid] <= 0:
                    del self._in_hand[rid]
        return adopted

    async def _watch(self, proc, waiter: asyncio.Future, log: RunLog, t0: float) -> str | None:
        """Wait for the run to end: its failure (:func:`_outcome`), ``timeout`` past ``timeout_s`` or ``log_limit``
        once it wrote more than ``max_log_bytes`` to its log (:class:`~.spawn.RunLog`) (both: the process group is
        killed first)."""
        while True:
            left = self.timeout_s - (time.monotonic() - t0)
            if left <= 0:
                # a run that has ended is not a timeout, even if this controller looks late (its loop stopped or
                # starved past the deadline): its exit is given EXIT_SEEN_S to be seen first
                with contextlib.suppress(TimeoutError):
                    return _outcome(await within(asyncio.shield(waiter), EXIT_SEEN_S))
                failure = "timeout"
                break
            with contextlib.suppress(TimeoutError):
                return _outcome(await within(asyncio.shield(waiter), min(left, LOG_CHECK_S)))
            if log.over:
                failure = "log_limit"
                break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await waiter
        return failure

    async def run_one(self, rollout_id: str) -> Rollout | None:
        """Run one claimed rollout's current attempt to its end and write back status, failure and reward.

        Returns the rollout as written (``queuing`` again if the attempt is retried), or ``None`` if it
        was not queuing (or is missing) or its outcome was fenced off as stale.
        """
        rollout = await self.start_attempt(rollout_id)
        if rollout is None:
            return None
        user = await self._free_users.get() if self.users else None
        released = False

        async def release() -> None:  # once, and not cut short by a cancellation
            nonlocal released
            if user is not None and not released:
                released = True
                await asyncio.shield(self._release(user))

        try:
            return await self._run_attempt(rollout, user, release)
        finally:
            await release()

    async def _run_attempt(self, rollout: Rollout, user: HarnessUser | None, release) -> Rollout | None:
        """:meth:`run_one` once its attempt started, as ``user``; ``release`` ends that user's processes (called as
        soon as the run has ended, before its outcome is written)."""
        rollout_id = rollout.rollout_id
        aid = rollout.attempt_id
        env = {**self._own(passed_env(dict(os.environ), self.pass_env), user), **self.extra_env,
               **harness_env(self.gateway_url, rollout, self.model, self.key)}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / log_name(rollout_id, aid)
        failure: str | None = None
        log_fd = -1
        run_log = None
        try:
            log_fd = create_log(log_path)
            run_log = RunLog(log_fd, self.max_log_bytes)
            try:
                proc = await self.launcher.start(env, self.cwd, run_log.write_fd, user)
            finally:
                run_log.started()
        except Exception as exc:  # noqa: BLE001 - OSError, ValueError (an environment that cannot be one: NUL, "="
            # in a name), EOFError (a forkserver that died importing a --preload module): the run never started
            log.warning("cannot start %s: %s", redacted_text(shlex.join(self.command)), redacted_text(repr(exc)))
            if run_log is not None:
                await asyncio.to_thread(run_log.close)
            if log_fd >= 0:
                os.close(log_fd)
            await release()
            return await self.finish_attempt(rollout_id, aid, "spawn_error", check_calls=False)
        self._procs[rollout_id, aid] = proc
        if self._stopping:  # the stop came while it was being started: shutdown() did not see it
            self._interrupted.add((rollout_id, aid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(proc.wait())
        try:
            failure = await self._watch(proc, waiter, run_log, t0)
        finally:
            self._procs.pop((rollout_id, aid), None)
            # Reap anything the harness left behind in its group (and, run as a user, anywhere).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await release()
            await asyncio.shield(asyncio.to_thread(run_log.close))  # what is left behind writes to it no more
            if run_log.over:  # (also a run that wrote past the limit and exited before a check saw it)
                failure = "log_limit"
                with contextlib.suppress(OSError):  # (the copy kept max_log_bytes at most) said so at its end
                    os.pwrite(log_fd, f"\n[agl-controller: log cut at {self.max_log_bytes} bytes; the run was "
                              "stopped: log_limit]\n".encode(), self.max_log_bytes)
            os.close(log_fd)
        log.info("rollout %s attempt %s ended in %.1f s: %s", rollout_id, aid, time.monotonic() - t0,
                 failure or "ok")
        if (rollout_id, aid) in self._interrupted:
            # our own shutdown signalled it: whatever it exited with (a harness that traps SIGTERM and exits 0,
            # 1 or 143), the run was cut short by us, not by the agent
            self._interrupted.discard((rollout_id, aid))
            return await self.hand_back(rollout_id, aid, failure or "interrupted")
        try:
            return await self.finish_attempt(rollout_id, aid, failure)
        except asyncio.CancelledError:  # a shutdown while its outcome was written (a slow judge): hand it back
            await asyncio.shield(self.hand_back(rollout_id, aid, "interrupted"))
            raise
