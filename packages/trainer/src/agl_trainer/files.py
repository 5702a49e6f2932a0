"""Reading a small file the user (or a run) left: a config, a checkpoint's state, a run's ``config.json``, the
dashboard's run files. One guard for all of them: a FIFO would block the reader for ever, a device (``/dev/zero``)
would fill memory, a file the user may not read (or one whose read fails, ``/proc/self/clear_refs``) would be a
traceback."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_small_file(path: Path | str, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is a regular file (a link to one is followed) of at most ``max_bytes``.

    Raises ``ValueError`` with one line naming ``path`` otherwise: missing, not a regular file (a FIFO, opened
    without blocking; a device; a directory), larger than ``max_bytes`` (also one that grew while read), or
    unreadable (``OSError``: no permission, an I/O error)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO opens at once, then fails the check below)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            raise ValueError(f"{path}: not a regular file of at most {_size(max_bytes)}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: not a regular file of at most {_size(max_bytes)}")
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def read_jsonl(path: Path | str, max_bytes: int, loads: Callable[[str], Any] = json.loads) -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines file (:func:`read_small_file`, each line parsed by ``loads``); a line that
    does not parse (a half-written last line, a blank one) or is not an object is skipped.

    Raises ``ValueError`` (one line naming ``path``) as :func:`read_small_file` does."""
    out = []
    for line in read_small_file(path, max_bytes).decode("utf-8", errors="replace").splitlines():
        try:
            obj = loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
