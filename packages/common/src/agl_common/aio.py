"""Waiting with a time limit, and calling libraries, without ever losing a cancellation.

A task whose ``cancel()`` is lost goes on running: a loop (a heartbeat, a lease renewal, a poll) never ends, and
whatever waits for it hangs. A gateway's shutdown hung so, its replica id stayed claimed, and the next gateway under
that id did not start (a CI failure: "server did not start"). Two causes, each handled here once:

- ``asyncio.wait_for`` (Python 3.11) returns the result of an inner wait that finished in the same loop iteration
  as a ``cancel()`` of the waiting task (CPython gh-86296, fixed in 3.12 by rebuilding it on ``asyncio.timeout``).
  Every timed wait of the packages goes through :func:`wait_until` or :func:`within` instead, on
  ``asyncio.timeout``, which waits in the calling task and counts cancellations (``Task.uncancel``).
- redis-py's asyncio client returns normally from most commands during which the task was cancelled:
  :func:`keeps_cancellation`, applied by :mod:`agl_common.store` to every ``Store`` method
  (:func:`methods_keep_cancellation`) and to the pub/sub object it hands out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_until(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s`` seconds (float; 0 or less: do not wait). Returns whether
    it is set. Raises ``asyncio.CancelledError`` if the calling task is cancelled meanwhile, whatever else happened
    in that instant."""
    if not event.is_set() and timeout_s > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()
    return event.is_set()


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw`` for at most ``timeout_s`` seconds (float). Raises ``TimeoutError`` past it (``aw``, if a task or
    future, is cancelled then: wrap it in ``asyncio.shield`` to keep it) and ``asyncio.CancelledError`` if the
    calling task is cancelled, even as ``aw`` finishes in that instant."""
    async with asyncio.timeout(timeout_s):
        return await aw


def keeps_cancellation(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """``method`` (a coroutine function), made to raise ``asyncio.CancelledError`` when it returns although its task
    was cancelled meanwhile (``Task.cancelling()`` went up and nothing took the request back).

    For redis-py (8.1): its asyncio client returns normally from a command during which the task was cancelled, far
    more often than not (measured: 145 of 200 cancels of a loop of ``SET`` lost, in ``send_packed_command`` and the
    pool's ``get_connection``; redis/redis-py#2028 is an old report of it), and a loop around Redis calls then never
    ends: the gateway's heartbeat loop, cancelled by its shutdown while it heartbeated, went on for ever, its
    shutdown never finished and its replica id stayed claimed. Wrapped where the whole reply has been read (a
    ``Store`` method, pub/sub's ``parse_response``), the connection is left in a clean state; an enclosing
    ``asyncio.timeout`` still turns its own cancellation into ``TimeoutError`` (it counts it).

    Raises ``TypeError`` (at wrapping) if ``method`` is not a coroutine function (a pipeline's ``execute_command``
    only queues, and returns the pipeline)."""
    if not inspect.iscoroutinefunction(method):
        raise TypeError(f"{method!r} is not a coroutine function")

    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> T:
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        result = await method(*args, **kwargs)
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError(f"cancelled during {method.__qualname__} (which returned past it)")
        return result

    return call


def methods_keep_cancellation(cls: type) -> type:
    """Class decorator: every coroutine method defined in ``cls`` (not inherited; dunder methods left alone) wrapped
    by :func:`keeps_cancellation`. For :class:`agl_common.store.Store`, the one place that touches Redis: guarded at
    its boundary, every caller's loop is, whatever redis-py path (command, script, pipeline, cluster machinery)
    lost the cancellation below it."""
    for name, value in list(vars(cls).items()):
        if not name.startswith("__") and inspect.iscoroutinefunction(value):
            setattr(cls, name, keeps_cancellation(value))
    return cls
