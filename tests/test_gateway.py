"""The gateway over real HTTP against a fake upstream and a real Redis."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from agl_common.auth import scoped_key
from agl_common.control import pause_and_drain, resume
from agl_common.schemas import Rollout, RolloutStatus
from agl_gateway import GatewaySettings, create_app

from fakes import Served, fake_upstream, free_port

MSG = {"model": "agent-model", "messages": [{"role": "user", "content": "what is 3+4?"}]}


@pytest.fixture
def upstream():
    app = fake_upstream()
    with Served(app) as s:
        s.app = app
        yield s


def gateway(redis_url, prefix, upstream_url, **kw):
    settings = GatewaySettings(upstream=upstream_url, redis_url=redis_url, prefix=prefix, model="agent-model",
                               heartbeat_s=0.2, **kw)
    return Served(create_app(settings))


async def make_rollout(store, rid="r1", attempt="0", status=RolloutStatus.running):
    await store.create_rollout(Rollout(rollout_id=rid, attempt_id=attempt, status=status), enqueue=False)


async def test_path_and_header_forms_record_token_ids(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient() as c:
            r1 = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
            r2 = await c.post(f"{gw.url}/v1/chat/completions", json=MSG, headers={"X-AGL-Rollout-Id": "r1"})
    assert r1.status_code == 200 and r2.status_code == 200
    body = r1.json()
    # the agent sees the normal answer, without what only the recorder asked for
    assert body["choices"][0]["message"]["content"] == "the answer is 7"
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None and body["model"] == "agent-model"
    # upstream was asked for token ids and logprobs
    assert all(c["return_token_ids"] is True and c["logprobs"] is True for c in upstream.app.state.calls)
    calls = await store.read_calls("r1")
    assert [c.seq for c in calls] == [0, 1]
    assert calls[0].prompt_token_ids == [1, 12] and calls[0].response_token_ids == [7, 8, 9, 2]
    assert calls[0].response_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert calls[0].status == "ok" and calls[0].finish_reason == "stop" and calls[0].route == "chat"
    assert calls[0].request == MSG and calls[0].response == body
    assert calls[0].ended_at >= calls[0].started_at > 0


async def test_completions_route(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/completions", json={"model": "m", "prompt": "3+4="})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " 7"
    (call,) = await store.read_calls("r1")
    assert call.route == "completions" and call.prompt_token_ids == [1, 2, 3]
    assert call.response_token_ids == [5, 2] and call.response_logprobs == [-0.5, -0.25]


async def test_bad_input_gets_openai_errors(store, redis_url, prefix, upstream):
    await make_rollout(store)
    await make_rollout(store, "r2", attempt="1")
    with gateway(redis_url, prefix, upstream.url, max_body_bytes=1000) as gw:
        base = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        cases = [
            (httpx.post(base, content=b"{not json"), 400, "invalid_json"),
            (httpx.post(base, content=b"[1, 2]"), 400, "invalid_json"),
            (httpx.post(base, content=b"\xff\xfe"), 400, "invalid_json"),
            (httpx.post(base, json={"messages": ["x" * 2000]}), 413, "body_too_large"),
            (httpx.post(f"{gw.url}/rollouts/nope/attempts/0/v1/chat/completions", json=MSG), 404,
             "rollout_not_found"),
            (httpx.post(f"{gw.url}/rollouts/r2/attempts/0/v1/chat/completions", json=MSG), 409, "stale_attempt"),
            (httpx.post(f"{gw.url}/rollouts/r1/attempts/x/v1/chat/completions", json=MSG), 400,
             "invalid_attempt"),
            (httpx.post(f"{gw.url}/v1/chat/completions", json=MSG), 400, "missing_rollout"),
            (httpx.get(f"{gw.url}/v1/nothing-here"), 404, "not_found"),
        ]
        for resp, status, code in cases:
            assert resp.status_code == status, resp.text
            err = resp.json()["error"]
            assert err["code"] == code and isinstance(err["message"], str) and err["type"]
    assert upstream.app.state.calls == []  # nothing bad was forwarded
    assert await store.read_calls("r1") == []


async def test_finished_rollout_refuses_calls(store, redis_url, prefix, upstream):
    await make_rollout(store, status=RolloutStatus.queuing)
    await store.set_status("r1", RolloutStatus.failed, "timeout")
    with gateway(redis_url, prefix, upstream.url) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
        late = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/reward", json={"value": 1.0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_finished"
    # a late reward does not rewrite a finished outcome (it used to be accepted and overwrite it)
    assert late.status_code == 409 and late.json()["error"]["code"] == "rollout_finished", late.text
    rollout = await store.get_rollout("r1")
    assert (rollout.status, rollout.failure, rollout.reward) == (RolloutStatus.failed, "timeout", None)


async def test_open_mode_creates_rollouts(store, redis_url, prefix, upstream):
    with gateway(redis_url, prefix, upstream.url, open=True) as gw:
        r = httpx.post(f"{gw.url}/rollouts/new-one/attempts/2/v1/chat/completions", json=MSG)
    assert r.status_code == 200
    rollout = await store.get_rollout("new-one")
    assert rollout.attempt_id == "2" and rollout.status == RolloutStatus.running
    assert len(await store.read_calls("new-one")) == 1


async def test_upstream_failures_map_to_502_504_and_are_recorded(store, redis_url, prefix, upstream):
    await make_rollout(store)
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway(redis_url, prefix, dead) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        ready = httpx.get(f"{gw.url}/readyz")
        assert ready.status_code == 503 and ready.json()["checks"] == {"redis": True, "upstream": False}
    with gateway(redis_url, prefix, upstream.url, upstream_timeout_s=0.3) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        assert httpx.post(url, json={**MSG, "x_delay": 2}).status_code == 504
        r = httpx.post(url, json={**MSG, "x_fail": "garbage"})  # a dict without choices: no answer for the agent
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        r = httpx.post(url, json={**MSG, "x_fail": "null"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    calls = await store.read_calls("r1")
    assert [c.status for c in calls] == ["error", "error", "error", "error"]  # (the dict: never recorded as good)
    assert "no choices" in calls[2].error
    assert calls[2].response_token_ids == []  # garbage answer: recorded, but yields no training row


async def test_pause_holds_new_calls_and_drains_in_flight(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as c:
            await asyncio.sleep(0.3)  # first heartbeat
            slow = asyncio.create_task(c.post(url, json={**MSG, "x_delay": 1.0}))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            replicas = await pause_and_drain(store, timeout_s=10)
            # the drain waited for the in-flight call, which finished normally
            assert time.monotonic() - t0 > 0.4 and slow.done() and (await slow).status_code == 200
            assert len(replicas) == 1 and replicas[0].paused and replicas[0].in_flight == 0
            n_upstream = len(upstream.app.state.calls)
            held = asyncio.create_task(c.post(url, json=MSG))
            await asyncio.sleep(0.8)
            assert not held.done()  # held, not rejected
            assert len(upstream.app.state.calls) == n_upstream  # and not forwarded
            status = (await store.replicas())[0]
            assert status.held == 1
            await resume(store, model="policy-v1", version=1, release_all=True)
            r = await asyncio.wait_for(held, 10)
    assert r.status_code == 200
    assert upstream.app.state.calls[-1]["model"] == "policy-v1"
    calls = await store.read_calls("r1")
    assert [c.model_version for c in calls] == [0, 1]


async def test_held_too_long_gets_503_retry_after(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, max_hold=0.5) as gw:
        await asyncio.sleep(0.3)
        await pause_and_drain(store, timeout_s=5)
        r = await asyncio.to_thread(httpx.post, f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
        await resume(store, release_all=True)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "paused"
    assert upstream.app.state.calls == []


async def test_reward_and_events(store, redis_url, prefix, upstream):
    await make_rollout(store)
    await make_rollout(store, "r2", attempt="1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        base = f"{gw.url}/rollouts/r1/attempts/0"
        assert httpx.post(base + "/reward", json={"value": 0.5, "message": "ok"}).status_code == 200
        assert httpx.post(base + "/reward", json={"value": "high"}).status_code == 400
        assert httpx.post(base + "/reward", content=b"nope").status_code == 400
        assert httpx.post(base + "/reward", json={"value": 1, "extra": 1}).status_code == 400
        assert httpx.post(f"{gw.url}/rollouts/r2/attempts/0/reward", json={"value": 1}).status_code == 409
        assert httpx.post(f"{gw.url}/rollouts/zz/attempts/0/reward", json={"value": 1}).status_code == 404
        assert httpx.post(base + "/events", json={"type": "tool", "data": {"n": 1}}).status_code == 200
    r1 = await store.get_rollout("r1")
    assert r1.reward == 0.5 and r1.reward_message == "ok"
    assert (await store.get_rollout("r2")).reward is None
    assert [e["type"] for e in await store.read_events("r1")] == ["tool"]


async def test_keys_admin_and_rollout_scoped(store, redis_url, prefix, upstream):
    await make_rollout(store)
    await make_rollout(store, "r2")
    with gateway(redis_url, prefix, upstream.url, key="s3cret") as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        mine, other = scoped_key("s3cret", "r1", "0"), scoped_key("s3cret", "r2", "0")
        assert httpx.post(url, json=MSG).status_code == 401
        assert httpx.post(url, json=MSG, headers={"Authorization": f"Bearer {other}"}).status_code == 401
        assert httpx.post(url, json=MSG, headers={"Authorization": f"Bearer {mine}"}).status_code == 200
        assert httpx.post(url, json=MSG, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=MSG,
                          headers={"Authorization": f"Bearer {mine}", "X-AGL-Rollout-Id": "r1"}).status_code == 200
        assert httpx.post(f"{gw.url}/rollouts/r2/attempts/0/reward", json={"value": 1},
                          headers={"x-api-key": mine}).status_code == 401
    assert len(await store.read_calls("r1")) == 3 and await store.read_calls("r2") == []
    for c in await store.read_calls("r1"):
        assert "s3cret" not in c.model_dump_json() and mine not in c.model_dump_json()


async def test_redis_down_gives_503(upstream):
    settings = GatewaySettings(upstream=upstream.url, redis_url=f"redis://127.0.0.1:{free_port()}/0", model="m")
    with Served(create_app(settings)) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert httpx.get(f"{gw.url}/readyz").status_code == 503
        assert httpx.get(f"{gw.url}/healthz").status_code == 200
    assert upstream.app.state.calls == []


async def test_models_and_metrics(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
        assert httpx.get(f"{gw.url}/v1/models").json()["data"][0]["id"] == "agent-model"
        text = httpx.get(f"{gw.url}/metrics").text
    assert 'agl_gateway_requests_total{route="/rollouts/{rollout_id}/attempts/{attempt_id}/v1/chat/completions",status="200"} 1.0' in text
    assert "agl_gateway_tokens_total" in text
    assert 'agl_gateway_added_seconds_count{route="chat"} 1.0' in text


async def test_rollouts_pinned_to_one_engine_and_failover(store, redis_url, prefix):
    apps = [fake_upstream(), fake_upstream()]
    with Served(apps[0]) as up_a, Served(apps[1]) as up_b:
        for i in range(12):
            await make_rollout(store, f"p{i}")
        with gateway(redis_url, prefix, f"{up_a.url},{up_b.url}/v1") as gw:
            for _ in range(2):
                for i in range(12):
                    r = httpx.post(f"{gw.url}/rollouts/p{i}/attempts/0/v1/chat/completions",
                                   json={**MSG, "messages": [{"role": "user", "content": f"p{i}"}]})
                    assert r.status_code == 200
            served = [{c["messages"][0]["content"] for c in app.state.calls} for app in apps]
            assert served[0] and served[1] and not served[0] & served[1]  # each rollout stays on one engine
            assert all(len(app.state.calls) == 2 * len(s) for app, s in zip(apps, served))
            up_a.__exit__(None, None, None)  # engine A goes away: its rollouts move to B
            for content in served[0]:
                r = httpx.post(f"{gw.url}/rollouts/{content}/attempts/0/v1/chat/completions",
                               json={**MSG, "messages": [{"role": "user", "content": content}]})
                assert r.status_code == 200
            assert len(apps[1].state.calls) == 2 * len(served[1]) + len(served[0])


async def test_pause_reaches_every_replica(store, redis_url, prefix, upstream):
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url, replica_id="a") as gw1, \
            gateway(redis_url, prefix, upstream.url, replica_id="b") as gw2:
        await asyncio.sleep(0.5)
        assert len(await store.replicas()) == 2
        replicas = await pause_and_drain(store, timeout_s=5)
        assert len(replicas) == 2 and all(r.paused for r in replicas)
        async with httpx.AsyncClient(timeout=30) as c:
            held = [asyncio.create_task(c.post(f"{g.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG))
                    for g in (gw1, gw2)]
            await asyncio.sleep(0.8)
            assert not any(t.done() for t in held) and upstream.app.state.calls == []
            assert sum(r.held for r in await store.replicas()) == 2
            await resume(store, release_all=True)
            assert [(await t).status_code for t in held] == [200, 200]
    assert len(await store.read_calls("r1")) == 2


async def test_the_store_refuses_a_rollout_id_that_cannot_name_one(store):
    """Every way a rollout is created (the gateway's ``--open``, ``rollouts create``, the trainer) goes through
    ``Store.create_rollout``: an id with whitespace, a control character or a hash-tag brace, or an empty or
    over-long one, is refused there and nothing is stored."""
    # ...and one that would not be the same string in a URL path, a header, a file name and Redis:
    # ``x%41`` was recorded as ``xA``, ``a/b`` could not spawn, ``a?b``/``a#b`` got 404, ``../x`` wrote
    # its log outside the log directory
    for rid in ("", " ", "a\tb", "a\x00b", "x{y", "y}", "r" * 257, "x%41", "a/b", "a?b", "a#b", "..", "../x",
                ".hidden", "-opt", "ok-é", "a\\b"):
        with pytest.raises(ValueError, match="rollout id"):
            await store.create_rollout(Rollout(rollout_id=rid))
    assert await store.queued_ids() == []
    await store.create_rollout(Rollout(rollout_id="ok_1.2~3:4@5-6"))  # ASCII letters, digits and ._~:@-
    assert await store.queued_ids() == ["ok_1.2~3:4@5-6"]
