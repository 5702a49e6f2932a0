"""A child process's lifetime tied to its parent's (Linux)."""

from __future__ import annotations

import ctypes
import os

#: ``prctl`` option: the signal a process gets when the thread that started it ends (``PR_SET_PDEATHSIG``).
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Ask Linux to send this process ``sig`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``; call it in the
    child). With ``parent`` (the parent's pid, taken before the child started), a parent that died before the call
    took effect ends this process at once (``os._exit(0)``): no signal would come any more. Where ``prctl`` is
    missing (not Linux) nothing is asked. Raises nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(0)
