"""The ``--reward-fn``: loaded once to check it, then run in worker processes of its own.

A reward function is the user's code (a judge, a test run, a regex), and it ran in a thread of the controller.
A thread shares the interpreter: a function that holds the GIL (a backtracking regex, a long C loop) froze the
controller's event loop, so neither its timeout nor the lease renewals ran and another controller ended every
running rollout as ``controller_lost``; ``os._exit`` in it ended the controller; ``os.chdir`` moved every later
run. Here each call runs in a worker process (``multiprocessing``'s *spawn* start: a fresh interpreter with the
controller's ``sys.path``, working directory and environment, which the controller's CLI has already cleared of
the admin key and the Redis URL). A worker that answers goes back to a small idle pool and serves later calls (a
module's state lives on per worker, not across workers); one past its timeout, or cancelled, is killed with every
process of its group (it leads a session of its own: what the function started goes with it).

What crosses the pipe is JSON, never a pickle: a request ``[nonce, input, final_output]`` and its answer ``[nonce,
true, reward]`` or ``[nonce, false, one-line error]``, at most :data:`MAX_ANSWER_BYTES`. The controller reads the
answer as data and checks it again (the nonce of its own request, :func:`agl_common.schemas.check_reward` on the
value): a process the function started that wrote into the pipe ran code in the controller through the pickle (the
admin key read from its memory), forged the reward, and left the real answer to be read as the next call's (round
23). The worker's descriptors are closed on exec, so what the function runs (``os.system``, ``subprocess``: a
candidate program a judge tests) holds none of them; a process the function *forks* without exec shares the
worker's memory and descriptors and so can answer in its name (a judge runs untrusted code in a fresh process).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import json
import multiprocessing
import os
import secrets
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

from agl_common.aio import within

RewardFn = Callable[[dict[str, Any], str], float]

#: Seconds a new worker may take to start and import the reward function's module (not counted in the
#: reward timeout: a cold start on a loaded machine must not fail a judge that answers in time).
START_TIMEOUT_S = 120.0
#: Idle workers kept for later calls; a worker beyond it is stopped when its call ends.
IDLE_WORKERS = 4
#: The longest answer a worker may send (a reward, or a one-line error of 300 characters, as JSON).
MAX_ANSWER_BYTES = 4096


class RewardFunctionError(RuntimeError):
    """The ``--reward-fn`` raised (whatever it raised, ``SystemExit`` and ``GeneratorExit`` included), returned
    something that is not a reward, or its process ended or could not start."""


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``module:function``; the function takes ``(input: dict, final_output: str) -> float``.

    Raises ``ValueError`` (one line, the cause named) if ``spec`` is not ``module:function``, the module
    cannot be imported, or it has no callable of that name."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"reward function must be 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - ImportError, a SyntaxError, a sys.exit(), whatever
        raise ValueError(f"reward function {spec!r}: cannot import {module!r} ({type(exc).__name__}: {exc})") from None
    try:
        fn = getattr(mod, name)
    except AttributeError:
        raise ValueError(f"reward function {spec!r}: module {module!r} has no {name!r}") from None
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _close_on_exec() -> None:
    """In the worker: every descriptor above stderr closed on exec (the pipe to the controller, the resource tracker's
    pipe, the spawn sentinel: spawn passes them inheritable), so that a program the reward function runs holds none."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):  # (the listing's own descriptor is gone by now)
            if int(name) > 2:
                os.set_inheritable(int(name), False)


def _serve(conn, spec: str, parent: int, nonce: str) -> None:
    """A worker's main: load ``spec``, say so (``[nonce, ok, message]``), then answer each request ``[nonce, input,
    output]`` with ``[nonce, true, reward]`` or ``[nonce, false, message]`` until the controller (pid ``parent``)
    closes the pipe or dies."""
    from agl_common.lifetime import die_with_parent
    from agl_common.proc_secrets import hide_from_proc
    from agl_common.schemas import check_reward

    # an exec'd child is dumpable again: a harness of the same user could read this worker's memory (the reward
    # function's own secrets, a judge's API key) through /proc/<pid>/mem; not any more (as the controller itself)
    hide_from_proc((), dumpable=False)
    _close_on_exec()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the controller, which decides
    os.setsid()  # a process group of its own: what the function starts (a test run, model-written code) is killed
    # with the worker (_Worker.kill), not left running as the controller's user after a timeout. Out of the
    # controller's group, a killpg of the controller (Services' SIGKILL) no longer reaches the worker: it asks Linux
    # for SIGKILL when the controller dies instead (its function's own processes live on only then)
    die_with_parent(signal.SIGKILL, parent)
    try:
        fn = load_reward_fn(spec)
    except ValueError as exc:
        conn.send_bytes(_dumps([nonce, False, str(exc)[:300]]))
        return
    conn.send_bytes(_dumps([nonce, True, None]))
    while True:
        try:
            nonce, inp, output = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            answer = [nonce, True, check_reward(fn(inp, output))]
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, GeneratorExit: reported
            answer = [nonce, False, _one_line(exc)]
        try:
            conn.send_bytes(_dumps(answer))
        except (BrokenPipeError, EOFError, OSError):
            return


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()  # (json, not orjson: an input may hold an int > 2**64)


def _read_answer(data: bytes, nonce: str, started: bool) -> tuple[bool, float | str | None]:
    """A worker's answer ``data`` to the request of ``nonce``, read as data: ``(True, reward)`` (checked again:
    :func:`~agl_common.schemas.check_reward`; ``(True, None)`` for the start-up answer, ``started`` False) or ``(False,
    message)`` (printable, 300 characters at most). Raises :class:`RewardFunctionError` for anything else (not JSON,
    another request's nonce, a value that is no reward)."""
    from agl_common.schemas import check_reward
    from agl_common.settings import printable

    try:
        got, ok, value = json.loads(data)
    except (TypeError, ValueError, RecursionError):  # (not JSON, not three values)
        got = ok = value = None
    if not isinstance(got, str) or not secrets.compare_digest(got, nonce) or not isinstance(ok, bool):
        raise RewardFunctionError("the reward function's process answered out of turn (something it started wrote "
                                  "into its pipe to the controller)")
    if not ok:
        return False, printable(str(value))[:300]
    if not started and value is None:
        return True, None
    try:
        return True, check_reward(value)
    except ValueError as exc:
        raise RewardFunctionError(f"the reward function's process answered no reward: {exc}") from None


def _in_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """``fn()`` (blocking pipe I/O) in a daemon thread, as a future of the running loop; a thread left blocked
    holds no executor and no interpreter exit (``asyncio.to_thread``'s pool is joined at shutdown)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - EOFError above all: reported in the loop
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is gone (the controller stopped meanwhile)
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="reward-fn", daemon=True).start()
    return future


def _unreaped(pid: int) -> bool:
    """Whether ``pid`` is still this process's child, alive or a zombie not yet waited for (``waitid`` with
    ``WNOWAIT`` reaps nothing): its pid, and so its process group's id, can then name no other process."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


_live: weakref.WeakSet = weakref.WeakSet()  # every worker started in this process, for the exit below


@atexit.register  # (registered after multiprocessing's own exit hook, so it runs first: that hook would join a
def _kill_all() -> None:  # worker whose function ignores SIGTERM for ever)
    for worker in list(_live):
        worker.kill()


class _Worker:
    """One worker process and the controller's end of its pipe."""

    def __init__(self, spec: str):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.nonce = secrets.token_hex(16)
        # not a daemon: a judge may start processes of its own (a multiprocessing.Process with a time limit, as
        # HumanEval's check_correctness; a Pool), which multiprocessing refuses in a daemon; kill() and the exit
        # hook below end it, and it asks Linux for SIGKILL when the controller dies (_serve)
        self.proc = ctx.Process(target=_serve, args=(child, spec, os.getpid(), self.nonce), name="agl-reward-fn",
                                daemon=False)
        self.proc.start()
        child.close()
        _live.add(self)

    def _exchange(self, request: Any) -> tuple[bool, float | str]:
        """Send ``request`` (``[input, output]``, or None: read the start-up answer) under a new nonce and read its
        answer (:func:`_read_answer`). Raises :class:`RewardFunctionError`."""
        try:
            if request is not None:
                self.nonce = secrets.token_hex(16)
                self.conn.send_bytes(_dumps([self.nonce, *request]))
            data = self.conn.recv_bytes(MAX_ANSWER_BYTES)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.proc.join(5)
            raise RewardFunctionError(f"the reward function's process ended (exit code {self.proc.exitcode})") \
                from None
        except OSError:  # (recv_bytes: a message longer than MAX_ANSWER_BYTES)
            raise RewardFunctionError("the reward function's process answered out of turn (an answer of more than "
                                      f"{MAX_ANSWER_BYTES} bytes)") from None
        return _read_answer(data, self.nonce, started=request is not None)

    def quiet(self) -> bool:
        """Whether nothing more waits in the pipe after an answer (else a process the function started wrote into
        it: the worker is not kept, so no later call reads what it wrote)."""
        try:
            return not self.conn.poll(0)
        except (OSError, ValueError):
            return False

    async def ready(self) -> None:
        ok, message = await within(_in_thread(lambda: self._exchange(None)), START_TIMEOUT_S)
        if not ok:
            raise RewardFunctionError(message)

    async def call(self, inp: dict[str, Any], output: str) -> float:
        ok, value = await _in_thread(lambda: self._exchange([inp, output]))
        if not ok:
            raise RewardFunctionError(value)
        return value

    def kill(self) -> None:
        """Kill the worker and every process of its group (what its function started and did not end; one that
        left the group with ``setsid`` of its own is the function's own choice)."""
        _live.discard(self)
        if _unreaped(self.proc.pid):  # the group's id is the worker's pid, reserved while the worker is unreaped
            with contextlib.suppress(Exception):  # (once reaped, the pid may lead another process group: a harness
                os.killpg(self.proc.pid, signal.SIGKILL)  # run's; its group, if the worker died first, is left)
        with contextlib.suppress(Exception):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.conn.close()


class RewardPool:
    """Runs ``spec`` in worker processes: :meth:`score` one call at a time per worker, as many at once as callers.

    Args:
        spec: ``module:function`` (checked here, in the controller, once: ``ValueError`` if it does not load).
        idle: idle workers kept for later calls.
    """

    def __init__(self, spec: str, idle: int = IDLE_WORKERS):
        load_reward_fn(spec)
        self.spec, self.idle = spec, idle
        self._idle: list[_Worker] = []
        weakref.finalize(self, _kill_idle, self._idle)  # a pool dropped without close() leaves no process

    async def score(self, inp: dict[str, Any], output: str, timeout_s: float) -> float:
        """The reward of one finished run: ``fn(inp, output)`` checked by :func:`check_reward`, as a float.

        ``timeout_s`` bounds the call itself (a new worker's start-up has :data:`START_TIMEOUT_S` of its own).
        Raises :class:`RewardFunctionError` (it raised, returned no reward, its process ended or did not start)
        or ``TimeoutError`` (past ``timeout_s``: the worker is killed)."""
        worker = None
        while self._idle and worker is None:
            worker = self._idle.pop()
            if not worker.proc.is_alive():  # ended while idle (the OOM killer, a signal): not this call's failure
                worker.kill()
                worker = None
        keep = False
        try:
            if worker is None:
                try:
                    worker = _Worker(self.spec)
                except OSError as exc:  # no process could start (out of pids, out of memory)
                    raise RewardFunctionError(f"cannot start the reward function's process: {exc}") from None
                await worker.ready()
            value = await within(worker.call(inp, output), timeout_s)
            keep = len(self._idle) < self.idle and worker.quiet()
            return value
        finally:
            if worker is not None:
                self._idle.append(worker) if keep else worker.kill()

    def close(self) -> None:
        """Stop every idle worker (one in a call is killed when its call ends)."""
        _kill_idle(self._idle)


def _kill_idle(idle: list[_Worker]) -> None:
    while idle:
        idle.pop().kill()
