"""Hostile input, round 11 (docs/operations.md "Hostile input"): what round 10 left open, and the round's prober."""

from __future__ import annotations

import httpx
import orjson

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)
from test_hostile6 import _last, _one


async def test_a_finish_reason_that_is_no_answer_is_an_upstream_error(store, redis_url, prefix, upstream):
    """Round 10 left open: ``finish_reason: "banana"`` (or vLLM's ``error``) was recorded ``ok`` and passed on as an
    answer. A generation ends as an answer only with a known reason (OpenAI's, and vLLM's ``repetition``); any
    other is a 502 (a stream: an ``upstream_error`` event), recorded as an error naming it."""
    from fakes import chat_answer, chat_chunks, completion_answer

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for finish in ("banana", "error", "STOP"):
                for route in ("chat/completions", "completions"):
                    if route == "completions":
                        body = completion_answer("up", [1, 2, 3], [5, 2])
                    else:
                        body = chat_answer("up", [1, 2, 3], [5, 6, 2])
                    body["choices"][0]["finish_reason"] = finish
                    upstream.app.state.plan = ("body", 200, orjson.dumps(body))
                    r = await _one(c, gw, {"prompt": "3+4?"} if route == "completions" else {}, route=route)
                    assert r.status_code == 502 and finish in r.text, (finish, route, r.status_code, r.text[:300])
                    rec = await _last(store)
                    assert rec.status == "error" and f"finish reason '{finish}'" in rec.error, (finish, rec.error)
                upstream.app.state.plan = ("stream", chat_chunks("up", [1, 2, 3], [7, 8, 9, 2], finish=finish), "done")
                r = await _one(c, gw, {"stream": True})
                assert r.status_code == 200 and "upstream_error" in r.text and "[DONE]" not in r.text, r.text[-300:]
                assert (await _last(store)).status == "error"
            body = chat_answer("up", [1, 2, 3], [5, 6, 2])
            body["choices"][0]["finish_reason"] = "repetition"  # vLLM's repetition detector: a sampled answer
            upstream.app.state.plan = ("body", 200, orjson.dumps(body))
            r = await _one(c, gw)
            assert r.status_code == 200 and (await _last(store)).status == "ok", r.text[:300]
    upstream.app.state.plan = None
