"""The local runner against a real gateway (fake upstream) and real Redis, with a scripted harness."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from agl_common.auth import scoped_key
from agl_common.schemas import Rollout, RolloutStatus
from agl_controller import LocalRunner
from agl_gateway import GatewaySettings, create_app

from fakes import Served, fake_upstream

def alive(pid: int) -> bool:
    """True if ``pid`` runs (a killed orphan may linger as a zombie until PID 1 reaps it: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


HARNESS = [sys.executable, str(Path(__file__).parent / "harnesses" / "scripted.py")]


@pytest.fixture
def gateway_url(redis_url, prefix):
    with Served(fake_upstream()) as up:
        settings = GatewaySettings(upstream=up.url, redis_url=redis_url, prefix=prefix, model="m", key="k3y")
        with Served(create_app(settings)) as gw:
            yield gw.url


async def run(store, gateway_url, tmp_path, inputs: dict[str, dict], **kw) -> dict[str, Rollout]:
    runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs", **kw)
    try:
        for rid, inp in inputs.items():
            await store.create_rollout(Rollout(rollout_id=rid, input=inp, env_map={"TASK_CALLS": "calls"}))
        ids = [await store.pop_queued() for _ in inputs]
        await asyncio.gather(*(runner.run_one(rid) for rid in ids))
        return {rid: await store.get_rollout(rid) for rid in inputs}
    finally:
        runner.close()  # (its reward function's worker processes)


async def test_outcomes_map_to_status_and_failure(store, gateway_url, tmp_path):
    env_out = tmp_path / "env.json"
    out = await run(store, gateway_url, tmp_path, {
        "ok": {"calls": 2, "reward": 1.0, "env_out": str(env_out)},
        "crash": {"calls": 1, "reward": 1.0, "exit": 3},
        "silent": {"calls": 0, "reward": 1.0},
        "noreward": {"calls": 1},
    })
    assert out["ok"].status == RolloutStatus.succeeded and out["ok"].reward == 1.0 and out["ok"].failure is None
    assert (out["crash"].status, out["crash"].failure) == (RolloutStatus.failed, "exit_code:3")
    assert (out["silent"].status, out["silent"].failure) == (RolloutStatus.failed, "no_model_calls")
    assert (out["noreward"].status, out["noreward"].failure) == (RolloutStatus.failed, "no_reward")
    assert len(await store.read_calls("ok")) == 2
    env = json.loads(env_out.read_text())
    base = f"{gateway_url}/rollouts/ok/attempts/0"
    assert env["OPENAI_BASE_URL"] == base + "/v1" and env["ANTHROPIC_BASE_URL"] == base
    assert env["AGL_REWARD_URL"] == base + "/reward"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == scoped_key("k3y", "ok", "0")
    assert (env["AGL_ROLLOUT_ID"], env["AGL_ATTEMPT_ID"], env["AGL_MODEL"]) == ("ok", "0", "m")
    assert json.loads(env["AGL_INPUT"])["calls"] == 2 and env["TASK_CALLS"] == "2"
    assert (tmp_path / "logs" / "ok.0.log").exists()


async def test_timeout_kills_the_whole_process_group(store, gateway_url, tmp_path):
    pid_file = tmp_path / "child.pid"
    out = await run(store, gateway_url, tmp_path, {"slow": {"calls": 1, "reward": 1.0, "sleep": 30,
                                                            "pid_out": str(pid_file)}}, timeout_s=8)
    assert (out["slow"].status, out["slow"].failure) == (RolloutStatus.failed, "timeout")
    grandchild = int(pid_file.read_text())
    await asyncio.sleep(0.2)
    assert not alive(grandchild)


async def test_a_run_whose_log_passes_the_limit_is_stopped(store, gateway_url, tmp_path):
    """A harness printing in a loop would fill the disk over a long run: past ``max_log_bytes`` the run is stopped
    (failure ``log_limit``, a failure of the agent's own, not retried) long before its timeout; a run that logs
    less is untouched."""
    t0 = asyncio.get_running_loop().time()
    out = await run(store, gateway_url, tmp_path, {"loud": {"calls": 1, "reward": 1.0, "spew": True},
                                                   "quiet": {"calls": 1, "reward": 1.0}},
                    timeout_s=60, max_log_bytes=256 * 1024, max_attempts=2)
    assert (out["loud"].status, out["loud"].failure) == (RolloutStatus.failed, "log_limit")
    assert out["loud"].attempt_id == "0"  # not an infrastructure failure: not retried
    assert out["quiet"].status == RolloutStatus.succeeded
    assert asyncio.get_running_loop().time() - t0 < 30
    log_text = (tmp_path / "logs" / "loud.0.log").read_bytes()
    assert 256 * 1024 < len(log_text) < 256 * 1024 + 200 and log_text.startswith(b"x" * 1023)
    assert log_text.rstrip().endswith(b"log cut at 262144 bytes; the run was stopped: log_limit]")
    with pytest.raises(ValueError, match="max_log_bytes"):
        LocalRunner(store, gateway_url, HARNESS, "m", max_log_bytes=0)


async def test_reward_function_when_the_harness_posts_none(store, gateway_url, tmp_path):
    out = await run(store, gateway_url, tmp_path, {"a": {"calls": 1, "answer": 7}},
                    reward_fn="agl_controller.local:final_output")  # any callable; checked below
    # final_output(input, text) is not a float function: it fails, and the failure is visible
    assert (out["a"].status, out["a"].failure) == (RolloutStatus.failed, "reward_error")


async def test_reward_function_scores_final_output(store, gateway_url, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples" / "arithmetic"))
    out = await run(store, gateway_url, tmp_path, {"right": {"calls": 1, "answer": 7},
                                                   "wrong": {"calls": 1, "answer": 8}}, reward_fn="task:reward")
    assert out["right"].reward == 1.0 and out["wrong"].reward == 0.0  # the fake answers "the answer is 7"
    assert out["right"].status == out["wrong"].status == RolloutStatus.succeeded


async def test_concurrency_limit_and_shutdown_hands_runs_back(store, gateway_url, tmp_path):
    runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs", concurrency=2)
    # each harness traps SIGTERM and exits 0, 143 or 1 (round 6: such runs were ended as the agent's failures, or
    # as no_reward, instead of being handed back)
    for i, on_term in enumerate((0, 143, 1)):
        await store.create_rollout(Rollout(rollout_id=f"s{i}", input={"calls": 1, "sleep": 30, "on_term": on_term,
                                                                      "pid_out": str(tmp_path / f"{i}.pid")}))
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run_forever(stop))
    for _ in range(100):
        rollouts = [await store.get_rollout(f"s{i}") for i in range(3)]
        if sum(r.status == RolloutStatus.running for r in rollouts) == 2:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    rollouts = [await store.get_rollout(f"s{i}") for i in range(3)]
    assert sorted(r.status.value for r in rollouts) == ["queuing", "running", "running"]
    stop.set()
    await asyncio.wait_for(task, 20)
    rollouts = [await store.get_rollout(f"s{i}") for i in range(3)]
    # the two interrupted runs are handed back: a new attempt each, queued again for the next controller
    assert all(r.status == RolloutStatus.queuing for r in rollouts)
    assert sorted(r.attempt_id for r in rollouts) == ["0", "1", "1"]
    assert sorted(i.decode() for i in await store.r.lrange(store.key("queue"), 0, -1)) == ["s0", "s1", "s2"]
    assert await store.claimed(runner.controller_id) == []


async def test_a_rollout_interrupted_at_every_restart_ends_after_its_bound(store, gateway_url, tmp_path):
    """A run that stops its own controller (or any rollout a restart interrupts again and again) is handed back
    ``HAND_BACKS_MAX`` times beyond its ``max_attempts``, then ends ``failed interrupted`` (it was handed back for
    ever: round 7 left it open)."""
    from agl_controller.base import HAND_BACKS_MAX

    # max_attempts 1: "worn" was handed back HAND_BACKS_MAX times already (its attempt ids 0..HAND_BACKS_MAX)
    for rid, aid in (("fresh", "0"), ("worn", str(HAND_BACKS_MAX))):
        await store.create_rollout(Rollout(rollout_id=rid, attempt_id=aid, input={
            "calls": 1, "sleep": 30, "on_term": 143, "pid_out": str(tmp_path / f"{rid}.pid")}))
    runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs", concurrency=2)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run_forever(stop))
    for _ in range(100):
        if all(r.status == RolloutStatus.running for r in [await store.get_rollout(i) for i in ("fresh", "worn")]):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(task, 20)
    fresh, worn = await store.get_rollout("fresh"), await store.get_rollout("worn")
    assert (fresh.status, fresh.attempt_id) == (RolloutStatus.queuing, "1"), fresh
    assert (worn.status, worn.failure, worn.attempt_id) == (RolloutStatus.failed, "interrupted", str(HAND_BACKS_MAX))
    assert [i.decode() for i in await store.r.lrange(store.key("queue"), 0, -1)] == ["fresh"]
    assert await store.claimed(runner.controller_id) == []


async def test_a_stop_while_a_run_is_being_started_hands_it_back(store, gateway_url, tmp_path):
    """A stop that comes while the harness is still being forked (round 7: shutdown() did not see it, its SIGKILL
    3 s later was recorded as the run's own ``oom_killed``): the run is handed back like the others."""
    await store.create_rollout(Rollout(rollout_id="late", input={
        "calls": 1, "sleep": 30, "pid_out": str(tmp_path / "late.pid")}))
    runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs")
    stop = asyncio.Event()
    real_start = runner.launcher.start

    async def slow_start(*args):
        stop.set()  # the stop arrives while this run is being started: shutdown() begins before it is
        while not runner._stopping:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return await real_start(*args)

    runner.launcher.start = slow_start
    await asyncio.wait_for(runner.run_forever(stop), 30)
    late = await store.get_rollout("late")
    assert (late.status, late.attempt_id, late.failure) == (RolloutStatus.queuing, "1", None), late


@pytest.mark.parametrize("preload", [[], ["json"]], ids=["exec", "preload"])
async def test_harness_gets_only_the_contract_env_and_what_is_named(store, gateway_url, tmp_path, monkeypatch,
                                                                    preload):
    """The controller's own secrets (the admin key, the Redis URL with its password, anything else it was
    started with) never reach a harness; PATH-like basics and what ``pass_env`` names do."""
    monkeypatch.setenv("AGL_KEY", "k3y")
    monkeypatch.setenv("AGL_REDIS_URL", "redis://:hunter2@127.0.0.1:6379/0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    monkeypatch.setenv("MY_TOKEN", "mine")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    if preload:  # a forkserver started by an earlier test holds that test's environment: start a fresh one
        from multiprocessing import forkserver
        forkserver._forkserver._stop()
    env_out = tmp_path / "env.json"
    out = await run(store, gateway_url, tmp_path, {"e": {"calls": 1, "reward": 1.0, "env_out": str(env_out)}},
                    preload=preload, pass_env=["MY_*"])
    assert out["e"].status == RolloutStatus.succeeded, out["e"].failure
    env = json.loads(env_out.read_text())
    assert not {"AGL_KEY", "AGL_REDIS_URL", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert "k3y" not in json.dumps(env) and "hunter2" not in json.dumps(env)
    assert env["MY_TOKEN"] == "mine" and env["LC_ALL"] == "C.UTF-8" and env["PATH"]
    assert env["OPENAI_API_KEY"] == scoped_key("k3y", "e", "0")
    # with preload the run's /proc/self/environ (readable by its subprocesses) was the controller's whole
    # environment: the forkserver is started with the allow-listed variables only
    proc_env = (tmp_path / "env.json.proc").read_bytes()
    assert b"k3y" not in proc_env and b"hunter2" not in proc_env and b"s3cret" not in proc_env, proc_env[:300]
    if preload:  # round 6: a forkserver killed (by a harness, the OOM killer) came back with the whole environment
        again = tmp_path / "again.json"
        runner = LocalRunner(store, gateway_url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs",
                             preload=preload, pass_env=["MY_*"])
        for rid, inp in (("killer", {"kill_parent": True}), ("after", {"env_out": str(again)})):
            await store.create_rollout(Rollout(rollout_id=rid, input={"calls": 1, "reward": 1.0, **inp}))
            await runner.run_one(await store.pop_queued())
        assert (await store.get_rollout("after")).status == RolloutStatus.succeeded
        proc_env = (tmp_path / "again.json.proc").read_bytes()
        assert b"k3y" not in proc_env and b"hunter2" not in proc_env and b"s3cret" not in proc_env, proc_env[:300]


async def ticking(coro):
    """``(coro's result, ticks)``: ticks of a task that counts every 50 ms on this event loop while ``coro`` runs
    (a loop frozen by a blocking call gives a handful)."""
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.05)

    tick = asyncio.create_task(ticker())
    try:
        return await coro, ticks
    finally:
        done.set()
        await tick


def test_pass_env_names_are_checked(store, gateway_url, tmp_path):
    with pytest.raises(ValueError, match="not a variable name"):
        LocalRunner(store, gateway_url, HARNESS, "m", log_dir=tmp_path, pass_env=["A=B"])


async def test_a_slow_reward_function_does_not_freeze_the_event_loop(store, gateway_url, tmp_path, monkeypatch):
    """A blocking ``--reward-fn`` (a judge, a test run) ran on the event loop: lease renewals stopped and a
    second controller ended the running rollouts as ``controller_lost``. It runs in a worker process now (round 15)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    out, ticks = await ticking(run(store, gateway_url, tmp_path, {"a": {"calls": 1, "judge_s": 3.0}},
                                   reward_fn="rewards:slow"))
    assert out["a"].status == RolloutStatus.succeeded and out["a"].reward == 1.0
    assert ticks >= 40, ticks  # ~3 s of judging at one tick per 50 ms; a frozen loop gives a handful


async def test_a_reward_function_that_returns_no_reward_or_exits_is_a_reward_error(store, gateway_url, tmp_path,
                                                                                    monkeypatch):
    """A ``--reward-fn`` returning NaN or inf left a *succeeded* rollout with reward null (1e39 overflowed the
    advantage), and one calling ``sys.exit()`` ended the whole controller with every run it had in flight; an int
    beyond float range (10**400, round 6) raised OverflowError past every handler and left the rollout running."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    kinds = ("nan", "inf", "big", "hugeint", "str", "bool", "bytes", "exit", "interrupt", "generator_exit", "hang",
             "ok")  # a str, bool or bytes is no
    # reward either (the gateway refuses them; float() made them 1000.0, 1.0 and 7.0)
    # (GeneratorExit left the rollout running; a hung one held it, and the controller ignored SIGTERM, for good:
    # a reward function gets a run's time at most, in a daemon thread that holds no exit)
    out = await run(store, gateway_url, tmp_path, {k: {"calls": 1, "kind": k} for k in kinds},
                    reward_fn="rewards:hostile", timeout_s=10)
    for k in kinds[:-1]:
        assert (out[k].status, out[k].failure, out[k].reward) == (RolloutStatus.failed, "reward_error", None), k
    assert out["ok"].status == RolloutStatus.succeeded and out["ok"].reward == 0.5


async def test_an_env_map_that_cannot_be_an_environment_fails_the_run_and_never_hides_the_contract(
        store, gateway_url, tmp_path):
    """A NUL in a mapped value (or '=' in a name) raised outside the spawn failure path: the rollout stayed running
    until controller_lost; an env_map could overwrite OPENAI_BASE_URL. Round 18 (the third prober): such an env_map
    rendered as a Kubernetes Job the API server refuses (a 422 at every attempt); it is now refused when the
    rollout is created (``Store.create_rollout``), for both runners; one that does get to a runner (written by
    an older version) still fails ``spawn_error``."""
    runner = LocalRunner(store, gateway_url, HARNESS, "m", log_dir=tmp_path / "logs")
    env_out = tmp_path / "env.json"
    nul = Rollout(rollout_id="nul", input={"v": "a\x00b", "calls": 1}, env_map={"TASK_CALLS": "calls", "BAD": "v"})
    eq = Rollout(rollout_id="eq", input={"v": "x", "calls": 1}, env_map={"TASK_CALLS": "calls", "A=B": "v"})
    for bad, why in ((nul, "holds a NUL"), (eq, "not an environment variable name")):
        with pytest.raises(ValueError, match=why):
            await store.create_rollout(bad)
    for name in ("", "A\nB", "x" * 257, "A B", "É"):
        with pytest.raises(ValueError, match="not an environment variable name"):
            await store.create_rollout(Rollout(rollout_id="n", input={"v": "x"}, env_map={name: "v"}))
    for bad in (nul, eq):  # (written by an older version: stored past the check)
        await store.r.set(store.rollout_key("rollout", bad.rollout_id), bad.model_dump_json())
        await store.r.lpush(store.key("queue"), bad.rollout_id)
    await store.create_rollout(Rollout(rollout_id="hide", input={"v": "http://evil/v1", "calls": 1, "reward": 1.0,
                                                                 "env_out": str(env_out)},
                                       env_map={"TASK_CALLS": "calls", "OPENAI_BASE_URL": "v"}))
    ids = [await store.pop_queued() for _ in range(3)]
    await asyncio.gather(*(runner.run_one(rid) for rid in ids))
    for rid in ("nul", "eq"):
        r = await store.get_rollout(rid)
        assert (r.status, r.failure) == (RolloutStatus.failed, "spawn_error"), rid
    assert json.loads(env_out.read_text())["OPENAI_BASE_URL"].startswith(gateway_url)


def test_a_hung_reward_function_holds_no_exit(monkeypatch):
    """It ran through asyncio.to_thread: asyncio.run (the controller's main) joins that pool at exit, so a reward
    function that never returned made the controller ignore SIGTERM for good. Now its worker process is killed."""
    import time

    from agl_controller.reward import RewardFunctionError, RewardPool

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    pool = RewardPool("rewards:hostile")

    async def main():
        with pytest.raises(TimeoutError):
            await pool.score({"kind": "hang"}, "", 0.5)
        with pytest.raises(RewardFunctionError, match="GeneratorExit"):
            await pool.score({"kind": "generator_exit"}, "", 30)
        assert await pool.score({"kind": "ok"}, "", 30) == 0.5

    t0 = time.monotonic()
    asyncio.run(main())
    pool.close()
    assert time.monotonic() - t0 < 60


