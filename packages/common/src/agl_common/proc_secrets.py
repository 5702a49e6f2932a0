"""Keep this process's secrets out of what other processes of its Unix user read in ``/proc``.

A local harness runs as the controller's user. The controller gives it an allow-listed environment, but Linux
shows every process's *initial* command line and environment to the processes of the same user:
``/proc/<pid>/cmdline`` (anyone) and ``/proc/<pid>/environ`` (same user). ``os.environ.pop`` changes neither
(CPython copies the environment at start-up; ``unsetenv`` moves C pointers, not the bytes the kernel shows), so a
harness that read ``/proc/$PPID/environ`` or ``/proc/$PPID/cmdline`` found the admin key (``AGL_KEY`` or
``--key``) and the Redis URL with its password.

:func:`hide_from_proc` overwrites those two memory areas, as ``setproctitle`` does in C (the installed
``setproctitle`` 1.3.8 left both areas as they were under CPython 3.11 here, so it is not used): the
environment's strings are first copied to the heap with ``setenv`` (``os.environ``, ``getenv`` and every child
keep them), then the original area is zeroed; each secret's bytes in the command line become ``*``. With
``dumpable=False`` it also clears the process's dumpable flag (``prctl(PR_SET_DUMPABLE, 0)``): ``/proc/<pid>/mem``
and ``environ`` then belong to root, so another process of the same (non-root) user cannot read this one's
memory; a child that ``exec``s is dumpable again.

Not a boundary against root or ``CAP_SYS_PTRACE`` (they read any memory): run untrusted harnesses as another user
or as Kubernetes Jobs (docs/controller.md).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

PR_SET_DUMPABLE = 4


def _areas() -> tuple[int, int, int, int]:
    """``(arg_start, arg_end, env_start, env_end)``: fields 48 to 51 of ``/proc/self/stat`` (proc(5), Linux >= 3.5)."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()  # (the command name in parentheses may hold spaces)
    return tuple(int(x) for x in fields[45:49])  # field 3 is fields[0]


def hide_from_proc(secrets: Iterable[str | None], dumpable: bool = True) -> bool:
    """Zero this process's initial environment area and mask each of ``secrets`` in its command-line area.

    Args:
        secrets: strings (a key, a URL with a password) to mask wherever they occur in the command line; ``None``
            and empty strings are skipped.
        dumpable: ``False`` also clears the dumpable flag (see the module's docstring).

    Returns ``True`` if the areas were rewritten, ``False`` where this cannot be done (not Linux, ``/proc``
    unreadable or without the fields): callers go on, the secrets as visible as before. Never raises.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arg_start, arg_end, env_start, env_end = _areas()
    except (OSError, ValueError, IndexError):
        return False
    libc.setenv.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int)
    for name, value in list(os.environb.items()):  # each to the heap: C getenv and children keep reading it
        if b"=" not in name and b"\0" not in name + value:
            libc.setenv(name, value, 1)
    if env_end > env_start:
        ctypes.memset(env_start, 0, env_end - env_start)
    if arg_end > arg_start:
        args = ctypes.string_at(arg_start, arg_end - arg_start)
        for secret in {s.encode() for s in secrets if s}:
            at = args.find(secret)
            while at >= 0:
                ctypes.memset(arg_start + at, ord("*"), len(secret))
                at = args.find(secret, at + 1)
    if not dumpable:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    return True


def _holds_secret(value: str) -> bool:
    """Whether ``value`` holds a URL with a secret in it: anything :func:`agl_common.settings.redacted_urls` would hide
    (a password in the user part or in ``?password=`` / ``?ssl_password=``, a token in the query or fragment, a user
    part alone). One definition: what AGL never shows is what it masks."""
    from .settings import redacted_urls

    return "://" in value and redacted_urls(value) != value


def argv_secrets(argv: list[str]) -> list[str]:
    """The secrets of a command line ``argv``: the value of ``--key`` (``--key K`` and ``--key=K`` forms), and every
    value (an option's, ``--opt=value``'s, or a bare argument) that holds a URL with a secret (:func:`_holds_secret`:
    ``--redis redis://h/0?password=pw``, ``--upstream http://u:pw@h``, a URL inside ``--command``). A URL without a
    secret stays readable. Never raises."""
    found = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == "--key":
            value = value if eq else argv[i + 1] if i + 1 < len(argv) else ""
        elif not (arg.startswith("--") and eq and _holds_secret(value)):
            value = arg if _holds_secret(arg) else ""
        if value:
            found.append(value)
    return found


def scrub_argv(secrets: Iterable[str | None]) -> None:
    """Replace each of ``secrets`` in ``sys.argv`` (Python's own copy of the command line) by ``***``, in place.

    A child started by ``multiprocessing`` (the ``--preload`` forkserver, a reward function's worker: ``spawn``)
    gets ``sys.argv`` in its preparation data and keeps it in memory: a harness forked from that forkserver read the
    controller's ``--key`` back by walking its own frames (round 18). Call it after :func:`hide_from_proc` and
    hand the CLI parser a copy taken before (``app(args=argv)``). Never raises."""
    found = [s for s in secrets if s]
    for i, arg in enumerate(sys.argv):
        for secret in found:
            if secret in arg:
                arg = arg.replace(secret, "***")
        sys.argv[i] = arg
