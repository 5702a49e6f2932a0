"""A per-command sandbox for the agent's shell commands (and for grading), built from Linux namespaces.

``sandbox_prefix(...)`` returns an argv prefix that runs a shell command under
``unshare --user --map-root-user --net --mount --pid --fork --mount-proc`` (util-linux), which gives the command:

- **no network**: a fresh network namespace with only a loopback that is down, so it reaches neither the
  gateway, nor Redis, nor anything else (the agent's model calls are made by mini-SWE-agent's own process,
  outside the sandbox, and are unaffected);
- **no view of other processes**: its own PID namespace and /proc, so ``/proc/<pid>/environ`` of the harness
  (which holds the rollout key and the task) cannot be read;
- **hidden paths**: an empty tmpfs mounted over each ``hide`` path (the task data, the clean repositories, other
  rollouts' workspaces, the controller's logs), except ``keep`` (its own workspace), which is moved back in;
- **read-only paths**: ``readonly`` paths (by default the Python installation) are bind-mounted read-only, so
  the agent cannot plant a ``.pth`` / ``sitecustomize`` that would run inside the grader.

Writes elsewhere (``/tmp``, ``$HOME``) still land on the host; the grader never reads them (it grades in a
fresh copy and runs Python with ``-s``, no user site-packages).

``mini_env.SandboxedEnvironment`` is mini-SWE-agent's own ``LocalEnvironment`` with every command wrapped this
way; it is selected through mini-SWE-agent's normal configuration (``environment.environment_class:
mini_env.SandboxedEnvironment``). Where unprivileged user namespaces are not allowed (some container runtimes
block them), ``sandbox_available()`` is False and commands run unsandboxed, with a warning: see README.md.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

#: an empty directory used as a temporary mount point for ``keep`` while its parent is hidden
KEEP_MOUNTPOINT = Path(os.environ.get("AGL_SWE_KEEP_MOUNTPOINT", "/tmp/.agl-swe-keep"))
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--mount-proc"]


@functools.lru_cache(maxsize=1)
def sandbox_available() -> bool:
    """True if ``unshare`` with user, network, mount and PID namespaces (and a tmpfs mount) works here."""
    if os.environ.get("AGL_SWE_NO_SANDBOX") == "1" or not shutil.which("unshare"):
        return False
    try:
        proc = subprocess.run([*UNSHARE, "sh", "-c", "mount -t tmpfs tmpfs /mnt && echo ok"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and proc.stdout.strip() == "ok"


def default_readonly() -> list[str]:
    """The Python installation that runs the grader (prefix, base prefix, site-packages)."""
    paths = {sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(p for p in paths if p and Path(p).exists())


def _inner_script(hide: list[str], keep: str | None, readonly: list[str]) -> str:
    lines = ["set -e"]
    q = shlex.quote
    resolved = [Path(h).resolve() for h in hide]
    # a path inside another hidden path is hidden already (and could not be mounted on inside the tmpfs)
    hide = [str(h) for h in resolved if not any(h != o and h.is_relative_to(o) for o in resolved)]
    keep_hidden = keep is not None and any(Path(keep).resolve().is_relative_to(Path(h).resolve()) for h in hide)
    if keep_hidden:
        lines.append(f"mount --bind {q(keep)} {q(str(KEEP_MOUNTPOINT))}")
    for h in hide:
        if Path(h).exists():
            lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {q(h)}")
    if keep_hidden:
        lines.append(f"mkdir -p {q(keep)} && mount --move {q(str(KEEP_MOUNTPOINT))} {q(keep)}")
    for r in readonly:
        if Path(r).exists():
            lines.append(f"mount --bind {q(r)} {q(r)} && mount -o remount,bind,ro {q(r)}")
    if keep is not None:
        lines.append(f"cd {q(keep)}")
    lines.append("set +e")
    lines.append('exec /bin/sh -c "$0"')
    return "\n".join(lines)


def sandbox_prefix(hide: list[str] | None = None, keep: str | None = None,
                   readonly: list[str] | None = None) -> list[str]:
    """argv prefix: ``[*prefix, shell_command]`` runs ``shell_command`` in the sandbox ([] if unavailable)."""
    if not sandbox_available():
        return []
    KEEP_MOUNTPOINT.mkdir(parents=True, exist_ok=True)
    script = _inner_script(list(hide or []), keep, default_readonly() if readonly is None else list(readonly))
    return [*UNSHARE, "/bin/sh", "-c", script]


def sandboxed_command(command: str, hide: list[str] | None = None, keep: str | None = None,
                      readonly: list[str] | None = None) -> str:
    """``command`` (a shell string) rewritten to run inside the sandbox (unchanged if unavailable)."""
    prefix = sandbox_prefix(hide, keep, readonly)
    return shlex.join([*prefix, command]) if prefix else command
