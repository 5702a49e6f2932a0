"""Round 21 of hostile input (docs/operations.md, "A twenty-first round"): each test failed before its fix."""
from __future__ import annotations

import asyncio
import functools
import os

import orjson
import pytest
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from test_gateway import make_rollout, upstream  # noqa: F401 (fixture)


async def _with_store(redis_url: str, prefix: str, fn):
    """``await fn(store)`` on a Store of its own (for tests that drive a CLI from a synchronous test)."""
    from agl_common.store import Store

    store = Store(redis_url, prefix)
    try:
        return await fn(store)
    finally:
        await store.close()



async def test_a_reward_posted_while_a_no_reward_retry_is_written_is_not_lost(store, monkeypatch):
    """(Left open by round 20.) With ``no_reward`` in ``retry_on``, the retry was decided on the rollout as read
    before the write: a reward posted (HTTP 200) in between was dropped with the attempt and the rollout ran again.
    The retry is decided again on the rollout it writes: the posted reward stands and the attempt succeeds."""
    from agl_controller.base import Runner

    await store.create_rollout(Rollout(rollout_id="late-retry", status=RolloutStatus.running), enqueue=False)
    await store.record_call(CallRecord(rollout_id="late-retry", attempt_id="0", seq=-1, route="chat", request={},
                                       response={}))
    runner = Runner(store, max_attempts=3, retry_on=("no_reward",))
    update = store.update_rollout
    posted = []

    async def post_then_update(rid, change, **kw):
        if not posted:  # a process the run left behind posts its reward here (as the gateway's route does)
            posted.append(await update(rid, lambda r: setattr(r, "reward", 0.5)))
        return await update(rid, change, **kw)

    monkeypatch.setattr(store, "update_rollout", post_then_update)
    got = await runner.finish_attempt("late-retry", "0", None)
    assert posted and (got.status, got.failure, got.reward, got.attempt_id) == (
        RolloutStatus.succeeded, None, 0.5, "0"), got


async def test_a_no_reward_retry_still_retries_without_a_reward(store):
    """The check above changes nothing when no reward arrives: the attempt is retried as before."""
    from agl_controller.base import Runner

    await store.create_rollout(Rollout(rollout_id="none", status=RolloutStatus.running), enqueue=False)
    await store.record_call(CallRecord(rollout_id="none", attempt_id="0", seq=-1, route="chat", request={},
                                       response={}))
    got = await Runner(store, max_attempts=3, retry_on=("no_reward",)).finish_attempt("none", "0", None)
    assert (got.status, got.attempt_id, got.reward) == (RolloutStatus.queuing, "1", None), got


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (this machine's pid 1 reaps orphans only now and then)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


async def test_what_a_reward_function_started_ends_with_its_timeout(monkeypatch, tmp_path):
    """A judge's child (a test run, model-written code) outlived the judge's timeout, running as the controller's
    user (root with ``--run-as``) after the controller stopped: only the worker was killed. The worker leads a
    process group of its own, and the group is killed with it."""
    import time
    from pathlib import Path

    from agl_controller.reward import RewardPool

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    pool = RewardPool("rewards:spawns", idle=1)
    pidfile = tmp_path / "child.pid"
    try:
        with pytest.raises(TimeoutError):
            await pool.score({"pidfile": str(pidfile)}, "", 5)
    finally:
        pool.close()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    running = _running(child)
    if running:
        os.kill(child, 9)
    assert not running, "the judge's child outlived its timeout"


def test_retry_on_details_no_runner_writes_are_refused():
    """``--retry-on exit_code:-0``, ``signal:-15``, ``exit_code:99999999999999999999``, ``job_failed:`` were taken
    (round 13 refused ``exit_code:01`` and ``signal:SIGTERM`` only) and never matched a failure."""
    from agl_controller.base import check_retry_on, matches

    for entry in ("exit_code:-0", "signal:-15", "exit_code:99999999999999999999", "job_failed:", "exit_code:0",
                  "signal:0", "signal:9", "signal:65", "exit_code:+3", "exit_code:2147483648", "signal:015"):
        with pytest.raises(ValueError, match="can never match"):
            check_retry_on([entry])
    taken = check_retry_on(["exit_code:137", "exit_code:-1073741819", "signal:15", "signal:64", "job_failed:x"])
    assert all(matches(f, taken) for f in ("exit_code:137", "exit_code:-1073741819", "signal:15", "job_failed:x"))


def test_a_gateway_pause_stopped_by_sigterm_withdraws_its_pause(redis_url, prefix):
    """``agl-trainer gateway pause`` killed by SIGTERM mid-drain (``timeout 60 agl-trainer gateway pause``, a CI step
    limit, a Job's end) left its pause held for an hour with no owner, its id never printed: every agent's calls
    were held. SIGTERM is Ctrl-C for every command now: the pause is withdrawn, one line, exit 130; the id is named
    before the pause is held."""
    import subprocess
    import sys
    import time

    from agl_common.schemas import ReplicaStatus

    with_store = functools.partial(_with_store, redis_url, prefix)

    # a replica with a call in flight that never drains
    asyncio.run(with_store(lambda s: s.heartbeat(ReplicaStatus(replica_id="busy", in_flight=1))))
    proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "gateway", "pause", "--timeout", "60",
                             "--redis", redis_url, "--prefix", prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not asyncio.run(with_store(lambda s: s.pauses())) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        held = asyncio.run(with_store(lambda s: s.pauses()))
        assert held, "the pause was never published"
        proc.send_signal(15)
        out, errs = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = asyncio.run(with_store(lambda s: s.pauses()))
    (pause,) = held
    assert (proc.returncode, left) == (130, {}), (proc.returncode, left, errs)
    assert "Traceback" not in errs and f"pausing: pause {pause}" in errs and "withdrawn" in errs, errs
    # (the eleventh prober) stderr that is no terminal keeps each line whole, as stdout does
    assert f"pausing: pause {pause}, waiting up to 60 s for the drain\n" in errs, errs


def test_redis_urls_the_store_cannot_use_are_refused_and_a_non_cluster_is_one_line():
    """``?decode_responses=true`` passed the URL check, then every Store read was a traceback (``'str' object has
    no attribute 'decode'``; a gateway served calls but could never pause); a cluster URL dropped every option but
    ``retries`` silently; ``redis+cluster://`` naming a plain Redis was a ``RedisClusterException`` traceback in
    every CLI. Now the first two are refused at start, the third is one line (a gateway does not start)."""
    import subprocess
    import sys

    from agl_common.store import check_redis_url

    for url in ("redis://127.0.0.1:6379/0?decode_responses=true", "redis://h/0?decode_responses",
                "rediss://h/0?encoding=latin1", "redis://h/0?legacy_responses=false",
                "redis+cluster://h:7000?decode_responses=1", "redis+cluster://h:7000?socket_timeout=1",
                "redis+cluster://h:7000?retries=x", "redis+cluster://h:7000?retries=1&retries=2",
                # (the eleventh prober) names redis-py hands the connection as strings: tracebacks at first use
                "redis://h/0?credential_provider=x", "redis://h/0?retry=3", "redis://h/0?event_dispatcher=x",
                "redis://h/0?redis_connect_func=x", "redis://h/0?maint_notifications_config=x"):
        with pytest.raises(ValueError, match="bad Redis URL"):
            check_redis_url(url)
    for url in ("redis://h/0?protocol=2", "redis://h/0?socket_timeout=3", "redis+cluster://h:7000?retries=5",
                "rediss://h/0?ssl_cert_reqs=none&client_name=agl"):
        assert check_redis_url(url) == url
    plain_as_cluster = "redis+cluster://127.0.0.1:6379"  # the tests' own Redis, which is no cluster node
    for argv, rc in ((["agl_trainer", "rollouts", "list"], 1), (["agl_trainer", "gateway", "status"], 1),
                     (["agl_controller", "run", "--mode", "local", "--command", "true"], 1),
                     (["agl_gateway", "serve", "--upstream", "http://127.0.0.1:9/v1", "--open", "--port", "0"], 2)):
        got = subprocess.run([sys.executable, "-m", *argv, "--redis", plain_as_cluster], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == rc and "Traceback" not in got.stderr and "not a Redis Cluster" in got.stderr, \
            (argv, got.returncode, got.stderr[-2000:])
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr


async def test_a_rollout_id_cannot_take_another_rollouts_job_name(store):
    """``task-7-ca84aec5`` (ca84aec5: the first 8 hex digits of sha256("Task-7")) kept its name as it is, which was
    the changed name of rollout ``Task-7``: created first, its Job held that name; ``Task-7``'s create got 409,
    taken as its own Job, and it ended ``job_lost`` while the other's Job ran. A kept id can no longer end as a
    changed id's hash does (16 hex digits now), and a 409 goes on only for this attempt's own Job."""
    import hashlib

    from agl_common.schemas import RolloutStatus
    from agl_controller.k8s import job_name
    from fake_k8s import FakeK8s
    from test_controller_k8s import runner

    victim = "Task-7"
    digest = hashlib.sha256(victim.encode()).hexdigest()
    for digits in (8, 16):  # the hash's length before and now
        assert job_name(f"task-7-{digest[:digits]}", "0") != job_name(victim, "0"), digits
    for nothing_kept in ("_", "__", "_.", "_@:"):  # (the ninth prober) a name with no part of the id: the hash alone
        alone = hashlib.sha256(nothing_kept.encode()).hexdigest()[:16]
        assert job_name(alone, "0") != job_name(nothing_kept, "0"), nothing_kept
    with FakeK8s() as fake:
        run = runner(store, fake, controller_id="k21")
        # the name is held by another rollout's Job (a hash collision, or a Job made by hand)
        await store.create_rollout(Rollout(rollout_id="other"), enqueue=False)
        await store.create_rollout(Rollout(rollout_id=victim), enqueue=True)
        other = run.renderer.render(Rollout(rollout_id="other", status=RolloutStatus.running))
        other["metadata"]["name"] = job_name(victim, "0")
        assert fake.create_job("default", other)[0] == 201
        assert await run.launch_some() == 1
        got = await store.get_rollout(victim)
        assert (got.status, got.failure) == (RolloutStatus.failed, "spawn_error"), got
        # this attempt's own Job (created before a crash): the 409 is taken as created
        again = Rollout(rollout_id="mine")
        await store.create_rollout(again, enqueue=True)
        mine = run.renderer.render(Rollout(rollout_id="mine", status=RolloutStatus.running))
        assert fake.create_job("default", mine)[0] == 201
        assert await run.launch_some() == 1
        assert (await store.get_rollout("mine")).status == RolloutStatus.running


def test_an_evaluation_on_an_engine_out_of_reach_stops_at_start(tmp_path, redis_url, prefix, monkeypatch):
    """``agl-trainer eval`` with an ``engine_url`` nothing answers at ran every rollout into a 502, printed accuracy
    0.000, wrote it to eval.json and exited 0: a typo gave a plausible score. The stack's start-up checks an engine
    it did not start, for eval as for train: one line, exit 1, nothing evaluated."""
    import json
    from pathlib import Path

    import yaml
    from agl_trainer.cli import app
    from typer.testing import CliRunner

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "tasks.py").write_text("def heldout_problems():\n    return [{'question': '1 + 1?', 'answer': 2}]\n")
    cfg = {"command": f"python {root / 'tests' / 'harnesses' / 'eval_agent.py'}",
           "task_file": str(tmp_path / "tasks.py"), "eval_size": 1,
           "engine_url": "http://user:enginepass@127.0.0.1:1", "redis_url": redis_url, "prefix": prefix,
           "out_dir": str(tmp_path / "runs"), "rollout_timeout_s": 30}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "eval.yaml"), "--json"])
    assert res.exit_code == 1 and "cannot be reached" in res.output and "enginepass" not in res.output, res.output
    assert not list((tmp_path / "runs").glob("eval-*/eval.json"))
    assert "accuracy" not in res.output and not res.stdout.strip().startswith("{"), json.dumps(res.output)

    # (the ninth prober) a web server at a mistyped port: 200 and an HTML page for every GET
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse
    from fakes import Served

    web = FastAPI()
    web.get("/v1/models")(lambda: HTMLResponse("<html><body>It works!</body></html>"))
    with Served(web) as server:
        (tmp_path / "eval.yaml").write_text(yaml.safe_dump({**cfg, "engine_url": server.url}))
        res = CliRunner().invoke(app, ["eval", str(tmp_path / "eval.yaml"), "--json"])
    assert res.exit_code == 1 and "listed no model" in res.output, res.output
    assert not list((tmp_path / "runs").glob("eval-*/eval.json"))

    # (the tenth prober) an answer nested 20000 deep (a RecursionError: a traceback in train, a 500 for every call
    # of a gateway), and one that drips a byte at a time (the check waited for ever)
    import time

    from fastapi.responses import Response, StreamingResponse

    from agl_trainer import cycle

    async def drip():
        yield b'{"data": ['
        while True:
            await asyncio.sleep(0.5)
            yield b" "

    web = FastAPI()
    web.get("/deep/v1/models")(lambda: Response(b"[" * 20000 + b"]" * 20000, media_type="application/json"))
    web.get("/drip/v1/models")(lambda: StreamingResponse(drip(), media_type="application/json"))
    import gzip

    bomb = gzip.compress(gzip.compress(b" " * (64 << 20)))  # (the eleventh prober) ~100 bytes sent, 64 MiB decoded
    web.get("/bomb/v1/models")(lambda: Response(bomb, media_type="application/json",
                                                headers={"Content-Encoding": "gzip, gzip"}))
    monkeypatch.setattr(cycle, "CHECK_TIMEOUT_S", 3.0)
    with Served(web) as server:
        for name, says in (("deep", "listed no model"), ("drip", "did not answer"), ("bomb", "listed no model")):
            (tmp_path / "eval.yaml").write_text(yaml.safe_dump({**cfg, "engine_url": f"{server.url}/{name}"}))
            t0 = time.monotonic()
            res = CliRunner().invoke(app, ["eval", str(tmp_path / "eval.yaml"), "--json"])
            assert res.exit_code == 1 and says in res.output and time.monotonic() - t0 < 30, (name, res.output)
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump({**cfg, "engine_url": "http://\u2603:1"}))  # no IDNA host
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "eval.yaml"), "--json"])
    assert res.exit_code == 1 and "cannot be reached" in res.output and res.exception.__class__ is SystemExit, \
        (res.output, res.exception)


def test_a_reward_worker_ends_with_its_controller_killed_outright(tmp_path):
    """(The fix above's own risk.) A worker in a group of its own is out of reach of a ``killpg`` of its controller
    (``Services`` ends a controller that does not stop in 10 s that way): a hung judge's worker would have lived on
    for ever. The worker asks Linux for SIGKILL when its controller dies."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "controller.py"
    script.write_text(f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent / "harnesses")!r})
from agl_controller.reward import RewardPool

async def main():
    pool = RewardPool("rewards:hostile", idle=1)
    task = asyncio.create_task(pool.score({{"kind": "hang"}}, "", 3600))
    while not pool._idle and not __import__("agl_controller.reward", fromlist=["_live"])._live:
        await asyncio.sleep(0.05)
    (worker,) = list(__import__("agl_controller.reward", fromlist=["_live"])._live)
    print(worker.proc.pid, flush=True)
    await task

if __name__ == "__main__":  # (the spawned worker imports this file as __mp_main__)
    asyncio.run(main())
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(1)  # the worker imported its function and runs it
        assert _running(worker)
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 10
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    running = _running(worker)
    if running:
        os.kill(worker, 9)
    assert not running, "the reward worker outlived its controller"


async def test_claims_a_controller_holds_by_no_run_are_adopted_while_it_lives(store, tmp_path):
    """After a short Redis outage, runs whose outcome could not be written (not even ``controller_error``) and a
    claim whose answer was lost stayed in the live controller's processing list: ``running`` or ``queuing`` for as
    long as it lived (only a restart under its id adopted them). Each reconcile now looks for claims none of its
    runs holds; one found at two reconciles in a row is adopted as a dead controller's claim is."""
    from agl_controller.local import LocalRunner

    runner = LocalRunner(store, "http://127.0.0.1:9", "true", "m", log_dir=tmp_path / "logs", controller_id="c21",
                         max_attempts=1)
    for rid in ("lost-run", "lost-queued", "held"):
        await store.create_rollout(Rollout(rollout_id=rid), enqueue=True)
    claimed = [await store.claim_queued("c21", timeout_s=None) for _ in range(3)]
    assert sorted(claimed) == ["held", "lost-queued", "lost-run"]
    assert await runner.start_attempt("lost-run") is not None  # its run ended; its outcome was never written
    runner._attempts.pop("lost-run")
    runner._in_hand["held"] += 1  # a run of this controller holds it
    assert await runner.reconcile_claims() == 0  # seen once: not yet (a claim being made looks the same)
    assert await runner.reconcile_claims() == 2
    lost = await store.get_rollout("lost-run")
    assert (lost.status, lost.failure) == (RolloutStatus.failed, "controller_lost"), lost
    assert (await store.get_rollout("lost-queued")).status == RolloutStatus.queuing
    assert await store.claimed("c21") == ["held"] and await store.pop_queued() == "lost-queued"
    assert (await store.get_rollout("held")).status == RolloutStatus.queuing  # untouched


async def test_an_event_whose_body_arrives_after_its_rollout_ended_is_refused(store, redis_url, prefix, upstream):
    """An event's head passed the route's check while the rollout ran; the rollout then ended (or was retried)
    before the body arrived, and the event was stored under the ended attempt with a 200. The store now checks the
    rollout in the same step as it writes a harness's event, as it does for a call record: 409, nothing stored."""
    import socket

    from agl_common.auth import scoped_key
    from agl_common.schemas import EVENTS_PER_ATTEMPT_MAX
    from agl_common.store import RecordRefused
    from test_gateway import gateway

    for rid, end in (("ev-done", "succeed"), ("ev-retried", "retry")):
        await make_rollout(store, rid)
        with gateway(redis_url, prefix, upstream.url, key="admin-key-0123456789abcdef") as gw:
            body = orjson.dumps({"type": "note", "data": {"x": 1}})
            head = (f"POST /rollouts/{rid}/attempts/0/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {scoped_key('admin-key-0123456789abcdef', rid, '0')}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            host, port = gw.url.removeprefix("http://").split(":")
            s = socket.create_connection((host, int(port)), timeout=30)
            try:
                s.sendall(head)
                await asyncio.sleep(1.0)  # the route has resolved who is asking and waits for the body
                if end == "succeed":
                    await store.update_rollout(rid, lambda r: setattr(r, "status", RolloutStatus.succeeded))
                else:
                    await store.retry_attempt(rid, "0")
                s.sendall(body)
                answer = s.recv(65536).decode()
            finally:
                s.close()
        assert answer.startswith("HTTP/1.1 409") and "was not recorded" in answer, (rid, answer[:500])
        assert await store.read_events(rid) == [], rid
    # the store's own rule, and the controller's events (no cap) as before
    with pytest.raises(RecordRefused, match="rollout_finished"):
        await store.add_event("ev-done", "0", "note", {}, max_events=EVENTS_PER_ATTEMPT_MAX)
    with pytest.raises(RecordRefused, match="stale_attempt"):
        await store.add_event("ev-retried", "0", "note", {}, max_events=EVENTS_PER_ATTEMPT_MAX)
    assert await store.add_event("ev-done", "0", "attempt_failed", {})


def test_an_interrupted_pause_is_withdrawn_even_if_its_own_withdrawal_was_cut_short(redis_url, prefix, monkeypatch):
    """(The tenth prober.) A second SIGTERM while ``asyncio.run`` cancelled its tasks cancelled ``pause_and_drain``'s
    withdrawal: the pause stayed held for an hour while the CLI said "withdrawn". The CLI now ends the pause itself
    (signals ignored meanwhile) and says "withdrawn" only once the pause is gone; a second SIGTERM is ignored."""
    import signal
    import threading
    import time

    import agl_common.control as control
    from agl_common.schemas import ReplicaStatus
    from agl_trainer import cli
    from typer.testing import CliRunner

    with_store = functools.partial(_with_store, redis_url, prefix)

    async def cut_short(store, pause_id):  # what a second signal did to the withdrawal
        return None

    monkeypatch.setattr(control, "_withdraw", cut_short)
    asyncio.run(with_store(lambda s: s.heartbeat(ReplicaStatus(replica_id="busy", in_flight=1))))

    def interrupt_once_held():
        deadline = time.monotonic() + 60
        while not asyncio.run(with_store(lambda s: s.pauses())) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_held, daemon=True).start()
    res = CliRunner().invoke(cli.app, ["gateway", "pause", "--timeout", "60", "--redis", redis_url, "--prefix", prefix])
    assert "withdrawn" in res.output and asyncio.run(with_store(lambda s: s.pauses())) == {}, res.output
    assert res.exit_code == 130, res.output
    # SIGTERM is Ctrl-C once; a second one is ignored while the first one's clean-up runs
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            cli._terminate_once(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


async def test_a_models_list_nested_past_any_parser_is_no_model_for_the_gateway(store, redis_url, prefix, upstream):
    """(The tenth prober.) One engine answering ``GET /v1/models`` with JSON nested 20000 deep made every call and
    ``/v1/models`` a 500 (a ``RecursionError`` through the discovery), the other engine never tried. Such an answer
    lists no model: that engine is skipped, as an engine listing none is."""
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import Response
    from fakes import Served
    from agl_gateway.app import create_app
    from agl_gateway.settings import GatewaySettings
    from test_gateway import MSG

    deep = FastAPI()
    deep.get("/v1/models")(lambda: Response(b"[" * 20000 + b"]" * 20000, media_type="application/json"))
    await make_rollout(store)
    with Served(deep) as bad:
        settings = GatewaySettings(upstream=f"{bad.url},{upstream.url}", redis_url=redis_url, prefix=prefix,
                                   heartbeat_s=0.2)  # no --model: the engines' own lists name it
        with Served(create_app(settings)) as gw:
            async with httpx.AsyncClient(timeout=60) as c:
                models = await c.get(f"{gw.url}/v1/models")
                call = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
    assert models.status_code == 200 and "fake-model" in models.text, models.text[:300]
    # (the call is pinned to one engine by its rollout id: 200 from the good one, 502 from the deep one, which
    # serves no chat route; never the 500 of a discovery that raised)
    assert call.status_code in (200, 502) and "RecursionError" not in call.text, call.text[:300]


async def test_a_job_whose_owner_cannot_be_read_is_followed_as_this_attempts(store, monkeypatch):
    """(The tenth prober.) After a 409, a read of the existing Job that the API server failed once (a 500) made a
    legitimate attempt ``spawn_error`` ("held by an unknown Job") and its own running Job was deleted. A failed
    read is tried again, and one that keeps failing leaves the Job followed as this attempt's."""
    from agl_common.schemas import RolloutStatus
    from fake_k8s import FakeK8s
    from kubernetes.client.exceptions import ApiException
    from test_controller_k8s import runner

    with FakeK8s() as fake:
        run = runner(store, fake, controller_id="k21b")
        monkeypatch.setattr("agl_controller.k8s.asyncio.sleep", lambda s: asyncio.sleep(0))
        real = run.batch.read_namespaced_job
        for rid, failures in (("once", 1), ("always", 99)):
            left = [failures]

            def flaky(name, namespace, **kw):
                if left[0] > 0:
                    left[0] -= 1
                    raise ApiException(status=500, reason="etcdserver: request timed out")
                return real(name, namespace, **kw)

            run.batch.read_namespaced_job = flaky
            await store.create_rollout(Rollout(rollout_id=rid), enqueue=True)
            own = run.renderer.render(Rollout(rollout_id=rid, status=RolloutStatus.running))
            assert fake.create_job("default", own)[0] == 201  # this attempt's Job, created before a crash
            assert await run.launch_some() == 1
            got = await store.get_rollout(rid)
            assert got.status == RolloutStatus.running, (rid, got)
        await run.reconcile_jobs()
        assert {"agl-once-0", "agl-always-0"} <= set(fake.job_names())


def test_a_reward_worker_reaped_already_has_no_process_group_to_kill():
    """(The eleventh prober.) ``_Worker.kill`` sent SIGKILL to the process group named by the worker's pid after the
    worker had been reaped (``Process.start`` reaps finished children; a preload harness start is one): the pid was
    free, and a harness run leading a group of that id was killed (recorded ``oom_killed``). The group is signalled
    only while the worker is unreaped (alive, or a zombie not yet waited for)."""
    import subprocess
    import time

    from agl_controller.reward import _unreaped

    proc = subprocess.Popen(["sleep", "0.2"])
    assert _unreaped(proc.pid)
    time.sleep(0.6)
    assert _unreaped(proc.pid)  # a zombie: its pid is still ours
    proc.wait()
    assert not _unreaped(proc.pid)
