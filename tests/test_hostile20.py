"""Round 20 of hostile input (docs/operations.md, "A twentieth round"): what round 19 left open — harness runs that
shared one user, a primary group 0, the engine's key in its own error messages. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
from agl_common.schemas import Rollout
from agl_controller.local import LocalRunner
from agl_controller.spawn import (LaunchError, UserLocks, end_user_processes, harness_user, harness_users,
                                  user_processes)

from fakes import Served, fake_upstream
from test_controller import gateway_url  # noqa: F401 (fixture)
from test_gateway import MSG, gateway, make_rollout
from test_hostile19 import as_root, open_dir

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = ROOT / "tests" / "harnesses"


def free_uids(n: int, start: int = 61000) -> tuple[int, int]:
    """``n`` consecutive uids from ``start`` that name no user (as a range of ``--run-as`` must)."""
    first = start
    while True:
        uids = range(first, first + n)
        taken = [u for u in uids if _user_exists(u)]
        if not taken:
            return uids[0], uids[-1]
        first = taken[-1] + 1


def _user_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def build(name: str, folder: Path) -> Path:
    """``tests/harnesses/{name}.c`` built into ``folder`` (one other users can enter); skips without a C compiler."""
    import shutil

    if not shutil.which("cc"):
        pytest.skip(f"no C compiler to build tests/harnesses/{name}.c")
    exe = folder / name
    subprocess.run(["cc", "-O1", "-pthread", "-o", str(exe), str(HARNESSES / f"{name}.c")], check=True,
                   capture_output=True, timeout=120)
    return exe

@as_root
@pytest.mark.parametrize("preload", [[], ["json"]], ids=["exec", "preload"])
async def test_each_concurrent_run_is_a_user_of_its_own_and_leaves_no_process(store, gateway_url, preload,  # noqa: F811
                                                                             monkeypatch):
    """With ``--run-as nobody`` every run was ``nobody``: a run read its sibling's ``/proc/<pid>/environ`` (its scoped
    key, its input) and could signal it, and a child that left its process group (``setsid``) lived on as that user
    into every later run. Now each concurrent run becomes a user of its own (a range of uids without users here),
    and every process of that user is ended when the run ends, before the user runs anything else."""
    if preload:
        from multiprocessing import forkserver
        forkserver._forkserver._stop()
        monkeypatch.setattr("agl_controller.local.check_user_runs", lambda *a: None)  # (see test_hostile19)
    first, last = free_uids(2)
    with open_dir(0o777) as shared:
        command = [sys.executable, str(HARNESSES / "sibling.py")] if preload else [str(HARNESSES / "sibling.sh")]
        runner = LocalRunner(store, gateway_url, command, "m", key="k3y", log_dir=shared / "logs", preload=preload,
                             run_as=f"{first}-{last}", cwd=str(ROOT), concurrency=2)
        for rid in ("s1", "s2"):
            await store.create_rollout(Rollout(rollout_id=rid, input={"dir": str(shared)},
                                               env_map={"PROBE_DIR": "dir"}))
        await asyncio.gather(runner.run_one(await store.pop_queued()), runner.run_one(await store.pop_queued()))
        logs = "".join(p.read_text() for p in (shared / "logs").glob("*"))
        for rid in ("s1", "s2"):
            assert (await store.get_rollout(rid)).failure == "no_model_calls", logs
        uids = {int((shared / f"{rid}.uid").read_text()) for rid in ("s1", "s2")}
        assert uids == {first, last}, (uids, logs)
        assert {(shared / f"{rid}.sibling").read_text().strip() for rid in ("s1", "s2")} == {"unreadable"}, logs
        assert not user_processes({first, last})  # the setsid children are gone
        # the users went back to the pool: a third run gets one again
        await store.create_rollout(Rollout(rollout_id="s3", input={"dir": str(shared), "alone": True},
                                           env_map={"PROBE_DIR": "dir", "ALONE": "alone"}))
        await runner.run_one(await store.pop_queued())
        assert int((shared / "s3.uid").read_text()) in {first, last}
        assert not user_processes({first, last})


def test_run_as_names_a_user_per_concurrent_run_and_nothing_doubtful(monkeypatch):
    """The users of ``--run-as`` / ``harness_user``: names, uids and ranges ``FIRST-LAST`` of uids without users; at
    least one per concurrent run. A range over a named user (whose logins its runs' end would kill), a uid whose own
    group names a group, a user twice, an empty range, root, this controller's own uid, or a user whose primary
    group is 0: refused, naming it."""
    first, last = free_uids(3)
    if os.geteuid() == 0:
        users = harness_users(f"nobody,{first}-{last}", concurrency=4)
        assert [u.uid for u in users] == [pwd.getpwnam("nobody").pw_uid, first, first + 1, last]
        anonymous = users[1]
        assert (anonymous.gid, anonymous.home) == (first, "/nonexistent")
        with pytest.raises(LaunchError, match="1 user.s. for 4 concurrent runs"):
            harness_users("nobody", concurrency=4)
        with pytest.raises(LaunchError, match="is the user 'root'"):
            harness_users("0-3")
        with pytest.raises(LaunchError, match="named twice"):
            harness_users(f"nobody,{pwd.getpwnam('nobody').pw_uid}")
        with pytest.raises(LaunchError, match="is empty"):
            harness_users(f"{last}-{first}")
        with pytest.raises(LaunchError, match="empty user name"):
            harness_users("nobody,,")
        with pytest.raises(LaunchError, match="at most"):
            harness_users(f"{first}-{first + 5000}")
        with pytest.raises(LaunchError, match="ends the users' processes"):
            harness_users(str(2**32 - 3))
        import grp
        grouped = next((g.gr_gid for g in grp.getgrall() if g.gr_gid > 0 and not _user_exists(g.gr_gid)), None)
        if grouped is not None:
            with pytest.raises(LaunchError, match="must name no group"):
                harness_user(str(grouped))
        wheelie = pwd.struct_passwd(("wheelie", "x", last + 1, 0, "", "/nonexistent", "/bin/sh"))  # (in group 0)
        monkeypatch.setattr(pwd, "getpwnam", lambda name: wheelie)
        with pytest.raises(LaunchError, match="group 0"):
            harness_user("wheelie")
    else:
        with pytest.raises(LaunchError, match="this controller's own"):
            harness_users(str(os.geteuid()))


@as_root
def test_users_are_locked_per_controller_and_their_leftovers_ended():
    """Two controllers of one machine given the same users would end each other's runs: the second is refused
    while the first holds them. What a controller that died left running as its users (here: a process that keeps
    forking) is ended — and nothing of any other user."""
    first, last = free_uids(2, start=61100)
    users = harness_users(f"{first}-{last}")
    locks = UserLocks(users)
    try:
        with pytest.raises(LaunchError, match="in use by another controller"):
            UserLocks(users[1:])
    finally:
        locks.close()
    UserLocks(users).close()  # free again

    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left = subprocess.Popen(["/bin/sh", "-c", "while true; do sleep 30 & sleep 0.01; done"], user=first, group=first,
                            extra_groups=[], start_new_session=True)
    try:
        time.sleep(0.5)
        assert user_processes({first})
        end_user_processes([first, last])
        assert not user_processes({first, last})
        assert ours.poll() is None
    finally:
        ours.kill()
        ours.wait()
        left.wait(timeout=10)


@as_root
def test_a_controller_refuses_users_another_holds_in_one_line(tmp_path):
    first, last = free_uids(2, start=61200)
    locks = UserLocks(harness_users(f"{first}-{last}"))
    try:
        ctl = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--mode", "local", "--command", "true",
                              "--concurrency", "2", "--run-as", f"{first}-{last}", "--log-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        locks.close()
    assert ctl.returncode == 2 and "in use by another controller" in ctl.stderr, ctl.stderr[-2000:]
    assert "Traceback" not in ctl.stderr


async def test_the_engines_key_never_reaches_the_agent_in_what_the_engine_says(store, redis_url, prefix):
    """An engine (or a proxy before it) that echoes the request's ``Authorization`` in its error messages handed the
    agent the key that opens every route of the engine: the gateway relays an engine's 400 message and a stream's
    error event as the engine wrote them. The key is masked in every body the gateway sends; and (round 20's prober)
    so is a prefix of it where the gateway cut a long message inside the key (1000 characters for an error, 300 for
    an event), and a key holds no character a quoting would escape (a repr'd message doubled a backslash), is 16
    characters at least (a short one, ``a`` or ``assistant-9f8e``, masked the words of every answer: round 20's
    third prober), and does not begin with 16 characters of a JSON number (a masked number would break an
    answer)."""
    from agl_gateway.settings import GatewaySettings
    from pydantic import ValidationError

    key = "ek-0123456789abcdefghijklmnopqrstuvwxyz"
    app = fake_upstream()
    await make_rollout(store, "r1")
    seen = []
    with Served(app) as up, gateway(redis_url, prefix, up.url, upstream_key=key) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for pad in (0, 975, 1000 - len("Bearer ") - len(key) + 1, 1000 - len("Bearer ") - 16):
                said = "x" * pad + f"Bearer {key}"
                app.state.plan = ("body", 400, orjson.dumps({"error": {"message": said}}))
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
                assert r.status_code == 400 and "Bearer ek-0123" not in r.text and "Bearer ***" in r.text, r.text
                assert len(r.content) == int(r.headers["content-length"])
                seen.append(r.text)
            app.state.plan = ("body", 400, orjson.dumps({"error": {"message": {"authorization": f"Bearer {key}"}}}))
            seen.append((await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)).text)
            for pad in (0, 270):
                event = {"error": {"message": "y" * pad + f"Bearer {key}"}}
                app.state.plan = ("stream", [b"data: " + orjson.dumps(event) + b"\n\n"], "done")
                s = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={**MSG, "stream": True})
                assert "Bearer ***" in s.text, s.text
                seen.append(s.text)
    assert not [t for t in seen if key[:16] in t], seen
    # (round 20's second prober) the call records kept the engine's message whole: the dashboard and exports showed it
    errors = [c.error for c in await store.read_calls("r1")]
    assert len(errors) == len(seen) and all(errors) and not [e for e in errors if key[:16] in e], errors
    for bad in ('engine-s3cret"key-0123', "ek\\slash-0123456789", "k ey-0123456789abcd", "ké-0123456789abcdef",
                "ek:colon-0123456789", "1234567890123456abc", "1e-5.00000000000xyz", "a", "assistant-9f8e7"):
        with pytest.raises(ValidationError):
            GatewaySettings(upstream="http://127.0.0.1:1", upstream_key=bad)
    from agl_gateway.upstream import mask_key
    answer = b'{"role":"assistant","content":"assistant-9f8e7 is not the key"}'
    assert mask_key(answer, b"assistant-9f8e7d0c") == answer  # (no word of an answer is 16 characters of a key)



@as_root
async def test_a_named_user_with_processes_of_its_own_is_refused_not_swept(store, gateway_url, tmp_path):  # noqa: F811
    """Every process of a run's user is ended with the run (and, for a range's uids, at start): a named user that
    already runs something (``nobody`` runs daemons on many machines) is not the controller's to sweep. It is refused
    when the controller starts, naming the processes, and the process lives on."""
    nobody = pwd.getpwnam("nobody")
    daemon = subprocess.Popen(["/bin/sleep", "60"], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[])
    try:
        runner = LocalRunner(store, gateway_url, ["/bin/true"], "m", log_dir=tmp_path, run_as="nobody",
                             concurrency=1, cwd="/")
        with pytest.raises(LaunchError, match=rf"process\(es\) \[.*{daemon.pid}.*\] already run as"):
            await runner.run_forever(asyncio.Event())
        assert daemon.poll() is None
    finally:
        daemon.kill()
        daemon.wait()


def test_harness_user_names_enough_users_before_anything_starts(tmp_path):
    """A training config's ``harness_user`` is a string of ``--run-as`` or a YAML list of the same; fewer users than
    ``concurrency`` (32 by default) is one line and exit 2 before any service starts."""
    from agl_trainer.config import TrainConfig

    assert TrainConfig(harness_user=["nobody", 61000, "61001-61002"]).harness_user == "nobody,61000,61001-61002"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("harness_user: nobody\nsteps: 1\n")
    run = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    if os.geteuid() == 0:
        assert "harness_user: 1 user(s) for 32 concurrent runs" in run.stdout + run.stderr
    assert "starting vLLM" not in run.stdout and "Traceback" not in run.stderr


async def test_a_reward_posted_while_the_outcome_is_written_is_not_lost(store, monkeypatch):
    """(Left open by round 18.) A reward posted (HTTP 200) in the moment between the controller's read of the
    rollout and its write of the outcome left the rollout ``failed no_reward`` with the reward stored beside it.
    The outcome is decided again on the rollout it writes."""
    from agl_common.schemas import CallRecord, RolloutStatus
    from agl_controller.base import Runner

    await store.create_rollout(Rollout(rollout_id="late", status=RolloutStatus.running), enqueue=False)
    await store.record_call(CallRecord(rollout_id="late", attempt_id="0", seq=-1, route="chat", request={},
                                       response={}))
    runner = Runner(store)
    update = store.update_rollout
    posted = []

    async def post_then_update(rid, change, **kw):
        if not posted:  # the harness's left-behind process posts its reward here (as the gateway's route does)
            posted.append(await update(rid, lambda r: setattr(r, "reward", 0.75)))
        return await update(rid, change, **kw)

    monkeypatch.setattr(store, "update_rollout", post_then_update)
    got = await runner.finish_attempt("late", "0", None)
    assert posted and (got.status, got.failure, got.reward) == (RolloutStatus.succeeded, None, 0.75), got


def test_the_dashboard_reads_a_group_by_its_registration_only(redis_url, prefix, tmp_path):
    """(Left open by round 18.) A group named by a run's metrics but not registered (a hand-edited metrics.jsonl)
    made the dashboard read every rollout of the prefix to find its members by their ``group_id``. Such a group's
    page is a 404 naming it, and the step page lists it with no rollouts."""
    import json

    from agl_trainer.ui.server import create_app
    from test_hostile18_ui import _seed_group

    asyncio.run(_seed_group(redis_url, prefix, "reg", [1.0, 0.0]))
    d = tmp_path / "demo" / "run1"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "groups": ["reg", "unreg"]}) + "\n")

    async def seed_unregistered():  # a rollout that names the group, as `rollouts create --group` makes one
        from agl_common.store import Store
        store = Store(redis_url, prefix)
        try:
            await store.create_rollout(Rollout(rollout_id="unreg-0", group_id="unreg"), enqueue=False)
        finally:
            await store.close()

    asyncio.run(seed_unregistered())
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        step = httpx.get(f"{ui.url}/runs/run1/steps/1", timeout=60)
        assert step.status_code == 200 and "unreg" in step.text and "unreg-0" not in step.text, step.text[-3000:]
        page = httpx.get(f"{ui.url}/runs/run1/steps/1/groups/unreg", timeout=60)
        assert page.status_code == 404 and "No group &#39;unreg&#39; is registered" in page.text, page.text[:500]
        reg = httpx.get(f"{ui.url}/runs/run1/steps/1/groups/reg", timeout=60)
        assert reg.status_code == 200 and 'data-rollout="reg-0"' in reg.text


ZOMBIE_LEADER = """import ctypes, os, sys, threading, time
def work():
    while True:
        with open(sys.argv[1], "w") as f:
            f.write(str(time.time()))
        time.sleep(0.05)
threading.Thread(target=work).start()
time.sleep(0.1)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread leaves, the process lives on in its other thread
"""


@as_root
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a Python another user can run")
def test_a_process_whose_leader_thread_left_is_ended_too():
    """(Round 20's prober.) A process whose main thread leaves with ``SYS_exit`` shows ``State: Z`` while its other
    threads run: the sweep skipped it as a zombie, and it read later runs' ``/proc/<pid>/environ`` (their scoped
    keys) and killed them. It counts as alive while any of its tasks is, and is killed."""
    uid, _ = free_uids(1, start=61300)
    with open_dir(0o777) as shared:
        marker = shared / "alive"
        proc = subprocess.Popen(["/usr/bin/python3", "-c", ZOMBIE_LEADER, str(marker)], user=uid, group=uid,
                                extra_groups=[], start_new_session=True, cwd="/")
        try:
            deadline = time.monotonic() + 10
            while "Z" not in Path(f"/proc/{proc.pid}/status").read_text().split("State:")[1][:4]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert user_processes([uid]) == [proc.pid]
            end_user_processes([uid])
            assert user_processes([uid]) == []
            before = marker.read_text()
            time.sleep(0.3)
            assert marker.read_text() == before  # its thread is gone too
        finally:
            proc.kill()
            proc.wait()


def test_run_as_takes_ascii_digits_only():
    """(Round 20's prober.) ``²`` passed ``str.isdigit`` and ``int`` refused it (a traceback); Arabic-Indic digits
    were read as a uid."""
    for spec in ("²", "61000-6100²", "٦١٠٠٠"):
        with pytest.raises(LaunchError, match="no user"):
            harness_users(spec)


@pytest.mark.parametrize("preload", [[], ["json"]], ids=["exec", "preload"])
async def test_a_log_swapped_for_a_link_is_not_followed(store, gateway_url, preload, tmp_path, monkeypatch):  # noqa: F811
    """(Round 20's prober.) The controller created each log with ``O_EXCL | O_NOFOLLOW`` and then opened it again by
    its path, as root, following links and truncating (exec: ``open(path, "wb")``; preload: in the forked run,
    before it became the harness user). A harness user that could write the log directory swapped a sibling's new
    log for a link to ``/etc/passwd`` between the two and had root write its output there. The run now gets the
    descriptor the controller created (the forked run through the forkserver's socket), and no path is opened
    again; here the swap is made at the worst moment, every time."""
    from agl_controller import spawn

    if preload:
        from multiprocessing import forkserver
        forkserver._forkserver._stop()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    script = tmp_path / "loud.py"
    script.write_text("print('written by the harness')\n")

    def swapped(path):
        fd = spawn.create_log(path)
        os.unlink(path)
        os.symlink(victim, path)
        return fd

    monkeypatch.setattr("agl_controller.local.create_log", swapped)
    runner = LocalRunner(store, gateway_url, [sys.executable, str(script)], "m", log_dir=tmp_path / "logs",
                         preload=preload, cwd=str(tmp_path))
    await store.create_rollout(Rollout(rollout_id="loud", input={}))
    await runner.run_one(await store.pop_queued())
    assert (await store.get_rollout("loud")).failure == "no_model_calls"
    assert victim.read_text() == "precious\n"


@as_root
def test_run_as_refuses_a_log_directory_others_can_write(tmp_path):
    """(Round 20's prober.) With ``--run-as`` a log directory the harness users could write (``--log-dir /tmp/x``
    made by an earlier run's user, or mode 0777) let one run remove or replace another's log."""
    first, last = free_uids(1, start=61400)
    for mode in (0o777, 0o775):
        logs = tmp_path / f"logs{mode:o}"
        logs.mkdir()
        logs.chmod(mode)
        with pytest.raises(LaunchError, match="no one else can write"):
            LocalRunner(None, "http://127.0.0.1:1", ["/bin/true"], "m", log_dir=logs, run_as=str(first),
                        concurrency=1, cwd="/")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, first, first)
    with pytest.raises(LaunchError, match="no one else can write"):
        LocalRunner(None, "http://127.0.0.1:1", ["/bin/true"], "m", log_dir=theirs, run_as=str(first),
                    concurrency=1, cwd="/")
    LocalRunner(None, "http://127.0.0.1:1", ["/bin/true"], "m", log_dir=tmp_path / "new", run_as=str(first),
                concurrency=1, cwd="/")


@as_root
async def test_a_user_whose_processes_cannot_be_ended_is_set_aside(store, gateway_url, tmp_path,  # noqa: F811
                                                                    monkeypatch):
    """(Round 20's probers.) A user whose processes outlived every round of the sweep was kept out of the pool for
    good; once every user was out, claimed rollouts waited for one for ever. Such a user is set aside and the runs go
    on with the rest of the pool; with none left the controller stops (its running rollouts are handed back)."""
    first, last = free_uids(2, start=61500)
    calls = []

    def stuck(uids):
        calls.append(list(uids))
        if len(calls) > 1:  # (the first call is the start's sweep)
            raise RuntimeError(f"processes of uid {uids[0]} remain after 200 rounds of SIGKILL")
        return 0

    monkeypatch.setattr("agl_controller.local.end_user_processes", stuck)
    runner = LocalRunner(store, gateway_url, ["/bin/true"], "m", log_dir=tmp_path / "logs", run_as=f"{first}-{last}",
                         concurrency=1, cwd="/")
    for rid in ("one", "two"):
        await store.create_rollout(Rollout(rollout_id=rid))
    stop = asyncio.Event()
    await asyncio.wait_for(runner.run_forever(stop), 60)
    assert stop.is_set() and sorted(c[0] for c in calls[1:]) == [first, last]
    for rid in ("one", "two"):
        assert (await store.get_rollout(rid)).failure == "no_model_calls"


@as_root
def test_a_process_stuck_on_its_own_fuse_filesystem_is_ended(tmp_path):
    """(Round 20's second prober.) A harness in a user and mount namespace of its own (unprivileged, where the
    machine allows them and ``/dev/fuse`` is open to all) mounted a FUSE filesystem it served itself and never
    answered one of its own lookups: that thread waited uninterruptibly, SIGKILL could not end the process, the sweep
    gave up and the user was lost (and a new controller could not start). The sweep aborts such connections."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK) or os.stat("/dev/fuse").st_mode & 0o006 != 0o006:
        pytest.skip("/dev/fuse is not open to other users here: a harness cannot mount FUSE")
    uid, _ = free_uids(1, start=61700)
    with open_dir(0o755) as folder:  # (tmp_path's parents are closed to other users)
        exe = build("fuse_stuck", folder)
        with open(folder / "out", "w") as log:  # (not a pipe: the stuck child would hold it open)
            subprocess.run([str(exe)], user=uid, group=uid, extra_groups=[], stdout=log, stderr=log, timeout=30,
                           cwd="/")
        deadline = time.monotonic() + 10
        while "not answering" not in (said := (folder / "out").read_text()):
            if "unshare" in said or "mount fuse" in said or "/dev/fuse" in said:
                pytest.skip(f"this machine refuses the FUSE harness: {said.strip()[:200]}")
            assert time.monotonic() < deadline, said
            time.sleep(0.1)
    assert user_processes([uid])  # its lookup waits on itself: once killed, uninterruptibly
    end_user_processes([uid])
    assert user_processes([uid]) == []


def test_a_controller_without_run_as_users_makes_no_lock_directory(monkeypatch):
    """Every local controller takes its users' locks at start: without ``--run-as`` it must not make (or check, and
    refuse over) a lock directory: a non-root controller would fall back to one under ``/tmp`` that anyone can
    squat."""
    def no(*a):
        raise AssertionError("the lock directory was looked for")

    monkeypatch.setattr("agl_controller.spawn._lock_dir", no)
    UserLocks([]).close()


CLONE_PARENT = """import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
for _ in range(20):  # clone(CLONE_PARENT | SIGCHLD): a child of the harness's parent, the controller
    if libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0) == 0:
        os._exit(0)
if libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0) == 0:
    time.sleep(60)  # (one still running when the run ends: the sweep kills it)
    os._exit(0)
time.sleep(0.3)
"""


def zombies_of_mine(uid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            f = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if f["PPid"].strip() == str(os.getpid()) and f["State"].strip().startswith("Z") and \
                    f["Uid"].split()[0] == str(uid):
                found.append(int(entry.name))
    return found


@as_root
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a Python another user can run")
async def test_processes_a_run_made_the_controllers_children_are_reaped(store, gateway_url, tmp_path):  # noqa: F811
    """(Round 20's second prober.) A harness can make its processes the controller's own children
    (``clone(CLONE_PARENT)``); exited or killed by the sweep they stayed zombies of the controller for ever (asyncio
    waits only for the pids it started): a run could fill the machine's pid space. They are reaped with the sweep."""
    uid, _ = free_uids(1, start=61600)
    runner = LocalRunner(store, gateway_url, ["/usr/bin/python3", "-c", CLONE_PARENT], "m", log_dir=tmp_path / "logs",
                         run_as=str(uid), concurrency=1, cwd="/")
    await store.create_rollout(Rollout(rollout_id="cp"))
    await runner.run_one(await store.pop_queued())
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
    assert (await store.get_rollout("cp")).failure == "no_model_calls", logs
    assert zombies_of_mine(uid) == [] and user_processes([uid]) == []


async def test_a_log_takes_nothing_after_its_run_ended(store, gateway_url, tmp_path):  # noqa: F811
    """(Round 20's second prober.) Every run's stdout was its log file itself: a run that handed that descriptor to
    a concurrent run (a socket) or to a child that outlived it had that process write into its log after it ended,
    past every size check (2 MB of forged lines in a probe). A run now writes into a pipe the controller copies
    into its log; when the run ends the pipe is closed and what is left behind writes to it no more."""
    late = "(setsid sh -c 'sleep 1; echo FORGED; echo FORGED >&2' < /dev/null &); echo from the run; exit 0"
    runner = LocalRunner(store, gateway_url, ["/bin/sh", "-c", late], "m", log_dir=tmp_path / "logs", cwd="/")
    await store.create_rollout(Rollout(rollout_id="late-log"))
    await runner.run_one(await store.pop_queued())
    assert (await store.get_rollout("late-log")).failure == "no_model_calls"
    await asyncio.sleep(2.0)
    (log,) = (tmp_path / "logs").glob("*")
    assert log.read_text() == "from the run\n", log.read_text()



def _pids_per_second() -> float:
    """New pids the machine makes per second now (the kernel's last pid, ``/proc/loadavg``, over 0.5 s)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    first = int(Path("/proc/loadavg").read_text().split()[-1])
    time.sleep(0.5)
    return ((int(Path("/proc/loadavg").read_text().split()[-1]) - first) % pid_max) * 2


@as_root
def test_a_process_that_forks_a_successor_and_exits_without_pause_is_ended():
    """(Round 20's third prober.) A process that forks a successor and exits, again and again, is never where a scan
    of ``/proc`` looks for it: every sweep found none and gave the user back while the lineage lived on, and it read
    the next runs' keys. Each user now kills all its processes at one instant (``kill(-1)``, which ``fork`` cannot
    outrun) before the scan."""
    uid, _ = free_uids(1, start=61800)
    with open_dir(0o755) as folder:
        exe = build("hopper", folder)
        subprocess.run([str(exe), "1", "20"], user=uid, group=uid, extra_groups=[], timeout=30, cwd="/")
        time.sleep(0.3)
        try:
            assert _pids_per_second() > 1000  # (the lineages hop)
            end_user_processes([uid])
            assert _pids_per_second() < 500, "the lineage lives on"
        finally:
            for _ in range(100):  # (without the fix: end it for the next tests, as root cannot miss it either)
                subprocess.run(["/bin/sh", "-c", "true"], preexec_fn=lambda: (os.setresuid(uid, uid, uid),
                                                                               os.kill(-1, 9)))
                if _pids_per_second() < 500:
                    break


async def test_a_run_that_wrote_past_its_log_limit_and_exited_at_once_is_log_limit(store, gateway_url, tmp_path):  # noqa: F811
    """(Round 20's third prober.) A run that wrote past ``max_log_bytes`` and exited before the next size check got
    its own exit's outcome, and its log was cut without the line saying so."""
    spew = "head -c 300000 /dev/zero | tr '\\0' x; exit 0"
    runner = LocalRunner(store, gateway_url, ["/bin/sh", "-c", spew], "m", log_dir=tmp_path / "logs", cwd="/",
                         max_log_bytes=1000)
    await store.create_rollout(Rollout(rollout_id="spew"))
    await runner.run_one(await store.pop_queued())
    assert (await store.get_rollout("spew")).failure == "log_limit"
    (log,) = (tmp_path / "logs").glob("*")
    text = log.read_text()
    assert text.startswith("x" * 1000) and text[1000:].strip().startswith("[agl-controller: log cut at 1000 bytes")


def test_closing_a_run_log_waits_for_its_copy_to_end(tmp_path, monkeypatch):
    """(Round 20's third prober.) Closing a run's log waited 5 s for its copy at most, then the controller closed the
    log's descriptor while the copy still wrote: the next run's log got that number, and half of this run's output.
    The close waits for the copy, which copies what the pipe holds at the close and no more."""
    import fcntl

    from agl_controller.spawn import RunLog, create_log

    real = RunLog._read_some

    def slow(self, most=1 << 16):  # (a slow disk, or a copy thread starved of the GIL)
        time.sleep(1.5)
        return real(self, most)

    monkeypatch.setattr(RunLog, "_read_some", slow)
    fd = create_log(tmp_path / "x.log")
    log = RunLog(fd, 1 << 30)
    fcntl.fcntl(log.write_fd, 1031, 1 << 20)  # F_SETPIPE_SZ: room for what is written below
    os.write(log.write_fd, b"z" * (4 * 65536))
    log.close()
    assert not log._thread.is_alive()
    os.close(fd)
    assert (tmp_path / "x.log").stat().st_size == 4 * 65536


@as_root
def test_a_process_left_behind_cannot_stop_the_sweep():
    """(Round 20's fourth prober.) The child that kills a user's processes took that uid as its real one: a process
    left behind that sent SIGSTOP to every process of its user without pause stopped it, and the controller waited
    for it for ever (4 sweeps in 10; the run stayed ``running``, its slot and user lost). The child's real and saved
    uid are now one no process of the user has, so none of them may signal it."""
    import threading

    uid, _ = free_uids(1, start=61900)
    with open_dir(0o755) as folder:
        exe = build("stopper", folder)
        try:
            for _ in range(6):
                harness = subprocess.Popen([str(exe)], user=uid, group=uid, extra_groups=[], cwd="/")
                time.sleep(0.2)  # (its child may have stopped it already: it is of the same user)
                sweep = threading.Thread(target=end_user_processes, args=([uid],), daemon=True)
                sweep.start()
                sweep.join(15)
                assert not sweep.is_alive(), "the sweep was stopped"
                assert user_processes([uid]) == []
                harness.wait(10)
        finally:  # (without the fix: free the stopped sweep, from root, which no process of the user stops)
            for _ in range(50):
                left = user_processes([uid])
                if not left:
                    break
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                time.sleep(0.1)


def test_the_sweeping_uid_is_one_the_user_namespace_maps(monkeypatch):
    """(Round 20's fifth prober.) In a user namespace that does not map the sweeping child's uid (rootless Podman,
    unprivileged LXC, Kubernetes ``hostUsers: false``: ``0 0 65536``), ``setresuid`` failed and the sweep silently
    did nothing. The child's uid is one the namespace maps, and a child that cannot take it is an error."""
    from agl_controller import spawn

    assert spawn.sweeper_uid_in("         0          0 4294967295\n") == spawn.SWEEPER_UID
    assert spawn.sweeper_uid_in("0 0 65536\n") == 65535
    assert spawn.sweeper_uid_in("0 100000 65536\n65536 1000 1\n") == 65536
    with pytest.raises(LaunchError, match="maps no uid"):
        spawn.sweeper_uid_in("0 1000 1\n")
    if os.geteuid() == 0:
        monkeypatch.setattr(spawn, "sweeper_uid", lambda: 2**32)  # (a uid no setresuid takes)
        uid, _ = free_uids(1, start=62000)
        with pytest.raises(RuntimeError, match="cannot take uid"):
            spawn.end_user_processes([uid])


@as_root
def test_two_runs_ending_at_once_end_all_of_both(tmp_path):
    """(Round 20's fifth prober.) Every sweeping child has the same real uid: when two runs ended at once, one's
    ``kill(-1)`` killed the other's before it sent its own, and that user's hopping lineage lived on (4 in 300). The
    sweeps take turns now."""
    import select
    import threading

    first, last = free_uids(2, start=62100)
    with open_dir(0o755) as folder:
        exe = build("hopper", folder)
        escaped = 0
        for _ in range(100):
            lineages = [subprocess.Popen([str(exe), "1", "600"], user=u, group=u, extra_groups=[], stdout=subprocess.PIPE)
                        for u in (first, last)]
            time.sleep(0.02)
            start = threading.Barrier(2)

            def sweep(uid):
                start.wait()
                end_user_processes([uid])

            threads = [threading.Thread(target=sweep, args=(u,)) for u in (first, last)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for lineage in lineages:
                lineage.wait()
                ready, _, _ = select.select([lineage.stdout], [], [], 0.2)  # (EOF: every member gone)
                if not ready or lineage.stdout.read(1) != b"":
                    escaped += 1
                    end_user_processes([first, last])
                lineage.stdout.close()
        assert escaped == 0


@as_root
@pytest.mark.parametrize("preload", [[], ["json"]], ids=["exec", "preload"])
async def test_a_run_gains_no_privileges_from_a_setuid_program(store, gateway_url, preload, monkeypatch):  # noqa: F811
    """(Round 20's sixth prober.) A run of one pool user left a setuid-and-setgid copy of a program in ``/tmp``; a run
    of another user ran it, became the first user, outlived its own sweep (nothing of its user was left) and read
    that user's next run's key. Every run now has ``no_new_privs``: setuid and setgid bits are ignored."""
    if preload:
        from multiprocessing import forkserver
        forkserver._forkserver._stop()
        monkeypatch.setattr("agl_controller.local.check_user_runs", lambda *a: None)  # (see test_hostile19)
    first, last = free_uids(1, start=62200)
    with open_dir(0o777) as shared:
        command = [sys.executable, str(HARNESSES / "privs.py")] if preload else [str(HARNESSES / "privs.sh")]
        runner = LocalRunner(store, gateway_url, command, "m", log_dir=shared / "logs", preload=preload,
                             run_as=str(first), cwd=str(ROOT), concurrency=1)
        await store.create_rollout(Rollout(rollout_id="nnp", input={"dir": str(shared)}, env_map={"PROBE_DIR": "dir"}))
        await runner.run_one(await store.pop_queued())
        logs = "".join(p.read_text() for p in (shared / "logs").glob("*"))
        assert (shared / "nnp.nnp").read_text().strip() == "NoNewPrivs:1", logs


def test_a_config_with_a_control_character_in_a_path_or_url_is_one_line(tmp_path):
    """(Round 20's sixth prober.) ``out_dir: "\\u0000"``, ``task_file: "a\\u0000b"`` and ``engine_url`` ending in
    ``\\u0000`` were tracebacks (the last after the run directory was made)."""
    for line in ('out_dir: "\\u0000"', 'task_file: "a\\u0000b"', 'engine_url: "http://127.0.0.1:9/v1\\u0000"',
                 'engine_url: "http://127.0.0.1:9/v1\\u0007"'):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"{line}\nsteps: 1\nout_dir: {tmp_path / 'runs'}\n" if "out_dir" not in line else f"{line}\n")
        run = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2, (line, run.stdout[-1500:], run.stderr[-1500:])
        assert "control character" in run.stdout + run.stderr and "Traceback" not in run.stdout + run.stderr, line
        assert not (tmp_path / "runs").exists()
