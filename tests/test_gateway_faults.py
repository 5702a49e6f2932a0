"""Faults of issue 14, one test each (each failed before its fix): pauses that end resumed, streams that
keep the status, the record and the order of a non-streamed call, checks that never let a short capture
train, one identity per rollout, errors that say whose they are, model discovery that recovers, the
trainer's Redis options, and a Store that keeps a registry instead of scanning the keyspace."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import httpx
import orjson
import pytest
from agl_common.auth import scoped_key
from agl_common.control import DrainTimeout, pause_and_drain, resume
from agl_common.schemas import ControlCommand, ReplicaStatus, Rollout, RolloutStatus
from agl_gateway import GatewaySettings, create_app
from agl_gateway.engines import Engines

from fakes import Served, fake_upstream, free_port

ROOT = Path(__file__).resolve().parents[1]
MSG = {"model": "agent-model", "messages": [{"role": "user", "content": "what is 3+4?"}]}
STREAM = {**MSG, "stream": True}


@pytest.fixture
def upstream():
    app = fake_upstream()
    with Served(app) as s:
        s.app = app
        yield s


def gateway(redis_url, prefix, upstream_url, **kw):
    kw.setdefault("model", "agent-model")
    settings = GatewaySettings(upstream=upstream_url, redis_url=redis_url, prefix=prefix, heartbeat_s=0.2, **kw)
    return Served(create_app(settings))


async def make_rollout(store, rid="r1", attempt="0"):
    await store.create_rollout(Rollout(rollout_id=rid, attempt_id=attempt, status=RolloutStatus.running),
                               enqueue=False)


async def records(store, rid="r1", n=1, within_s=20.0):
    """The rollout's records once there are at least ``n`` (polling; the bound is a failure, not a speed)."""
    deadline = time.monotonic() + within_s
    while True:
        calls = await store.read_calls(rid)
        if len(calls) >= n or time.monotonic() > deadline:
            return calls
        await asyncio.sleep(0.05)


def sse_events(text: str) -> list:
    return [orjson.loads(line[5:]) if line[5:].strip() != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data:")]


# --------------------------------------------------------------------------- 1. pauses end resumed
async def test_drain_timeout_ends_resumed_and_restarted_replicas_start_unpaused(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, max_hold=60) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as c:
            slow = asyncio.create_task(c.post(url, json={**MSG, "x_delay": 3.0}))
            while not upstream.app.state.calls:
                await asyncio.sleep(0.02)
            with pytest.raises(DrainTimeout):
                await pause_and_drain(store, timeout_s=0.2)
            # not held until max_hold (60 s): the failed pause was withdrawn
            fast = await asyncio.wait_for(c.post(url, json=MSG), 30)
            assert fast.status_code == 200 and (await slow).status_code == 200
    last = await store.last_control()
    assert last is None or last.cmd == "resume"  # a replica started now would not come up paused


async def test_overlapping_pauses_have_owners(store, redis_url, prefix, upstream):
    """Two pauses overlap (a trainer's and an operator's): the one that times out used to withdraw with an
    unconditional resume, releasing the other's pause while its owner updated. Each pause ends alone now, and
    the gateway holds calls until no pause is held; ``release_all`` (the CLI without --pause) ends every one."""
    from agl_common.control import new_pause_id

    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, max_hold=60) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as c:
            trainer = new_pause_id()
            await pause_and_drain(store, trainer, timeout_s=10)  # the trainer updates from here on
            slow_started = len(upstream.app.state.calls)
            held = asyncio.create_task(c.post(url, json=MSG))
            await store.heartbeat(ReplicaStatus(replica_id="ghost", in_flight=1))  # a replica that never drains
            with pytest.raises(DrainTimeout):  # so the operator's pause times out, and withdraws
                await pause_and_drain(store, timeout_s=0.3)
            await store.drop_replica("ghost")
            await asyncio.sleep(0.5)
            assert not held.done() and len(upstream.app.state.calls) == slow_started  # still held: trainer's pause
            assert list(await store.pauses()) == [trainer]
            second = new_pause_id()
            await pause_and_drain(store, second, timeout_s=10)
            await resume(store, model="policy-v1", version=1, release=trainer)  # the trainer is done
            await asyncio.sleep(0.5)
            assert not held.done() and list(await store.pauses()) == [second]
            await resume(store, release=second)
            assert (await asyncio.wait_for(held, 30)).status_code == 200
            assert upstream.app.state.calls[-1]["model"] == "policy-v1"
            await pause_and_drain(store, timeout_s=10)
            await pause_and_drain(store, timeout_s=10)
            await resume(store, release_all=True)
            assert await store.pauses() == {}
            assert (await asyncio.wait_for(c.post(url, json=MSG), 30)).status_code == 200


async def test_collocated_cycle_resumes_when_the_drain_times_out(store, redis_url, prefix, upstream):
    from agl_trainer.cycle import backend_cycle

    class NoUpdate:  # a drain that failed must never reach the backend
        def update(self, rows, advantages):
            raise AssertionError("updated after a failed drain")

        async def publish(self, version):
            raise AssertionError("published after a failed drain")

        async def retire(self, version):
            raise AssertionError("retired after a failed drain")

    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, max_hold=60) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as c:
            slow = asyncio.create_task(c.post(url, json={**MSG, "x_delay": 3.0}))
            while not upstream.app.state.calls:
                await asyncio.sleep(0.02)
            with pytest.raises(DrainTimeout, match=r"\(1 in flight\)"):  # why it did not drain: a call
                await backend_cycle(store, NoUpdate(), 1, [], [], drain_timeout_s=0.2)
            assert (await asyncio.wait_for(c.post(url, json=MSG), 30)).status_code == 200
            await slow
    assert (await store.last_control()).cmd == "resume"


async def test_a_pause_whose_trainer_died_expires(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, max_hold=60) as gw:
        # a trainer that paused and was killed before resuming: its pause carries an expiry
        await store.publish_control(ControlCommand(cmd="pause", id="dead-trainer", expires_at=time.time() + 1.0))
        async with httpx.AsyncClient(timeout=60) as c:
            r = await asyncio.wait_for(c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG), 30)
    assert r.status_code == 200


# --------------------------------------------------------------------------- 2-5. streaming is the pipeline
async def test_stream_error_before_the_first_byte_keeps_status_and_message(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={**STREAM, "x_status": 400})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "engine refused: status 400" in r.json()["error"]["message"]
    with gateway(redis_url, prefix, f"http://127.0.0.1:{free_port()}") as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=STREAM)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    calls = await records(store, n=2)
    assert [c.status for c in calls] == ["error", "error"]


async def test_stream_dropped_by_the_agent_is_recorded_as_abandoned(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                                json={**STREAM, "x_delay": 0.5}) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data:")
                    if seen == 2:
                        break  # the agent goes away after two chunks
        (call,) = await records(store)
        assert call.status == "error" and "abandoned" in call.error
        assert call.prompt_token_ids and call.response_token_ids  # what was captured is kept
        gate = gw.server.config.app.state.agl.gate
        deadline = time.monotonic() + 20
        while gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert gate.in_flight == 0  # its gate slot was released


async def test_stream_is_recorded_before_its_final_chunk(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                                json={**STREAM, "x_delay": 0.5, "stream_options": {"include_usage": True}}) as resp:
                finals = []
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        chunk = orjson.loads(line[5:])
                        if chunk.get("usage") or any(ch.get("finish_reason") for ch in chunk.get("choices", [])):
                            finals.append(await store.count_calls("r1", "0"))
                    elif line.startswith("data:"):
                        finals.append(await store.count_calls("r1", "0"))
    assert finals and all(n == 1 for n in finals), finals


async def test_stream_fails_over_to_a_live_engine(store, redis_url, prefix, upstream):
    dead = f"http://127.0.0.1:{free_port()}"
    engines = Engines([dead + "/v1", upstream.url + "/v1"])
    rid = next(f"f{i}" for i in range(100) if engines.pick(f"f{i}") == dead + "/v1")  # pinned to the dead one
    await make_rollout(store, rid)
    with gateway(redis_url, prefix, f"{dead},{upstream.url}") as gw:
        r = httpx.post(f"{gw.url}/rollouts/{rid}/attempts/0/v1/chat/completions", json=STREAM)
    assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
    (call,) = await records(store, rid)
    assert call.status == "ok" and call.response_token_ids == [7, 8, 9, 2]


async def test_stream_cut_by_a_weight_update_is_retried(store, redis_url, prefix, upstream):
    await make_rollout(store)
    upstream.app.state.abort_next = 1
    with gateway(redis_url, prefix, upstream.url) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=STREAM)
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    text = "".join(ch["delta"].get("content") or "" for e in events[:-1] for ch in e["choices"])
    assert text == "the answer is 7"  # the aborted try's tokens never reached the agent
    calls = await records(store, n=2)
    assert [c.status for c in calls] == ["error", "ok"] and "abort" in calls[0].error


# --------------------------------------------------------------------------- 6. one check for every mode
async def test_token_ids_shorter_than_usage_are_flagged_not_trained(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={**MSG, "x_short_ids": True})
        s = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={**STREAM, "x_drop_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "the answer is 7"
    assert s.status_code == 200
    calls = await records(store, n=2)
    assert [c.status for c in calls] == ["error", "error"]
    assert all("token ids incomplete" in c.error for c in calls)


# --------------------------------------------------------------------------- 7-8. identity
async def test_attempt_ids_are_canonical_and_rollout_ids_name_one_rollout_in_both_forms(store, redis_url, prefix,
                                                                                       upstream):
    """A rollout id is the same string in the path, in the header, in a file name and in Redis: ids of
    RFC 3986's unreserved characters plus ``:@`` reach their rollout in both forms; anything else (not ASCII,
    not UTF-8, ``%``-escapes of other characters) is a 400 in both forms and nothing is recorded."""
    await make_rollout(store, "r_1.2~3:4@5")
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        assert httpx.post(f"{gw.url}/rollouts/r1/attempts/01/v1/chat/completions", json=MSG).status_code == 400
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=MSG,
                          headers={"X-AGL-Rollout-Id": "r1", "X-AGL-Attempt-Id": "00"}).status_code == 400
        a = httpx.post(f"{gw.url}/rollouts/r_1.2~3:4@5/attempts/0/v1/chat/completions", json=MSG)
        b = httpx.post(f"{gw.url}/v1/chat/completions", json=MSG, headers={"X-AGL-Rollout-Id": "r_1.2~3:4@5"})
        refused = [httpx.post(f"{gw.url}/rollouts/r-%C3%A9/attempts/0/v1/chat/completions", json=MSG),
                   httpx.post(f"{gw.url}/v1/chat/completions", json=MSG, headers={"X-AGL-Rollout-Id": "r-é".encode()}),
                   httpx.post(f"{gw.url}/v1/chat/completions", json=MSG, headers={"X-AGL-Rollout-Id": b"r-\xe9"}),
                   httpx.post(f"{gw.url}/rollouts/r%251/attempts/0/v1/chat/completions", json=MSG),
                   httpx.post(f"{gw.url}/v1/chat/completions", json=MSG, headers={"X-AGL-Rollout-Id": "r%31"})]
    assert a.status_code == 200 and b.status_code == 200
    assert [r.status_code for r in refused] == [400] * 5
    assert {r.json()["error"]["code"] for r in refused} <= {"invalid_rollout", "invalid_header"}
    assert len(await store.read_calls("r_1.2~3:4@5")) == 2 and await store.read_calls("r1") == []


async def test_header_form_keys_answer_the_same_on_every_route(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, key="s3cret") as gw:
        mine = {"Authorization": f"Bearer {scoped_key('s3cret', 'r1', '0')}", "X-AGL-Rollout-Id": "r1"}
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=MSG, headers=mine).status_code == 200
        assert httpx.get(f"{gw.url}/v1/models", headers=mine).status_code == 200
        wrong = {"Authorization": "Bearer agl-0123456789012345678901234567890123456789"}
        for rid in ("r1", "no-such-rollout"):  # a wrong key learns nothing about which rollouts exist
            h = {**wrong, "X-AGL-Rollout-Id": rid}
            assert httpx.post(f"{gw.url}/v1/chat/completions", json=MSG, headers=h).status_code == 401
            assert httpx.get(f"{gw.url}/v1/models", headers=h).status_code == 401


# --------------------------------------------------------------------------- 9. whose error is it
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_errors_are_told_apart_from_gateway_errors(store, redis_url, prefix, upstream, stream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        missing = httpx.post(url, json={**MSG, "stream": stream, "x_status": 404})
        refused = httpx.post(url, json={**MSG, "stream": stream, "x_status": 400})
        unknown = httpx.post(f"{gw.url}/rollouts/nope/attempts/0/v1/chat/completions", json=MSG)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "rollout_not_found"
    assert missing.status_code == 502 and missing.json()["error"]["code"] == "upstream_error"
    assert "404" in missing.json()["error"]["message"]
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "upstream_rejected"
    assert "engine refused" in refused.json()["error"]["message"]


# --------------------------------------------------------------------------- 10. engine down at start
async def test_model_is_discovered_once_the_engine_comes_up(store, redis_url, prefix):
    await make_rollout(store)
    port = free_port()
    with gateway(redis_url, prefix, f"http://127.0.0.1:{port}", model=None) as gw:
        app = fake_upstream()
        with Served(app, port=port):
            r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG, timeout=30)
            assert r.status_code == 200 and app.state.calls[-1]["model"] == "fake-model"
            assert httpx.get(f"{gw.url}/v1/models").json()["data"][0]["id"] == "fake-model"
    (call,) = await records(store)
    assert call.model == "fake-model"


async def test_readyz_probe_does_not_take_engines_out_of_service(store, redis_url, prefix):
    await make_rollout(store)
    port = free_port()
    with gateway(redis_url, prefix, f"http://127.0.0.1:{port}") as gw:
        assert httpx.get(f"{gw.url}/readyz").status_code == 503
        app = fake_upstream()
        with Served(app, port=port):
            r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG, timeout=30)
            assert r.status_code == 200
            assert httpx.get(f"{gw.url}/readyz").status_code == 200


# --------------------------------------------------------------------------- 11. the trainer's Redis options
@pytest.mark.parametrize("command", ["train", "demo"])
def test_trainer_train_and_demo_take_redis_and_prefix(command, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agl_trainer import cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda cfg, resume=None: seen.append(cfg))
    config = tmp_path / "c.yaml"
    config.write_text("steps: 1\n")
    args = [command] + ([str(config)] if command == "train" else [])
    runner = CliRunner()
    env = {"AGL_REDIS_URL": "redis://10.0.0.1:6380/3", "AGL_PREFIX": "exp7:"}
    assert runner.invoke(cli.app, args, env=env).exit_code == 0
    assert runner.invoke(cli.app, args + ["--redis", "redis://h:1/2", "--prefix", "p:"]).exit_code == 0
    assert [(c.redis_url, c.prefix) for c in seen] == [("redis://10.0.0.1:6380/3", "exp7:"), ("redis://h:1/2", "p:")]


def test_train_seed_option_overrides_the_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agl_trainer import cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda cfg, resume=None: seen.append(cfg))
    config = tmp_path / "c.yaml"
    config.write_text("steps: 1\nseed: 4\n")
    runner = CliRunner()
    assert runner.invoke(cli.app, ["train", str(config)]).exit_code == 0
    assert runner.invoke(cli.app, ["train", str(config), "--seed", "9"]).exit_code == 0
    assert [c.seed for c in seen] == [4, 9]
    bad = runner.invoke(cli.app, ["train", str(config), "--seed", "x"])
    assert bad.exit_code == 2 and len(seen) == 2


@pytest.mark.parametrize("version", ["-2", "99999999999999999999999", str(2**63)])
def test_resume_refuses_a_version_outside_a_policy_version(version, redis_url, prefix):
    """A negative or over-64-bit version used to be published, recorded on every later call, and then break
    every export of the run (msgpack/Parquet cannot hold it): a usage error, nothing published."""
    from pydantic import ValidationError
    from typer.testing import CliRunner

    from agl_trainer import cli

    result = CliRunner().invoke(cli.app, ["gateway", "resume", "--model", "policy-v3", "--version", version,
                                          "--redis", redis_url, "--prefix", prefix])
    assert result.exit_code == 2 and "--version" in result.output

    async def direct():
        from agl_common.store import Store

        st = Store(redis_url, prefix)
        try:
            with pytest.raises(ValidationError):
                await resume(st, "policy-v3", int(version), release_all=True)
            return await st.last_control()
        finally:
            await st.close()

    assert asyncio.run(direct()) is None  # nothing was published
    ok = CliRunner().invoke(cli.app, ["gateway", "resume", "--model", "policy-v3", "--version", str(2**63 - 1),
                                      "--redis", redis_url, "--prefix", prefix])
    assert ok.exit_code == 0, ok.output


# --------------------------------------------------------------------------- 12. a registry, only the Store
async def test_replica_registry_lists_live_replicas_and_forgets_dead_ones(store):
    await store.heartbeat(ReplicaStatus(replica_id="a"))
    await store.heartbeat(ReplicaStatus(replica_id="b"))
    assert sorted(r.replica_id for r in await store.replicas()) == ["a", "b"]
    await store.drop_replica("a")
    assert [r.replica_id for r in await store.replicas()] == ["b"]


async def test_a_drain_waits_for_a_replica_whose_heartbeat_is_late(store):
    """A replica starved of CPU for longer than the live window (5 s) is still a member: the drain waits for its
    acknowledgement instead of returning at once past its in-flight calls (the flaky load test's cause)."""
    await store.heartbeat(ReplicaStatus(replica_id="starved", in_flight=1))
    await asyncio.sleep(5.3)  # no heartbeat for longer than REPLICA_TTL_S
    assert await store.replicas() == [] and len(await store.replicas(include_late=True)) == 1
    with pytest.raises(DrainTimeout, match=r"starved \(heartbeat \d+ s late\)"):
        await pause_and_drain(store, timeout_s=0.5)
    drain = asyncio.create_task(pause_and_drain(store, timeout_s=10))
    while (cmd := await store.last_control()) is None or cmd.cmd != "pause":
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert not drain.done()
    await store.heartbeat(ReplicaStatus(replica_id="starved", paused=True, drained_ids=[cmd.id]))  # it wakes up
    (status,) = await asyncio.wait_for(drain, 5)
    assert status.replica_id == "starved" and status.in_flight == 0
    await resume(store, release_all=True)


def _raw_redis_uses(path: Path) -> list[str]:
    """``x.r.<method>(...)`` calls on a Store's client outside store.py, and keyspace scans anywhere."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            if node.attr in ("scan_iter", "scan", "keys") and "store.py" in path.name:
                out.append(f"{path.name}:{node.lineno} {node.attr}")
            inner = node.value
            if isinstance(inner, ast.Attribute) and inner.attr == "r" and path.name != "store.py":
                out.append(f"{path.name}:{node.lineno} .r.{node.attr}")
    return out


def test_only_the_store_touches_redis_and_nothing_scans_the_keyspace():
    found = [u for p in sorted((ROOT / "packages").glob("*/src/**/*.py")) for u in _raw_redis_uses(p)]
    assert found == []


# --------------------------------------------------------------------------- 13. nothing blocks the event loop
async def test_the_event_loop_answers_while_litellm_is_imported(store, redis_url, prefix, upstream, monkeypatch):
    """LiteLLM's import (seconds; minutes beside CPU-heavy work) must not stop the gateway answering: here
    the import lasts until ``/healthz`` has answered, which it must do while a translated call waits."""
    import threading

    from agl_gateway import translate

    real = translate._litellm
    release = threading.Event()
    entered: list[str] = []

    def slow_import():
        entered.append(threading.current_thread().name)
        release.wait(60)  # an import in progress (it would hold the module's import lock)
        return real()

    monkeypatch.setattr(translate, "_litellm", slow_import)
    monkeypatch.setattr(translate, "_loaded", threading.Event(), raising=False)
    monkeypatch.setattr(translate, "_thread", None, raising=False)
    monkeypatch.setattr(translate, "_waiters", [], raising=False)
    if hasattr(translate, "warm_in_background"):  # an import already running (before the fix: at start-up)
        translate.warm_in_background()
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=120) as c:
            call = asyncio.create_task(c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages", json={
                "model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}))
            try:
                # until the call waits for the import: on the event loop (the fault: a second entry) or
                # as an awaiting waiter (the fix)
                while not (len(entered) >= 2 or translate._waiters):
                    await asyncio.sleep(0.02)
                health = await c.get(f"{gw.url}/healthz", timeout=30)  # (a blocked loop never answers)
                assert health.status_code == 200 and not call.done()
            finally:
                release.set()
            assert (await call).status_code == 200


@pytest.mark.parametrize("upstream", ["notaurl", "http://", "ftp://h:8000", "http://h:99999", ",", "http://a:8000,b"])
def test_an_upstream_that_is_not_an_engine_url_is_a_usage_error(upstream):
    """``--upstream notaurl`` used to start a gateway that retried an unreachable engine for ever; every entry
    of the comma-separated list must be an http(s) URL with a host (and a port in range)."""
    from typer.testing import CliRunner

    from agl_gateway import cli

    result = CliRunner().invoke(cli.app, ["serve", "--upstream", upstream, "--port", "1"])
    assert result.exit_code == 2 and "upstream" in result.output, (upstream, result.output)
