"""Hostile input, round 8 (docs/operations.md "Hostile input"): what round 7 left open and a fresh probing round
found."""

from __future__ import annotations

import httpx
import orjson

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)
from test_hostile6 import _last, _one


async def test_an_answer_the_agent_cannot_read_is_an_error_record(store, redis_url, prefix, upstream):
    """Round 7 left open: a chat answer with token ids and logprobs but no ``message`` (or a completion without
    ``text``) was recorded ``ok`` with an empty answer: a reply the agent never saw became training data."""
    from fakes import chat_answer, completion_answer

    await make_rollout(store, "r1")
    no_message = chat_answer("up", [1, 2, 3], [5, 6, 2])
    del no_message["choices"][0]["message"]
    odd_message = chat_answer("up", [1, 2, 3], [5, 6, 2])
    odd_message["choices"][0]["message"] = "the answer is 7"
    no_text = completion_answer("up", [1, 2, 3], [5, 2])
    del no_text["choices"][0]["text"]
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for route, body, word in (("chat/completions", no_message, "message"),
                                      ("chat/completions", odd_message, "message"),
                                      ("completions", no_text, "text")):
                upstream.app.state.plan = ("body", 200, orjson.dumps(body))
                extra = {"prompt": "3+4?"} if route == "completions" else {}
                await _one(c, gw, extra, route=route)
                rec = await _last(store)
                assert rec.status == "error" and word in rec.error, (route, rec.status, rec.error)
            upstream.app.state.plan = None
            assert (await _one(c, gw)).status_code == 200 and (await _last(store)).status == "ok"


async def test_responses_options_at_their_defaults_still_pass(store, redis_url, prefix, upstream):
    """Round 8 refuses ``top_logprobs``/``max_tool_calls``/``truncation`` the translation drops (the table in
    test_hostile6); at their defaults, which SDKs send, the call is answered and recorded ``ok``."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/responses",
                             json={"model": "m", "input": "3+4?", "top_logprobs": 0, "max_tool_calls": None,
                                   "truncation": "disabled"})
    assert r.status_code == 200, r.text[:300]
    assert (await _last(store)).status == "ok"


async def test_a_retried_attempt_starts_with_no_events(store, redis_url, prefix, upstream, monkeypatch):
    """Round 7 left open: the event cap counted the rollout's stream, so an attempt that posted the most events
    (a harness in a loop) left its retry unable to post a single one."""
    import agl_gateway.routes.rollouts as routes

    monkeypatch.setattr(routes, "EVENTS_PER_ATTEMPT_MAX", 3)
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            first = [(await c.post(f"{gw.url}/rollouts/r1/attempts/0/events", json={"type": "t"})).status_code
                     for _ in range(4)]
            await store.update_rollout("r1", lambda r: setattr(r, "attempt_id", "1"))
            retry = [(await c.post(f"{gw.url}/rollouts/r1/attempts/1/events", json={"type": "t"})).status_code
                     for _ in range(4)]
    assert first == [200, 200, 200, 429] and retry == [200, 200, 200, 429], (first, retry)
    assert [e["attempt_id"] for e in await store.read_events("r1")] == ["0"] * 3 + ["1"] * 3


async def test_a_stale_attempt_naming_only_its_rollout_gets_the_409_the_path_form_gets(store, redis_url, prefix,
                                                                                       upstream):
    """Round 7 left open: a retried harness's late call in the header form (``X-AGL-Rollout-Id`` only, its own
    scoped key) was a 401 "invalid API key", where the path form says 409 stale attempt."""
    from agl_common.auth import scoped_key

    await make_rollout(store, "r1")
    await store.update_rollout("r1", lambda r: setattr(r, "attempt_id", "2"))
    body = {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]}
    with gateway(redis_url, prefix, upstream.url, key="adminkey") as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            async def call(attempt_key, path=False):
                url = gw.url + ("/rollouts/r1/attempts/0" if path else "") + "/v1/chat/completions"
                return await c.post(url, json=body, headers={"X-AGL-Rollout-Id": "r1",
                                                             "Authorization": f"Bearer {attempt_key}"})
            stale_path = await call(scoped_key("adminkey", "r1", "0"), path=True)
            stale_header = await call(scoped_key("adminkey", "r1", "0"))
            current = await call(scoped_key("adminkey", "r1", "2"))
            other = await call(scoped_key("adminkey", "r9", "0"))
            admin = await call("adminkey")
    assert stale_path.status_code == 409 and stale_header.status_code == 409, (stale_path.text, stale_header.text)
    assert stale_header.json()["error"]["code"] == "stale_attempt"
    assert current.status_code == 200 and admin.status_code == 200 and other.status_code == 401
