"""Round 19 of hostile input (docs/operations.md, "A nineteenth round"): what a local harness reached on the loopback
interface and in its own user's processes. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis
from agl_common.schemas import Rollout, RolloutStatus
from agl_controller.local import LocalRunner, passed_env
from agl_controller.spawn import LaunchError, harness_user
from fastapi import FastAPI

from fakes import Served, fake_upstream
from test_controller import gateway_url  # noqa: F401 (fixture)
from test_gateway import MSG, gateway, make_rollout

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = ROOT / "tests" / "harnesses"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching a harness to another user needs root")


@contextmanager
def open_dir(mode: int):
    """A fresh directory under the system's temporary one (pytest's ``tmp_path`` sits in a 0700 directory that
    ``nobody`` cannot enter), of ``mode``, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="agl-run-as-"))
    try:
        path.chmod(mode)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_the_gateway_sends_the_engines_key_and_never_the_agents(store, redis_url, prefix, monkeypatch):
    """An engine that asks for a key (the vLLM a run starts now does: below) could not be used: the gateway sent no
    ``Authorization`` to it. ``AGL_UPSTREAM_KEY`` (environment only) is sent on every engine request, discovery
    too; the agent's own key (its scoped key) never reaches the engine; without it nothing is sent."""
    async def authorizations(rid: str) -> list[str | None]:
        """The ``Authorization`` of every request the engine got for one agent call and a readiness probe."""
        app = fake_upstream()
        await make_rollout(store, rid)
        with Served(app) as up, gateway(redis_url, prefix, up.url) as gw:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(f"{gw.url}/rollouts/{rid}/attempts/0/v1/chat/completions", json=MSG,
                                 headers={"Authorization": "Bearer agents-own"})
                assert r.status_code == 200, r.text
                assert (await c.get(f"{gw.url}/readyz")).status_code == 200
        return [dict(h).get("authorization") for h, _ in app.state.requests]

    monkeypatch.setenv("AGL_UPSTREAM_KEY", "engine-s3cret-0123456789")
    sent = await authorizations("r1")
    assert len(sent) >= 2 and set(sent) == {"Bearer engine-s3cret-0123456789"}, sent
    monkeypatch.delenv("AGL_UPSTREAM_KEY")
    assert set(await authorizations("r2")) == {None}


def test_every_route_of_the_engine_asks_for_its_key(monkeypatch):
    """vLLM's ``--api-key`` guards ``/v1`` paths only: ``/collective_rpc`` (load any weights), ``/sleep``,
    ``/reset_prefix_cache`` answered a harness that reached the port. :class:`RequireKey` (the ``--middleware`` of
    the vLLM a run starts) asks for it on every route but ``/health``; without ``VLLM_API_KEY`` it refuses to start.
    (The real engine's start with it: ``tests/conftest.py::engine``, which every end-to-end test uses.)"""
    from agl_trainer.engine_guard import RequireKey

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        RequireKey(FastAPI())
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    app = FastAPI()
    for path in ("/collective_rpc", "/reset_prefix_cache", "/v1/load_lora_adapter", "/sleep"):
        app.post(path)(lambda: {"ok": True})
    app.get("/health")(lambda: {})
    app.get("/v1/models")(lambda: {"data": []})
    with Served(RequireKey(app)) as s:
        for method, path in (("post", "/collective_rpc"), ("post", "/reset_prefix_cache"), ("post", "/sleep"),
                             ("post", "/v1/load_lora_adapter"), ("get", "/v1/models")):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k3y"},
                            {"Authorization": "k3y"}):
                r = getattr(httpx, method)(s.url + path, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
            assert getattr(httpx, method)(s.url + path, headers={"Authorization": "Bearer k3y"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200


def test_the_redis_a_run_starts_has_a_password_no_command_line_shows(tmp_path):
    """The Redis a trainer starts (none answered at ``redis_url``) took any client of the machine: a harness wrote
    rewards and records straight into it. It now has a password of its own, in a configuration file of mode 0600
    removed once it answers (never on ``redis-server``'s command line, which ``ps`` shows); the URL with it is
    ``LOG_DIR/redis.url`` (0600) for the dashboard and the CLIs."""
    from agl_trainer.services import Services, free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with Services(tmp_path) as svc:
        port = free_port()
        url = svc.ensure_redis(f"redis://127.0.0.1:{port}/0")
        password = redis.connection.parse_url(url)["password"]
        assert password and len(password) >= 32
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_connect_timeout=2).ping()
        assert redis.Redis.from_url(url).ping()
        cmdline = Path(f"/proc/{svc.procs['redis'].pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        assert not (tmp_path / "redis.conf").exists()
        assert (tmp_path / "redis.url").read_text().strip() == url
        assert (tmp_path / "redis.url").stat().st_mode & 0o777 == 0o600


def test_no_harness_gets_the_engines_key_whatever_pass_env_names(monkeypatch):
    monkeypatch.setenv("AGL_UPSTREAM_KEY", "e")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert not {"AGL_UPSTREAM_KEY", "VLLM_API_KEY"} & set(passed_env(dict(os.environ), ["*", "AGL_*", "VLLM_*"]))


def test_run_as_names_a_user_this_process_can_become():
    """A user that does not exist, root, or (not being root) another user than this process's: refused at once."""
    import pwd

    with pytest.raises(LaunchError, match="no user"):
        harness_user("no-such-user-agl")
    if os.geteuid() == 0:
        with pytest.raises(LaunchError, match="root is not another user"):
            harness_user("root")
        assert harness_user("nobody").uid == pwd.getpwnam("nobody").pw_uid
    else:
        with pytest.raises(LaunchError, match="needs root"):
            harness_user("nobody")
        assert harness_user(str(os.geteuid())).uid == os.geteuid()


@as_root
@pytest.mark.parametrize("preload", [[], ["json"]], ids=["exec", "preload"])
async def test_a_harness_run_as_another_user_reads_nothing_of_the_controllers(store, gateway_url, preload,  # noqa: F811
                                                                             monkeypatch):
    """Every harness ran as the controller's user (root, in a container): it read the memory and ``/proc/<pid>/
    environ`` of the trainer, the engine (its key) and the gateway, and the 0600 files of the run (the Redis URL with
    its password). With ``--run-as`` / ``harness_user`` each run becomes that user, without supplementary groups,
    with its own ``HOME`` — exec'd and forked from the preloading server alike — and reads none of them."""
    if preload:  # a forkserver started by an earlier test holds that test's environment: start a fresh one
        from multiprocessing import forkserver
        forkserver._forkserver._stop()
        # this interpreter may be one `nobody` cannot reach (pyenv under /root: then refused at start, tested
        # below); the probe imports nothing more than the forkserver holds, so the drop itself is tried here
        monkeypatch.setattr("agl_controller.local.check_user_runs", lambda *a: None)
    with open_dir(0o777) as shared:
        private = shared / "redis.url"
        private.write_text("redis://:pw@127.0.0.1:1/0\n")
        private.chmod(0o600)
        peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a dumpable process of ours
        try:
            # (exec: in sh, as this machine's Python may live where that user cannot reach: under /root)
            command = [sys.executable, str(HARNESSES / "whoami.py")] if preload else [str(HARNESSES / "whoami.sh")]
            runner = LocalRunner(store, gateway_url, command, "m", key="k3y", log_dir=shared / "logs",
                                 preload=preload, run_as="nobody", cwd=str(ROOT), concurrency=1)
            probe = shared / "probe.json"
            await store.create_rollout(Rollout(rollout_id="u", input={
                "probe_out": str(probe), "peer": peer.pid, "private_file": str(private)}))
            await runner.run_one(await store.pop_queued())
        finally:
            peer.kill()
            peer.wait()
        got = await store.get_rollout("u")
        logs = "".join(p.read_text() for p in (shared / "logs").glob("*"))
        assert got.failure == "no_model_calls", (got.failure, logs)  # it ran to its end (it calls no model)
        seen = json.loads(probe.read_text())
        nobody = harness_user("nobody")
        assert (seen["uid"], seen["gid"], seen["groups"]) == (nobody.uid, nobody.gid, [])
        assert (seen["home"], seen["user"]) == (nobody.home, "nobody")
        assert not seen["peer_environ"] and not seen["private_file"], seen
        assert seen.get("fds", []) == [], seen  # (preload: the forkserver's pipes were inherited; exec: sh's own)
        (log,) = (shared / "logs").glob("*")
        assert log.stat().st_mode & 0o777 == 0o600  # another run (the same user) reads no other rollout's log


def test_harness_user_is_checked_before_anything_starts(tmp_path):
    """A ``harness_user`` that is no user (or one this trainer cannot become) is one line and exit 2, before any
    service starts; the controller's ``--run-as`` likewise."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("harness_user: no-such-user-agl\nsteps: 1\n")
    run = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "harness_user: no user 'no-such-user-agl'" in run.stdout + run.stderr
    assert "starting vLLM" not in run.stdout
    ctl = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--mode", "local", "--command", "true",
                          "--run-as", "no-such-user-agl"], capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 2 and "no user 'no-such-user-agl'" in ctl.stderr, ctl.stderr[-1000:]
    assert "Traceback" not in ctl.stderr


@as_root
def test_run_as_a_user_who_cannot_reach_the_program_is_refused_at_start(tmp_path):
    """This machine's Python lives under ``/root`` (pyenv): as ``nobody`` every exec'd run failed ``spawn_error`` and
    every forked one at its first standard-library import. A program (or working directory) the user cannot reach is
    refused when the runner is made, naming it."""
    from agl_controller.spawn import check_user_runs

    closed = tmp_path / "closed"  # (tmp_path's own parents are closed to others too)
    closed.mkdir(mode=0o700)
    prog = closed / "harness.sh"
    prog.write_text("#!/bin/sh\nexit 0\n")
    prog.chmod(0o755)
    nobody = harness_user("nobody")
    with pytest.raises(LaunchError, match="cannot execute"):
        check_user_runs(nobody, [str(prog)], "/")
    with pytest.raises(LaunchError, match="cannot enter"):
        check_user_runs(nobody, ["/bin/sh"], str(closed))
    check_user_runs(nobody, ["/bin/sh", "-c", "true"], "/")
    with pytest.raises(LaunchError, match="cannot execute"):
        LocalRunner(None, "http://127.0.0.1:1", [str(prog)], "m", log_dir=tmp_path / "logs", run_as="nobody", cwd="/",
                    concurrency=1)


def test_a_task_function_is_called_once_and_is_correct_before_anything_starts(tmp_path):
    """(Left open by round 18.) The task functions were called twice — the check at start, then the run — so one
    that draws at random was checked on another sample than it trained on; ``is_correct`` was loaded but never
    called until the first evaluation, after vLLM had started: one that fails on every input cost minutes. Now each
    function is called once per process, and ``is_correct`` is called on one input with rewards 0 and 1 at start
    (one line, exit 2)."""
    from agl_trainer.tasks import load_tasks

    count = tmp_path / "count"
    task = tmp_path / "task.py"
    task.write_text(f"""import random
def train_problems():
    with open({str(count)!r}, "a") as f:
        f.write("x")
    return [{{"q": random.random()}} for _ in range(3)]
def heldout_problems():
    return [{{"q": 1}}]
def is_correct(inp, reward):
    return inp["answer"] == reward
""")
    first, second = load_tasks(task, "train_problems"), load_tasks(task, "train_problems")
    assert first == second and first is not second and count.read_text() == "x"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"task_file: {task}\nsteps: 1\n")
    run = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout + run.stderr
    assert "is_correct(input, 0.0) failed on the first input: KeyError: 'answer'" in out, out[-2000:]
    assert "starting vLLM" not in out and "Traceback" not in out


@pytest.mark.parametrize("preload", [["json"]], ids=["preload"])
async def test_a_forked_run_holds_no_descriptor_of_the_forkserver(store, gateway_url, preload, tmp_path):  # noqa: F811
    """(Found by round 19's prober.) Every forked run held the write ends of the forkserver's alive pipe and of the
    resource tracker's pipe: one byte into the first killed the forkserver and so every running forked run
    (``exit_code:255``), a line into the second made the tracker unlink any ``/dev/shm`` entry, and a run's child
    that left the process group kept both alive past the controller. A forked run now holds nothing above stderr,
    run as another user or not."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()
    runner = LocalRunner(store, gateway_url, [sys.executable, str(HARNESSES / "whoami.py")], "m", key="k3y",
                         log_dir=tmp_path / "logs", preload=preload, cwd=str(ROOT))
    probe = tmp_path / "probe.json"
    await store.create_rollout(Rollout(rollout_id="f", input={"probe_out": str(probe), "peer": os.getpid(),
                                                              "private_file": "/nonexistent"}))
    await runner.run_one(await store.pop_queued())
    assert (await store.get_rollout("f")).failure == "no_model_calls"
    assert json.loads(probe.read_text())["fds"] == []


def test_the_gateway_refuses_two_ways_of_authenticating_to_the_engine():
    """(Found by round 19's prober.) ``--upstream http://user:pw@host`` with ``AGL_UPSTREAM_KEY`` set made aiohttp
    refuse every engine request (500 ``internal_error``, a traceback); refused at start now."""
    from agl_gateway.settings import GatewaySettings
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="two ways of authenticating"):
        GatewaySettings(upstream="http://127.0.0.1:1/v1,http://u:pw@127.0.0.1:2/v1", upstream_key="agl-key-0123456789abcdef")
    assert GatewaySettings(upstream="http://u:pw@127.0.0.1:2/v1", upstream_key=None).upstream_key is None


@as_root
def test_run_as_refuses_a_harness_script_its_user_cannot_read(tmp_path):
    """(Found by round 19's prober.) A script of mode 0600 passed the check at start, and every run then failed as
    the agent's own ``exit_code:2`` (never retried)."""
    from agl_controller.spawn import check_user_runs

    with open_dir(0o755) as opened:
        script = opened / "harness.py"
        script.write_text("print('hi')\n")
        script.chmod(0o600)
        with pytest.raises(LaunchError, match="cannot read the harness script"):
            check_user_runs(harness_user("nobody"), ["/usr/bin/python3", str(script)], "/")
        script.chmod(0o644)
        check_user_runs(harness_user("nobody"), ["/usr/bin/python3", str(script)], "/")


@as_root
def test_a_redis_port_squatted_by_the_harness_user_is_refused(tmp_path):
    """(Found by round 19's prober.) A process of the harness user (a run's child that left its process group)
    listening on ``redis_url``'s port once that Redis was gone was taken as "a Redis already answers": the next run
    stored everything in it, and sent it the Redis password. With ``harness_user`` such a listener is refused."""
    from agl_trainer.services import ServiceError, Services, free_port

    port = free_port()
    squat = subprocess.Popen(["/usr/bin/python3", "-c", f"""import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", {port}))
s.listen(); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.recv(1024); c.sendall(b"+PONG\\r\\n"); time.sleep(0.1); c.close()
"""], user="nobody", stdout=subprocess.PIPE, text=True)
    try:
        assert squat.stdout.readline().strip() == "ready"
        with Services(tmp_path) as svc:
            with pytest.raises(ServiceError, match="listened on by a process of harness_user 'nobody'"):
                svc.ensure_redis(f"redis://127.0.0.1:{port}/0", "nobody")
            assert "redis" not in svc.procs
    finally:
        squat.kill()
        squat.wait()


def test_the_controller_command_run_in_process_leaves_the_callers_engine_key(monkeypatch):
    """The controller's command dropped every never-passed name from its environment once its options were read —
    the engine key too, which it never reads: run in-process (a test's ``CliRunner``), it took the session engine's key
    from the caller, and every later gateway the tests started was refused by the engine (401). The engine key is
    dropped by the entry point (``main``) of a controller process instead."""
    from agl_controller.cli import app
    from typer.testing import CliRunner

    monkeypatch.setenv("AGL_UPSTREAM_KEY", "keep-me")
    result = CliRunner().invoke(app, ["run", "--mode", "local", "--command", "true", "--retry-on", "bogus"])
    assert result.exit_code == 2, result.output
    assert os.environ.get("AGL_UPSTREAM_KEY") == "keep-me"
