"""Starting one harness process per rollout attempt: exec it, or fork it from a warm Python interpreter.

``exec`` (the default) runs the command line as it is: a new process group per attempt.

``preload`` (opt-in, Python harnesses only) is for harnesses whose *imports* cost more than their run: the
OpenAI Agents SDK takes ~1.9 CPU-seconds to import (mostly pydantic models of the MCP types), paid again by
every rollout. Here the standard library's ``multiprocessing`` forkserver imports the named modules once,
and each attempt is a ``fork()`` of that warm interpreter which then runs the harness's script (or ``-m``
module) as ``__main__`` with ``runpy``, in its own session (process group), with the attempt's environment,
working directory and log file. The harness's code is unchanged and still runs once per process; what is
shared is only the state its modules had right after import. Not for harnesses that read environment
variables *at import time* of a preloaded module (they would see the controller's environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import atexit
import functools
import multiprocessing
import os
import pkgutil  # noqa: F401 (runpy.run_path imports it at each call: a run as another user may not reach the stdlib)
import runpy
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path


class LaunchError(OSError):
    """The harness could not be started (bad command, missing script, interpreter mismatch)."""


@dataclass(frozen=True)
class HarnessUser:
    """A Unix user a harness run becomes (``agl-controller run --run-as``): its ids and home directory;
    ``anonymous`` for a uid that names no user (:func:`harness_user`)."""

    name: str
    uid: int
    gid: int
    home: str
    anonymous: bool = False


#: Most users one ``--run-as`` may name (ranges counted whole): each is checked at start and locked while it runs.
MAX_HARNESS_USERS = 1024
#: ``HOME`` of a uid that has no entry in the user database (a range's): a directory that does not exist, as for
#: ``nobody``.
ANONYMOUS_HOME = "/nonexistent"


def _is_number(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` takes ``²`` and other scripts' digits, which ``int`` then refuses or reads)."""
    return text.isascii() and text.isdigit()


def harness_user(name: str) -> HarnessUser:
    """The user ``name`` (a name or a numeric uid) as a :class:`HarnessUser`. A numeric uid that names no user is
    taken as an *anonymous* one: its group is the gid of the same number, which must name no group (a uid of 27 in
    gid 27 would be in group ``sudo``), and its home is :data:`ANONYMOUS_HOME`.

    Raises :class:`LaunchError` if no such user exists, for root, for a user whose primary group is 0 (root's group:
    files of the controller's user made group-readable would be the harness's), or if this process cannot become it
    (switching users needs root or ``CAP_SETUID``/``CAP_SETGID``; a user other than this process's own is refused
    otherwise, before any run fails ``spawn_error`` for it)."""
    import grp
    import pwd

    try:
        entry = pwd.getpwuid(int(name)) if _is_number(name) else pwd.getpwnam(name)
        user = HarnessUser(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)
    except (KeyError, ValueError, OverflowError):
        if not _is_number(name) or int(name) >= 2**32 - 1:
            raise LaunchError(f"run-as: no user {name!r} on this machine") from None
        user = HarnessUser(name, int(name), int(name), ANONYMOUS_HOME, anonymous=True)
        with contextlib.suppress(KeyError):
            raise LaunchError(f"run-as: uid {name} names no user, and its group, gid {name}, is "
                              f"{grp.getgrgid(user.gid).gr_name!r}: a uid without a user runs in the group of its "
                              "own number, which must name no group")
    if user.uid != os.geteuid() and os.geteuid() != 0:
        raise LaunchError(f"run-as: this controller (uid {os.geteuid()}) cannot start processes as {user.name!r}: "
                          "switching users needs root")
    if user.uid == 0:
        raise LaunchError("run-as: root is not another user (a harness run as root reads every process's memory)")
    if user.gid == 0:
        raise LaunchError(f"run-as: {user.name!r} has group 0 (root's) as its primary group: give it a group of "
                          "its own")
    return user


def harness_users(spec: str, concurrency: int | None = None) -> list[HarnessUser]:
    """The users of ``spec``: comma-separated names, uids and uid ranges ``FIRST-LAST`` (every uid of a range must
    name no user: a range is of anonymous uids, see :func:`harness_user`). Each concurrent run becomes a user of its
    own, taken from these and handed back once every process of it is gone (:func:`end_user_processes`): runs of one
    user could read each other's ``/proc/<pid>/environ`` (a scoped key) and signal each other, and a process a run
    left behind reached the next.

    Raises :class:`LaunchError` for a bad item, a user named twice, more than :data:`MAX_HARNESS_USERS`, a user
    this controller runs as, or fewer users than ``concurrency`` (when given)."""
    import pwd

    users: list[HarnessUser] = []
    for item in (part.strip() for part in spec.split(",")):
        first, dash, last = item.partition("-")
        if dash and _is_number(first) and _is_number(last):
            if int(first) > int(last):
                raise LaunchError(f"run-as: the range {item!r} is empty")
            if int(last) - int(first) + len(users) >= MAX_HARNESS_USERS:
                raise LaunchError(f"run-as: at most {MAX_HARNESS_USERS} users")
            for uid in range(int(first), int(last) + 1):
                with contextlib.suppress(KeyError):
                    raise LaunchError(f"run-as: uid {uid} of the range {item} is the user {pwd.getpwuid(uid).pw_name!r}:"
                                      " a range holds uids that name no user (name users one by one)")
                users.append(harness_user(str(uid)))
        elif not item:
            raise LaunchError(f"run-as: an empty user name in {spec!r}")
        else:
            users.append(harness_user(item))
    if len(users) > MAX_HARNESS_USERS:
        raise LaunchError(f"run-as: at most {MAX_HARNESS_USERS} users")
    uids = [u.uid for u in users]
    if len(set(uids)) < len(uids):
        raise LaunchError(f"run-as: a user is named twice in {spec!r}")
    if sweeper_uid() in uids:
        raise LaunchError(f"run-as: uid {sweeper_uid()} is the one that ends the users' processes: name another")
    if os.geteuid() in uids:
        raise LaunchError(f"run-as: uid {os.geteuid()} is this controller's own: a harness would reach its memory, "
                          "and ending its run's processes would end the controller")
    if concurrency is not None and len(users) < concurrency:
        raise LaunchError(f"run-as: {len(users)} user(s) for {concurrency} concurrent runs: each run needs a user of "
                          f"its own (runs of one user read and signal each other); name {concurrency} (a uid range "
                          "FIRST-LAST of uids without users does) or lower the concurrency")
    return users


def _status(pid: str) -> dict[str, str]:
    """The fields of ``/proc/<pid>/status`` (name → value, stripped). Raises ``OSError`` for a process that is gone."""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in
                                         Path(f"/proc/{pid}/status").read_text().splitlines()) if _}


def _uids_of(pid: str) -> list[str] | None:
    """The real, effective, saved and filesystem uids of process ``pid`` (``/proc/<pid>/status``), or ``None`` for
    a process that is gone or has no live thread. A zombie thread-group leader is not a dead process: its main thread
    can leave with ``SYS_exit`` while its other threads run on (round 20: such a process outlived every sweep and
    read later runs' keys), so a process is dead only when every task of ``/proc/<pid>/task`` is."""
    try:
        fields = _status(pid)
        if fields.get("State", "").startswith(("Z", "X")) and not any(
                Path(f"/proc/{pid}/task/{task}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
                for task in os.listdir(f"/proc/{pid}/task")):
            return None
    except (OSError, ValueError, IndexError):
        return None
    return fields.get("Uid", "").split()


def user_processes(uids: Collection[int]) -> list[int]:
    """Pids of the live processes (a process with a live thread: zombies aside) that have one of ``uids`` (real,
    effective, saved or filesystem)."""
    wanted = {str(uid) for uid in uids}
    return [int(e.name) for e in os.scandir("/proc")
            if e.name.isdigit() and wanted.intersection(_uids_of(e.name) or ())]


#: The real and saved uid of the child that kills a user's processes (:func:`_kill_everything_of`) where this user
#: namespace maps it: one no process has, and no ``--run-as`` may name. With the user's own uid as its real uid, the
#: user's processes could signal that child: a process left behind that looped ``kill(-1, SIGSTOP)`` stopped it,
#: and the controller waited for it for ever (4 times in 10 in a probe, round 20). See :func:`sweeper_uid`.
SWEEPER_UID = 2**32 - 3
#: One child at a time: every sweeping child has the same real uid, so one's ``kill(-1)`` killed another that had
#: taken it but not yet sent its own (two runs ending at once: 4 lineages in 300 escaped, round 20).
_SWEEP_LOCK = threading.Lock()


@functools.cache
def sweeper_uid() -> int:
    """:data:`SWEEPER_UID` where this process's user namespace maps it, else the highest uid it maps (a rootless
    container's ``0 0 65536`` maps 65535): ``setresuid`` to an unmapped uid fails, and a sweep that could not take
    it did nothing (round 20). Raises :class:`LaunchError` if the namespace maps no uid but 0."""
    try:
        return sweeper_uid_in(Path("/proc/self/uid_map").read_text())
    except OSError:  # (no user namespaces: every uid is the machine's)
        return SWEEPER_UID


def sweeper_uid_in(uid_map: str) -> int:
    """:func:`sweeper_uid` for a ``/proc/<pid>/uid_map`` text (lines ``INSIDE OUTSIDE COUNT``)."""
    ranges = [(int(f[0]), int(f[0]) + int(f[2])) for f in (line.split() for line in uid_map.splitlines()) if len(f) == 3]
    if not ranges or any(lo <= SWEEPER_UID < hi for lo, hi in ranges):
        return SWEEPER_UID
    top = max(hi for _, hi in ranges) - 1
    if top <= 0:
        raise LaunchError("run-as: this user namespace maps no uid the controller could end the users' processes as")
    return top


def _kill_everything_of(uid: int) -> None:
    """SIGKILL every process of ``uid`` at one instant: a child of this process takes ``uid`` as its effective uid and
    calls ``kill(-1, SIGKILL)``, which the kernel delivers to every process whose real or saved uid is ``uid`` under
    one lock that ``fork`` also takes; a process that forks a successor and exits without pause (a new pid every
    ~100 µs) is never missed, as it was by a scan of ``/proc`` (round 20). The child's real and saved uid are
    :func:`sweeper_uid`, so no process of ``uid`` may signal it (stop it, kill it); one stopped or killed anyway is
    killed and tried again. One child at a time (:data:`_SWEEP_LOCK`). The child calls nothing but system calls
    before ``_exit`` (safe after ``fork`` in a threaded process). Needs root.
    Raises ``RuntimeError`` if the child cannot take those uids, or does not get its ``kill(-1)`` sent in 5 tries."""
    sweeper = sweeper_uid()
    with _SWEEP_LOCK:
        for _ in range(5):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 0
                try:
                    os.setgroups([])
                    os.setresuid(sweeper, uid, sweeper)
                except BaseException:  # noqa: BLE001 - (EINVAL: an unmapped uid) told by the exit code
                    os._exit(3)
                try:
                    for _ in range(3):
                        os.kill(-1, signal.SIGKILL)
                except BaseException:  # noqa: BLE001 - ESRCH: none left
                    pass
                os._exit(code)
            while True:
                _, status = os.waitpid(pid, os.WUNTRACED)
                if not os.WIFSTOPPED(status):
                    break
                os.kill(pid, signal.SIGKILL)  # (stopped: by whom it cannot be, but never wait on a stopped child)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
                raise RuntimeError(f"cannot take uid {uid} (real uid {sweeper}) to end its processes")
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                return
    raise RuntimeError(f"the processes of uid {uid} could not be ended at once (the ending child was killed 5 times)")


def end_user_processes(uids: Collection[int], rounds: int = 200) -> int:
    """Kill (SIGKILL) every process of the users ``uids`` (by real, effective, saved or filesystem uid) on this
    machine and return how many signals the scan sent. First each user kills all its processes at once
    (:func:`_kill_everything_of`); then ``/proc`` is scanned for what is left (a process with another uid among its
    four, one stuck): each is opened as a pidfd before its uids are read and is signalled through it, so a pid
    reused by another process meanwhile is never hit. Rounds repeat until one finds
    none (a process that forked between two scans is found by the next; one dying is seen again until it is a
    zombie); zombies are skipped, but not a zombie leader whose other threads live (:func:`_uids_of`): the signal
    to it kills them all. A process that outlives :data:`FUSE_ABORT_ROUND` rounds may wait on a FUSE filesystem it
    serves itself (mounted in a user and mount namespace of its own: SIGKILL cannot end that wait): such connections
    are aborted (:func:`_abort_own_fuse`). Needs the right to signal them (root).
    Raises ``RuntimeError`` if processes of ``uids`` remain after ``rounds`` rounds (~10 ms apart)."""
    wanted = {str(uid) for uid in uids}
    for uid in uids:
        _kill_everything_of(uid)
    sent = 0
    for round_no in range(rounds):
        found: list[int] = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fd = os.pidfd_open(int(entry.name))
            except OSError:  # gone already
                continue
            try:
                if wanted.intersection(_uids_of(entry.name) or ()):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    found.append(int(entry.name))
            except OSError:  # exited meanwhile
                pass
            finally:
                os.close(fd)
        sent += len(found)
        if not found:
            return sent
        if round_no % FUSE_ABORT_ROUND == FUSE_ABORT_ROUND - 1:
            _abort_own_fuse(found)
        time.sleep(0.01)
    raise RuntimeError(f"processes of uid {', '.join(sorted(wanted))} remain after {rounds} rounds of SIGKILL")


#: Every this many rounds of :func:`end_user_processes` with processes left, their own FUSE connections are aborted.
FUSE_ABORT_ROUND = 20
#: Where the kernel's FUSE control filesystem (``fusectl``) is mounted (mounted there when needed).
FUSE_CONNECTIONS = Path("/sys/fs/fuse/connections")


def _fuse_devices(mountinfo: str) -> set[int]:
    """The device numbers of the FUSE mounts listed in a ``/proc/<pid>/mountinfo`` text."""
    devices = set()
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] and (right.split()[0] == "fuse" or right.split()[0].startswith("fuse.")) and \
                len(fields) > 2:
            major, _, minor = fields[2].partition(":")
            with contextlib.suppress(ValueError):
                devices.add(os.makedev(int(major), int(minor)))
    return devices


def _abort_own_fuse(pids: list[int]) -> int:
    """Abort the FUSE connections mounted in the namespaces of ``pids`` that this process's own mount namespace does
    not hold (those a harness mounted in a namespace of its own; never the machine's, such as lxcfs), through
    ``fusectl`` (mounted at :data:`FUSE_CONNECTIONS` if it is not). Returns how many were aborted."""
    import subprocess

    try:
        ours = _fuse_devices(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return 0
    theirs: set[int] = set()
    for pid in pids:  # (every task's view: a zombie leader has none of its own)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    theirs |= _fuse_devices(Path(f"/proc/{pid}/task/{task}/mountinfo").read_text())
    theirs -= ours
    if not theirs:
        return 0
    if not os.path.ismount(FUSE_CONNECTIONS):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSE_CONNECTIONS)], capture_output=True, timeout=10)
    aborted = 0
    for dev in theirs:
        with contextlib.suppress(OSError):
            (FUSE_CONNECTIONS / str(dev) / "abort").write_text("1")
            aborted += 1
    return aborted


def reap_zombies_of(uids: Collection[int]) -> int:
    """Reap (``waitpid``) the zombie children of this process that belong to ``uids`` and return how many: a harness
    can make its processes this controller's children (``clone(CLONE_PARENT)``); killed by the sweep, they stayed
    zombies for ever (asyncio waits only for the pids it started): 100 after two runs, and a run could fill the
    machine's pid space (round 20). Call it once a user's processes are ended (:func:`end_user_processes`) and the
    run's own process has been waited for."""
    wanted = {str(uid) for uid in uids}
    me = str(os.getpid())
    reaped = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = _status(entry.name)
        except OSError:
            continue
        if fields.get("PPid") == me and fields.get("State", "").startswith("Z") and \
                wanted.intersection(fields.get("Uid", "").split()):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(int(entry.name), os.WNOHANG)[0]:
                    reaped += 1
    return reaped


class UserLocks:
    """An exclusive lock on each user of a pool, held while a controller uses them: two controllers of one machine
    given the same users would end each other's runs (:func:`end_user_processes`). The locks are ``flock``s on files
    of a directory only this (root) user may write (``/run/agl-run-as``, else one under the temporary directory,
    checked to be this user's and closed to others); they end with the process. Raises :class:`LaunchError` naming a
    user another controller holds, or a lock directory that is not this user's own."""

    def __init__(self, users: list[HarnessUser]):
        import fcntl

        self._fds: list[int] = []
        if not users:  # (no directory is made or checked without run-as users)
            return
        folder = _lock_dir()
        try:
            for user in users:
                fd = os.open(folder / f"uid-{user.uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                self._fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise LaunchError(f"run-as: {user.name} is in use by another controller of this machine (each "
                                      "controller needs users of its own)") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def _lock_dir() -> Path:
    """Where :class:`UserLocks` keeps its files: ``/run/agl-run-as`` (created 0700), else ``agl-run-as-{euid}``
    under the temporary directory; refused unless it is a directory of this user's that no one else can write."""
    import tempfile

    for folder in (Path("/run/agl-run-as"), Path(tempfile.gettempdir()) / f"agl-run-as-{os.geteuid()}"):
        with contextlib.suppress(OSError):
            folder.mkdir(mode=0o700, exist_ok=True)
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        import stat

        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise LaunchError(f"run-as: the lock directory {folder} is not this user's own (owner uid {st.st_uid}, "
                              f"mode {st.st_mode & 0o777:o}): remove it")
        return folder
    raise LaunchError("run-as: no directory for the users' locks (/run/agl-run-as, nor one under the temporary "
                      "directory)")


def check_user_runs(user: HarnessUser, command: list[str], cwd: str) -> None:
    """Check that ``user`` can enter ``cwd`` and execute ``command``'s program (found on ``PATH`` as the runs find
    it), by asking a shell run as that user. Raises :class:`LaunchError` naming what it cannot reach: an interpreter
    under ``/root`` (pyenv, a venv made from it) failed every run ``spawn_error`` (exec) or at its first import of
    the standard library (preload)."""
    import subprocess

    exe = shutil.which(command[0]) or command[0]
    # a Python script (``python x.py``; not ``-m``/``-c``) must be readable too: unreadable, every run failed as the
    # agent's own exit code 2, never retried
    script = command[1] if Path(exe).name.startswith("python") and len(command) > 1 \
        and not command[1].startswith("-") else ""
    probe = subprocess.run(["/bin/sh", "-c", 'cd "$1" || exit 3; test -x "$2" || exit 4; '
                            'test -z "$3" || test -r "$3" || exit 5', "sh", cwd, exe, script],
                           user=user.uid, group=user.gid, extra_groups=[], capture_output=True, timeout=30,
                           env={"PATH": "/usr/bin:/bin"})
    if probe.returncode == 3:
        raise LaunchError(f"run-as: {user.name} cannot enter the runs' working directory {cwd}")
    if probe.returncode == 5:
        raise LaunchError(f"run-as: {user.name} cannot read the harness script {script}")
    if probe.returncode != 0:
        raise LaunchError(f"run-as: {user.name} cannot execute {exe} (a directory on its path is closed to it: "
                          "use an interpreter and files that user can reach)")


def no_new_privileges() -> None:
    """Set ``PR_SET_NO_NEW_PRIVS`` on this process (inherited by every child, never undone): no program it or its
    children run gains privileges (setuid and setgid bits and file capabilities are ignored). A run's process that
    ran a setuid-and-setgid copy of a program left by a run of another pool user became that user, outlived its own
    sweep (no process of its user was left) and read that user's next run's key (round 20). Raises ``OSError``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _become(user: HarnessUser) -> None:
    """In a forked child, before it runs anything of the harness: drop to ``user`` (groups, then gid, then uid), with
    no new privileges (:func:`no_new_privileges`)."""
    no_new_privileges()
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)


class ExecProcess:
    """A harness started with ``exec`` (``asyncio`` subprocess in a new session)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self._proc = proc
        self.pid = proc.pid

    async def wait(self) -> int:
        """Exit code (``-N`` for signal N)."""
        return await self._proc.wait()


class ForkedProcess:
    """A harness forked from the preloading forkserver; its ``sentinel`` becomes readable at exit."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self._proc = proc
        self.pid = proc.pid

    async def wait(self) -> int:
        """Exit code (``-N`` for signal N); waits on the process sentinel without a thread."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        fd = self._proc.sentinel
        loop.add_reader(fd, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            loop.remove_reader(fd)
        self._proc.join()
        code = self._proc.exitcode
        self._proc.close()
        return code if code is not None else -signal.SIGKILL


def _drop_inherited_fds() -> None:
    """In the forked child: close every descriptor above stderr. The forkserver hands each child the write ends of
    its own alive pipe and of the resource tracker's pipe (``forkserver._serve_one``): one byte from a harness
    into the first killed the forkserver, and with it every running forked run (each ended ``exit_code:255``);
    a line into the second made the (controller's) tracker unlink any ``/dev/shm`` entry at exit; and a child
    that left the process group kept both alive past the controller (round 19). Their module references are
    cleared too, so nothing in this child writes to a number that now names another file."""
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver._forkserver_alive_fd = None
    resource_tracker._resource_tracker._fd = None
    limit = os.sysconf("SC_OPEN_MAX")  # (-1 where it has none)
    os.closerange(3, limit if limit > 3 else 1 << 16)


def _run_python(argv: list[str], env: dict[str, str], cwd: str | None, out_fd: int,
                user: HarnessUser | None = None) -> None:
    """In the forked child: become the harness (``argv = [python, script.py | -m module, args...]``), as ``user``
    if set (after its log is open)."""
    os.setsid()  # its own process group, like exec mode: the runner kills the group
    os.dup2(out_fd, 1)  # the run's log pipe (RunLog), never a file opened again by its path (round 20)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    if user is not None:
        _become(user)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _drop_inherited_fds()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    interrupted = False
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[1])
            sys.argv = [script, *argv[2:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except KeyboardInterrupt:  # (multiprocessing made it exit code 1: the agent's failure, where exec says signal:2)
        traceback.print_exc()
        interrupted = True
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends the child with os._exit: run the harness's atexit hooks
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    if interrupted:  # end as CPython ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


class _PassedFd:
    """A descriptor of this process handed to a forked run as itself: pickled for the forkserver with
    ``multiprocessing.reduction.DupFd`` (sent over its socket with ``SCM_RIGHTS``), a plain ``int`` in the run."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _PassedFd._detach, (reduction.DupFd(self.fd),)

    @staticmethod
    def _detach(dup) -> int:
        return dup.detach()


class RunLog:
    """One attempt's log: the run writes into a pipe (``write_fd``, its stdout and stderr) and a thread of the
    controller copies the pipe into the log file (``log_fd``, :func:`create_log`) up to ``limit`` bytes. A run that
    handed its descriptor to another process (a sibling run, a child) can write to the log only while the run's
    log is open: :meth:`close` ends the copy and closes the pipe, and later writes fail (``EPIPE``). With the log
    file itself as the runs' stdout, a run that passed it to a concurrent one over a socket had that one write into
    its log after it ended, past every size check (round 20).

    ``over`` turns true once the run wrote more than ``limit`` bytes (what comes after is read and dropped, so the
    run never blocks on a full pipe before it is stopped). Raises ``OSError`` if the pipe cannot be made."""

    def __init__(self, log_fd: int, limit: int):
        import threading

        self.log_fd = log_fd
        self.limit = limit
        self.written = 0
        self.over = False
        self._last = 0
        self._read_fd, self.write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="agl-run-log", daemon=True)
        self._thread.start()

    def _read_some(self, most: int = 1 << 16) -> bool | None:
        """Copy at most ``most`` bytes of what the pipe holds now: ``True`` if something was read (``_last`` bytes),
        ``False`` at its end (every writer gone), ``None`` if it is empty."""
        try:
            data = os.read(self._read_fd, most)
        except BlockingIOError:
            return None
        self._last = len(data)
        if not data:
            return False
        room = self.limit - self.written
        keep = data[:max(room, 0)]
        while keep:
            n = os.write(self.log_fd, keep)
            self.written += n
            keep = keep[n:]
        if len(data) > room:
            self.over = True
        return True

    def _copy(self) -> None:
        import select

        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        try:
            while not self._closing.is_set():
                if poller.poll(100) and self._read_some() is False:
                    return
            self._drain()
        except OSError:  # the log's disk: the run goes on, its log stops
            pass
        finally:
            os.close(self._read_fd)

    def _drain(self) -> None:
        """Copy exactly what the pipe holds now (``FIONREAD``): what the run wrote before it ended, and nothing a
        process left behind writes after (one writing without pause would keep a read-until-empty going for ever)."""
        import fcntl
        import termios

        held = bytearray(4)
        fcntl.ioctl(self._read_fd, termios.FIONREAD, held)
        left = int.from_bytes(held, sys.byteorder)
        while left > 0 and self._read_some(min(left, 1 << 16)):
            left -= self._last

    def started(self) -> None:
        """The run holds its own copy of ``write_fd`` now: this process's is closed (the pipe ends with the run's)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        """End the copy (after what the pipe holds now) and close the pipe: no one writes into this log any more.
        Blocks until the copy has ended (a bounded amount of work: the caller closes ``log_fd`` after it, and a
        descriptor closed while the thread still wrote was reused by the next run's log)."""
        self.started()
        self._closing.set()
        self._thread.join()


def create_log(log_path: Path) -> int:
    """Create an attempt's log file afresh (whatever was at ``log_path`` is unlinked first; a link is not followed)
    and return a descriptor of it, kept by the controller: the size it watches and the cut it makes are those of
    the file the run writes, even if the run unlinks or replaces the path. Raises ``OSError``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(log_path)
    return os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def _forkserver_alive() -> bool:
    """Whether this process's multiprocessing forkserver runs. Its pid is polled with ``WNOWAIT``: a dead one is
    left for ``ensure_running`` to reap (the stdlib has no public "is it running": its ``_forkserver_pid``)."""
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _start_forkserver(env: dict[str, str]) -> None:
    """Start this process's multiprocessing forkserver, exec'd with exactly ``env``; a no-op while it runs.

    The forkserver inherits the C-level environment, so that (and only that) is swapped for the duration of its
    start with ``os.putenv``/``os.unsetenv``: ``os.environ`` is never touched, so a reward function running in
    another thread of this process reads the controller's environment throughout (it once read the harness's).
    """
    from multiprocessing import forkserver

    if _forkserver_alive():
        return
    ours = dict(os.environ)  # what the C-level environment holds: every os.environ write goes through putenv
    try:
        for key in ours.keys() - env.keys():
            os.unsetenv(key)
        for key, value in env.items():
            os.putenv(key, value)
        forkserver.ensure_running()
    finally:
        for key in env.keys() - ours.keys():
            os.unsetenv(key)
        for key, value in ours.items():
            os.putenv(key, value)


def _check_python_target(command: list[str]) -> None:
    """:class:`LaunchError` if ``command`` runs Python (its program's name starts with ``python``) on a script that
    is neither a file nor a directory with a ``__main__.py``, or, when that Python is this interpreter (the
    controller's: the modules it finds are the harness's), on a top-level ``-m`` module not found from the working
    directory (as ``python -m`` looks: the working directory first; a dotted name would import its packages here,
    so it is not looked into). Other programs, and Python options before the target, are not looked into."""
    import importlib.util

    if not Path(command[0]).name.startswith("python") or len(command) < 2:
        return
    if command[1] == "-m" and len(command) > 2:
        exe = shutil.which(command[0]) or command[0]
        if Path(exe).resolve() != Path(sys.executable).resolve() or "." in command[2]:
            return
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(command[2]) is not None
        except (ImportError, ValueError):  # (a name find_spec refuses)
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise LaunchError(f"the harness module {command[2]!r:.80} is not found from {os.getcwd()}")
    elif not command[1].startswith("-") and not (Path(command[1]).is_file()
                                                 or (Path(command[1]) / "__main__.py").is_file()):
        raise LaunchError(f"the harness script {command[1]!r:.80} is not a file (from {os.getcwd()})")


def check_command(command: list[str], preload: list[str] | None = None, found: bool = False) -> None:
    """Raise :class:`LaunchError` if ``command`` (an argv) cannot be started as the :class:`Launcher` would: with
    ``preload``, a command other than ``PYTHON SCRIPT ...`` or ``PYTHON -m MODULE ...`` run by this process's own
    interpreter (the forkserver is this interpreter), without interpreter options; with ``found``, a program that is
    not found, and for a Python program (``python...``) a ``SCRIPT`` that is not a file or a ``-m MODULE`` not
    found from the working directory (else each run fails ``spawn_error`` or ``exit_code:1``, retried). The trainer
    and ``agl-controller run`` check with ``found`` before anything starts."""
    if not command:
        raise LaunchError("the harness command names no program")
    if found and not shutil.which(command[0]) and not (os.sep in command[0] and Path(command[0]).is_file()):
        raise LaunchError(f"the harness program {command[0]!r:.80} is not found (PATH, or a path from the working "
                          "directory)")
    if found:
        _check_python_target(command)
    if not [m for m in (preload or []) if m]:
        return
    if len(command) < 2 or (command[1] == "-m" and len(command) < 3):
        raise LaunchError(f"preload needs a Python command (python script.py ...), got {command}")
    if command[1].startswith("-") and command[1] != "-m":
        raise LaunchError(f"preload runs `python SCRIPT ...` or `python -m MODULE ...`; interpreter options "
                          f"({command[1]}) are not taken: drop them (PYTHONUNBUFFERED=1 for -u) or drop --preload")
    exe = command[0]
    resolved = Path(exe if os.sep in exe else (shutil.which(exe) or exe))
    if resolved.absolute() != Path(sys.executable).absolute() and \
            resolved.resolve() != Path(sys.executable).resolve():
        raise LaunchError(f"preload forks this controller's Python ({sys.executable}); the command runs "
                          f"{exe}: use the same interpreter or drop --preload")


class Launcher:
    """Starts harness processes for :class:`agl_controller.local.LocalRunner`.

    Args:
        command: the harness argv.
        preload: modules to import once and fork every attempt from (empty: ``exec`` each attempt).
        env: with ``preload``, the whole environment the forkserver is started with (None: this process's).
            Each forked run's ``os.environ`` is its attempt's, but its ``/proc/self/environ`` (what any of its
            subprocesses can read as ``/proc/$PPID/environ``) is the forkserver's: pass only what every run may
            see (the controller passes its allow-listed variables, never ``AGL_KEY`` or a Redis URL).

    Raises :class:`LaunchError` if ``preload`` is set and the command is not ``PYTHON SCRIPT.py ...`` or
    ``PYTHON -m MODULE ...`` run by this controller's own interpreter (the forkserver is this interpreter).
    """

    def __init__(self, command: list[str], preload: list[str] | None = None, env: dict[str, str] | None = None):
        self.command = list(command)
        self.preload = [m for m in (preload or []) if m]
        self._ctx = None
        check_command(self.command, self.preload)
        if self.preload:
            import importlib

            for module in self.preload:  # imported here first: the forkserver skips an ImportError silently and
                try:  # dies of anything else, and every later start would fail
                    importlib.import_module(module)
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - ImportError, a sys.exit(), whatever
                    raise LaunchError(f"preload: cannot import {module!r} ({type(exc).__name__}: {exc})") from None
            self._ctx = multiprocessing.get_context("forkserver")
            self._ctx.set_forkserver_preload([__name__, *self.preload])
        self._env = env
        if self._ctx is not None and env is not None:
            _start_forkserver(env)

    @property
    def mode(self) -> str:
        return "preload" if self.preload else "exec"

    async def start(self, env: dict[str, str], cwd: str | None, out_fd: int,
                    user: HarnessUser | None = None) -> ExecProcess | ForkedProcess:
        """Start one attempt with ``env`` (the whole environment), ``cwd`` and stdout+stderr to the open descriptor
        ``out_fd`` (:class:`RunLog`'s pipe: handed over as it is, never a path another user could have swapped for a
        link), as ``user`` if given (no supplementary groups).

        Raises ``OSError`` (e.g. :class:`LaunchError`, ``FileNotFoundError``) if it cannot start.
        """
        if self._ctx is None:
            proc = await asyncio.create_subprocess_exec(
                    *self.command, env=env, stdout=out_fd, stderr=out_fd, stdin=asyncio.subprocess.DEVNULL,
                    cwd=cwd, start_new_session=True,
                    **({"user": user.uid, "group": user.gid, "extra_groups": []} if user else {}))
            return ExecProcess(proc)
        if self.command[1] != "-m":
            script = Path(cwd or ".") / self.command[1]
            if not script.is_file():
                raise FileNotFoundError(f"harness script {script} not found")
        proc = self._ctx.Process(target=_run_python, args=(self.command, env, cwd, _PassedFd(out_fd), user),
                                 daemon=False)
        if self._env is not None:
            # a forkserver that died (killed by a harness, the OOM killer) is started again by the next
            # ``proc.start()`` from this process's whole environment: start it here, with ``env`` only, first
            _start_forkserver(self._env)
        await asyncio.to_thread(proc.start)  # the first start launches the forkserver and imports ``preload``
        return ForkedProcess(proc)
