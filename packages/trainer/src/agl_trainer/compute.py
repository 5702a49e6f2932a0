"""One thread for a run's torch work: the update, merging and saving the policy, checkpoints.

PyTorch's CPU kernels run on OpenMP (libgomp), and every thread that starts a parallel region gets a team
of its own. Work handed to ``asyncio.to_thread`` lands on whichever executor thread is free, so a run
ended up with several teams: more OpenMP threads than the machine's 2 cores, and then libgomp throttles
its spin-wait (``GOMP_SPINCOUNT`` / 1000) and every parallel region pays a thread wake-up. Measured on a
2-core AVX2 AMD EPYC (``bench/update.py``'s rows, 32 rollouts): the same update took 30 s from the thread
that always ran it and 41-49 s from a second thread (CPU use 1.95 → 1.48 cores). :func:`run` sends all of
it to one long-lived thread instead.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-torch")


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the torch thread, awaited from the event loop; exceptions propagate."""
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))


def thread_name() -> str:
    """The torch thread's name prefix (for tests and logs)."""
    return "agl-torch"
