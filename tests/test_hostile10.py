"""Hostile input, round 10 (docs/operations.md "Hostile input"): what round 9 left open."""

from __future__ import annotations

import httpx
import orjson

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)
from test_hostile6 import _last, _one


async def test_an_answer_the_agent_cannot_read_is_a_502_not_a_200(store, redis_url, prefix, upstream):
    """Round 9 left open: an engine answer the record called an error (no choices, a choice without ``message``
    or ``text``, no finish reason) still reached the agent with status 200, and the Anthropic route translated it
    into ``content: []`` with ``stop_reason: "end_turn"``: an agent took nothing for a finished answer. Now
    each is an upstream failure (CONTRACT §1: 502), recorded as an error with the reason; a good answer is 200."""
    from fakes import chat_answer, completion_answer

    await make_rollout(store, "r1")
    no_choices = {**chat_answer("up", [1, 2, 3], [5, 6, 2]), "choices": []}
    no_message = chat_answer("up", [1, 2, 3], [5, 6, 2])
    del no_message["choices"][0]["message"]
    no_finish = chat_answer("up", [1, 2, 3], [5, 6, 2])
    no_finish["choices"][0]["finish_reason"] = None
    no_text = completion_answer("up", [1, 2, 3], [5, 2])
    del no_text["choices"][0]["text"]
    anthropic = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"}]}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for route, body, word in (("chat/completions", no_choices, "no choices"),
                                      ("chat/completions", no_message, "message"),
                                      ("chat/completions", no_finish, "no finish reason"),
                                      ("completions", no_text, "text"),
                                      ("messages", no_choices, "no choices")):
                upstream.app.state.plan = ("body", 200, orjson.dumps(body))
                if route == "messages":
                    r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages", json=anthropic)
                else:
                    r = await _one(c, gw, {"prompt": "3+4?"} if route == "completions" else {}, route=route)
                assert r.status_code == 502 and word in r.text, (route, word, r.status_code, r.text[:300])
                if route == "messages":  # Anthropic's error shape, not a translated empty answer
                    assert r.json()["type"] == "error" and "end_turn" not in r.text, r.text[:300]
                rec = await _last(store)
                assert rec.status == "error" and word in rec.error, (route, rec.status, rec.error)
            upstream.app.state.plan = None
            assert (await _one(c, gw)).status_code == 200 and (await _last(store)).status == "ok"


async def test_a_stream_the_agent_cannot_read_ends_with_an_upstream_error(store, redis_url, prefix, upstream):
    """Round 9 left open: a stream without a finish reason ended with ``[DONE]`` (a complete, empty-ended answer
    for the agent), and a stream of only ``[DONE]`` was a 200 with no answer. Now the first ends with an
    ``upstream_error`` event instead of ``[DONE]``, the second is a 502; the engine's own error event still reaches
    the agent as it did, and a good stream ends with ``[DONE]``."""
    from fakes import chat_chunks

    await make_rollout(store, "r1")
    chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
    error = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            upstream.app.state.plan = ("stream", chunks[:3], "done")  # role chunk, two tokens, no finish reason
            r = await _one(c, gw, {"stream": True})
            assert r.status_code == 200 and "upstream_error" in r.text and "[DONE]" not in r.text, r.text[-300:]
            assert "no finish reason" in (await _last(store)).error
            upstream.app.state.plan = ("stream", [], "done")
            r = await _one(c, gw, {"stream": True})
            assert r.status_code == 502 and "upstream_error" in r.text, (r.status_code, r.text[:300])
            assert (await _last(store)).status == "error"
            upstream.app.state.plan = ("stream", chunks[:3] + [error], "done")
            r = await _one(c, gw, {"stream": True})
            assert r.status_code == 200 and "engine died" in r.text and "upstream_error" not in r.text, r.text[-300:]
            assert "engine died" in (await _last(store)).error
            upstream.app.state.plan = ("stream", chunks, "done")
            r = await _one(c, gw, {"stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]"), r.text[-300:]
            assert (await _last(store)).status == "ok"
    upstream.app.state.plan = None
