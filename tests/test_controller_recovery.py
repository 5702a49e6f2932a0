"""Local runner: retries as new attempts (old attempt fenced), failure accounting, and convergence after a
controller is SIGKILLed or restarted. Real gateway (fake upstream), real Redis, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from agl_common.auth import scoped_key
from agl_common.schemas import Rollout, RolloutStatus
from agl_controller import LocalRunner

from test_controller import HARNESS, gateway_url  # noqa: F401 (fixture)

TERMINAL = (RolloutStatus.succeeded, RolloutStatus.failed)


async def drive(runner: LocalRunner, store, ids: list[str], limit_s: float = 40) -> dict[str, Rollout]:
    """Run ``runner`` until every rollout in ``ids`` is terminal (or ``limit_s``), then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run_forever(stop))
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            rollouts = await store.get_rollouts(ids)
            if all(r.status in TERMINAL for r in rollouts):
                break
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    return {r.rollout_id: r for r in await store.get_rollouts(ids)}


async def test_infrastructure_failures_are_retried_as_new_attempts(store, gateway_url, tmp_path):  # noqa: F811
    inputs = {
        "slow": {"calls": 1, "reward": 1.0, "first_attempt": {"sleep": 30, "pid_out": str(tmp_path / "p")}},
        "term": {"calls": 1, "reward": 1.0, "first_attempt": {"kill_self": 15}},
        "oom": {"calls": 1, "reward": 1.0, "kill_self": 9},  # fails every time: attempts run out
        "crash": {"calls": 1, "reward": 1.0, "exit": 3},  # the agent's own failure: not retried
        "noreward": {"calls": 1},  # not retried
    }
    for rid, inp in inputs.items():
        await store.create_rollout(Rollout(rollout_id=rid, input=inp))
    runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs", timeout_s=4,
                         concurrency=5, max_attempts=3)
    out = await drive(runner, store, list(inputs))
    assert (out["slow"].status, out["slow"].attempt_id, out["slow"].reward) == (RolloutStatus.succeeded, "1", 1.0)
    assert (out["term"].status, out["term"].attempt_id) == (RolloutStatus.succeeded, "1")
    assert (out["oom"].status, out["oom"].failure, out["oom"].attempt_id) == (RolloutStatus.failed, "oom_killed", "2")
    assert (out["crash"].status, out["crash"].failure, out["crash"].attempt_id) == (RolloutStatus.failed,
                                                                                     "exit_code:3", "0")
    assert (out["noreward"].failure, out["noreward"].attempt_id) == ("no_reward", "0")
    events = [(e["attempt_id"], e["data"]["failure"]) for e in await store.read_events("slow")]
    assert events == [("0", "timeout")]
    assert [(e["attempt_id"], e["data"]["failure"]) for e in await store.read_events("oom")] == [
        ("0", "oom_killed"), ("1", "oom_killed")]
    # each attempt has its own calls and log file
    assert [c.attempt_id for c in await store.read_calls("slow")] == ["0", "1"]
    assert (tmp_path / "logs" / "slow.0.log").exists() and (tmp_path / "logs" / "slow.1.log").exists()
    # the old attempt is fenced: its reward and calls are refused
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        key = {"Authorization": f"Bearer {scoped_key('k3y', 'slow', '0')}"}
        res = await http.post("/rollouts/slow/attempts/0/reward", json={"value": 0.0}, headers=key)
        assert res.status_code == 409
        res = await http.post("/rollouts/slow/attempts/0/v1/chat/completions", headers=key,
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert res.status_code == 409
    assert (await store.get_rollout("slow")).reward == 1.0
    assert await store.claimed(runner.controller_id) == []


async def test_spawn_error_and_custom_retry_on(store, gateway_url, tmp_path):  # noqa: F811
    await store.create_rollout(Rollout(rollout_id="nocmd"))
    runner = LocalRunner(store, gateway_url, ["/nonexistent/harness"], "m", log_dir=tmp_path, max_attempts=2)
    out = await drive(runner, store, ["nocmd"])
    assert (out["nocmd"].status, out["nocmd"].failure, out["nocmd"].attempt_id) == (RolloutStatus.failed,
                                                                                     "spawn_error", "1")
    await store.create_rollout(Rollout(rollout_id="exit", input={"calls": 1, "reward": 1.0,
                                                                 "first_attempt": {"exit": 2}}))
    runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path, max_attempts=2,
                         retry_on=["exit_code:2"])
    out = await drive(runner, store, ["exit"])
    assert (out["exit"].status, out["exit"].attempt_id) == (RolloutStatus.succeeded, "1")


async def test_restart_with_the_same_id_adopts_its_claims_at_once(store):
    for rid in ("q", "r", "d", "r2"):
        await store.create_rollout(Rollout(rollout_id=rid))
    for _ in range(4):
        await store.claim_queued("A", None)  # A claimed them all, then died without a trace
    await store.set_status("r", RolloutStatus.running)
    await store.set_status("r2", RolloutStatus.running)
    await store.set_status("d", RolloutStatus.running)
    await store.set_status("d", RolloutStatus.succeeded)
    await store.create_rollout(Rollout(rollout_id="b"))
    await store.claim_queued("B", None)
    await store.renew_lease("B", 30)  # B is alive: its claims are not touched
    await store.set_status("b", RolloutStatus.running)

    runner = LocalRunner(store, "http://gw", ["true"], "m", controller_id="A", max_attempts=1)
    await store.renew_lease("A", 30)  # the new life's lease: the old claims are adopted all the same
    assert await runner.reconcile_claims(startup=True) == 4
    got = {r.rollout_id: r for r in await store.get_rollouts(["q", "r", "r2", "d", "b"])}
    assert got["q"].status == RolloutStatus.queuing and await store.pop_queued() == "q"
    assert (got["r"].status, got["r"].failure) == (RolloutStatus.failed, "controller_lost")
    assert got["d"].status == RolloutStatus.succeeded
    assert got["b"].status == RolloutStatus.running and await store.claimed("B") == ["b"]
    assert await store.claimed("A") == [] and await store.pop_queued(0.1) is None

    # with attempts left, a lost run is retried as a new attempt instead
    retry = LocalRunner(store, "http://gw", ["true"], "m", controller_id="C", max_attempts=2)
    await store.r.delete(store.key("controller", "B"))  # B dies
    assert await retry.reconcile_claims() == 1
    b = await store.get_rollout("b")
    assert (b.status, b.attempt_id) == (RolloutStatus.queuing, "1") and await store.pop_queued() == "b"


async def test_sigkilled_controller_converges_without_duplicates(store, gateway_url, redis_url, prefix, tmp_path):  # noqa: F811
    mark = tmp_path / "marks"
    slow = {"calls": 1, "reward": 1.0, "mark": str(mark),
            "first_attempt": {"sleep": 9, "reward_after_sleep": True}}
    ids = ["slow0", "slow1", "quick0", "quick1"]
    for rid in ids:
        inp = dict(slow, pid_out=str(tmp_path / f"{rid}.pid"), status_out=str(tmp_path / f"{rid}.status"))
        if rid.startswith("quick"):
            inp = {"calls": 1, "reward": 1.0, "mark": str(mark)}
        await store.create_rollout(Rollout(rollout_id=rid, input=inp))
    cmd = [sys.executable, "-m", "agl_controller", "run", "--mode", "local", "--command",
           " ".join(HARNESS), "--gateway", gateway_url, "--redis", redis_url, "--prefix", prefix,
           "--concurrency", "2", "--key", "k3y", "--controller-id", "A", "--lease-ttl", "2",
           "--log-dir", str(tmp_path / "a")]
    with open(tmp_path / "a.out", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    try:
        for _ in range(150):
            if len((await store.get_rollouts(["slow0", "slow1"]))) and all(
                    r.status == RolloutStatus.running for r in await store.get_rollouts(["slow0", "slow1"])):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError((tmp_path / "a.out").read_text())
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert sorted(await store.claimed("A")) == ["slow0", "slow1"]

        runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "b", concurrency=4,
                             max_attempts=2, controller_id="B", lease_ttl_s=1.0)
        out = await drive(runner, store, ids)
        assert all(r.status == RolloutStatus.succeeded for r in out.values()), out
        assert (out["slow0"].attempt_id, out["slow1"].attempt_id, out["quick0"].attempt_id) == ("1", "1", "0")
        assert [e["data"]["failure"] for e in await store.read_events("slow0")] == ["controller_lost"]
        runs = sorted(tuple(line.split()[:2]) for line in mark.read_text().splitlines())
        assert runs == [("quick0", "0"), ("quick1", "0"), ("slow0", "0"), ("slow0", "1"), ("slow1", "0"),
                        ("slow1", "1")]  # nothing ran twice, nothing was lost
        assert await store.claimed("A") == [] and await store.claimed("B") == []
        # the orphaned attempt-0 runs of the dead controller wake up and are refused
        for rid in ("slow0", "slow1"):
            status_file = tmp_path / f"{rid}.status"
            for _ in range(600):  # (its 9 s sleep began before the kill; on a loaded machine it wakes late)
                if status_file.exists() and status_file.read_text():
                    break
                await asyncio.sleep(0.1)
            assert status_file.read_text() == "409"
        assert all(r.reward == 1.0 for r in await store.get_rollouts(ids))
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        for line in mark.read_text().splitlines() if mark.exists() else []:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(line.split()[2]), signal.SIGKILL)


@pytest.mark.parametrize("args, says", [
    (["--retry-on", "timeout,timeuot"], "'timeuot'"),
    (["--reward-fn", "no_such_module_here:f"], "cannot import 'no_such_module_here'"),
    (["--reward-fn", "json:no_such_function"], "has no 'no_such_function'"),
    (["--reward-fn", "json:__name__"], "not callable"),
    (["--reward-fn", "nocolon"], "module:function"),
    (["--timeout", "-5"], "--timeout"),
    (["--lease-ttl", "0"], "--lease-ttl"),
    (["--pass-env", "MY_*,TOKEN=x"], "'TOKEN=x' is not a variable name"),
])
def test_bad_options_are_a_usage_error_before_anything_starts(args, says):
    """A misspelt ``--retry-on`` reason used to be accepted (it never matched, so the failures it was meant
    to retry ended their rollouts), and a ``--reward-fn`` that cannot be imported was a traceback; each is
    one line and exit 2, before the controller touches Redis (the URL here answers nothing)."""
    cmd = [sys.executable, "-m", "agl_controller", "run", "--mode", "local", "--command", "true",
           "--redis", "redis://127.0.0.1:1/0", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and says in res.stderr, (res.returncode, res.stderr[-800:])
    assert "Traceback" not in res.stderr


def test_the_runner_checks_retry_on_itself():
    with pytest.raises(ValueError, match="'sigal:9'"):
        LocalRunner(None, "http://127.0.0.1:1", ["true"], "m", retry_on=["sigal:9"])
    assert LocalRunner(None, "http://127.0.0.1:1", ["true"], "m", retry_on=["exit_code:75", "signal"]).retry_on \
        == ("exit_code:75", "signal")
