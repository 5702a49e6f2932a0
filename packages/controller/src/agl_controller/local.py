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
=====================================  ==========  =======================

An infrastructure failure is never turned into a reward of 0: the trainer decides what a failed rollout
means for its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agl_common.auth import scoped_key
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from agl_common.store import RolloutNotFound, Store

log = logging.getLogger("agl.controller")

RewardFn = Callable[[dict[str, Any], str], float]


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
    for var, field in rollout.env_map.items():
        value = rollout.input.get(field)
        if value is not None:
            env[var] = value if isinstance(value, str) else json.dumps(value)
    return env


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``module:function``; the function takes ``(input: dict, final_output: str) -> float``."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"reward function must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def final_output(calls: list[CallRecord]) -> str:
    """Text of the last successful answer of an attempt (chat message content or completion text)."""
    for call in reversed(calls):
        if call.status != "ok" or not call.response:
            continue
        choices = call.response.get("choices") or []
        if choices:
            msg = choices[0].get("message") or {}
            return msg.get("content") or choices[0].get("text") or ""
    return ""


def _outcome(returncode: int) -> str | None:
    if returncode == 0:
        return None
    if returncode < 0:
        sig = -returncode
        return "oom_killed" if sig == signal.SIGKILL else f"signal:{sig}"
    return f"exit_code:{returncode}"


class LocalRunner:
    """Runs ``command`` once per queued rollout as a local process group.

    Args:
        store: the experiment's store.
        gateway_url: base URL of the gateway, e.g. ``http://127.0.0.1:8080``.
        command: the harness command line (a string is split with ``shlex``).
        model: the model name handed to the harness as ``AGL_MODEL``.
        concurrency: most runs at once.
        timeout_s: wall-clock limit of one run, seconds; past it the process group gets SIGKILL.
        key: the gateway admin key, to derive rollout-scoped keys (None: auth off).
        reward_fn: ``module:function`` used when the run reported no reward itself.
        log_dir: stdout and stderr of each attempt go to ``{log_dir}/{rollout}.{attempt}.log``.
    """

    def __init__(self, store: Store, gateway_url: str, command: list[str] | str, model: str,
                 concurrency: int = 4, timeout_s: float = 300.0, key: str | None = None,
                 reward_fn: str | None = None, log_dir: Path | str = "runs/logs", cwd: str | None = None,
                 extra_env: dict[str, str] | None = None):
        self.store = store
        self.gateway_url = gateway_url
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.model = model
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.key = key
        self.reward_fn = load_reward_fn(reward_fn) if reward_fn else None
        self.log_dir = Path(log_dir)
        self.cwd = cwd
        self.extra_env = extra_env or {}
        self._sem = asyncio.Semaphore(concurrency)
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task] = set()

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Take queued rollouts until ``stop`` is set; then kill running groups and mark them failed."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            while not stop.is_set():
                if self._sem.locked():  # all slots busy: wait for one, but keep watching ``stop``
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=0.2)
                    continue
                await self._sem.acquire()
                try:
                    rid = await self.store.pop_queued(timeout_s=0.5)
                except Exception as exc:  # Redis down: wait and retry
                    self._sem.release()
                    log.warning("queue unavailable: %s", exc)
                    await asyncio.sleep(1.0)
                    continue
                if rid is None:
                    self._sem.release()
                    continue
                task = asyncio.create_task(self._guarded(rid))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """SIGTERM every running group, SIGKILL after 3 s, and wait for their rollouts to be marked."""
        for proc in list(self._procs.values()):
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
        except Exception:
            log.exception("run of rollout %s failed unexpectedly", rollout_id)
        finally:
            self._sem.release()

    async def run_one(self, rollout_id: str) -> Rollout | None:
        """Run one queued rollout to its end and write back status, failure and reward."""
        try:
            rollout = await self.store.get_rollout(rollout_id)
        except RolloutNotFound:
            log.warning("queued rollout %s does not exist; skipped", rollout_id)
            return None
        if rollout.status != RolloutStatus.queuing:
            return rollout
        rollout = await self.store.set_status(rollout_id, RolloutStatus.running)
        env = {**os.environ, **self.extra_env, **harness_env(self.gateway_url, rollout, self.model, self.key)}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{rollout_id}.{rollout.attempt_id}.log"
        failure: str | None = None
        with open(log_path, "wb") as logf:
            try:
                proc = await asyncio.create_subprocess_exec(*self.command, env=env, stdout=logf, stderr=logf,
                                                            stdin=asyncio.subprocess.DEVNULL, cwd=self.cwd,
                                                            start_new_session=True)
            except OSError as exc:
                log.warning("cannot start %s: %s", self.command, exc)
                return await self.store.set_status(rollout_id, RolloutStatus.failed, "spawn_error")
            self._procs[rollout_id] = proc
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(proc.wait(), timeout=self.timeout_s)
                failure = _outcome(proc.returncode)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                failure = "timeout"
            finally:
                self._procs.pop(rollout_id, None)
                # Reap anything the harness left behind in its group.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        log.info("rollout %s attempt %s ended in %.1f s: %s", rollout_id, rollout.attempt_id,
                 time.monotonic() - t0, failure or "ok")
        return await self._finish(rollout_id, rollout.attempt_id, failure)

    async def _finish(self, rollout_id: str, attempt_id: str, failure: str | None) -> Rollout:
        calls = await self.store.read_calls(rollout_id, attempt_id)
        if failure is None and not calls:
            failure = "no_model_calls"
        current = await self.store.get_rollout(rollout_id)
        if failure is None and current.reward is None and self.reward_fn is not None:
            try:
                value = float(self.reward_fn(current.input, final_output(calls)))
            except Exception as exc:
                log.warning("reward function failed on %s: %s", rollout_id, exc)
                failure = "reward_error"
            else:
                def set_reward(r: Rollout) -> None:
                    r.reward = value
                current = await self.store.update_rollout(rollout_id, set_reward)
        if failure is None and current.reward is None:
            failure = "no_reward"
        status = RolloutStatus.failed if failure else RolloutStatus.succeeded
        return await self.store.set_status(rollout_id, status, failure)
