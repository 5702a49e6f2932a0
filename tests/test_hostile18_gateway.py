"""Round 18 of hostile input, the gateway (docs/operations.md, "An eighteenth round"): each test failed before its
fix."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import orjson
from agl_gateway.app import _heartbeat_loop
from agl_gateway.gate import PauseGate
from agl_gateway.metrics import Metrics

from fakes import chat_answer, completion_answer
from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)
from test_hostile6 import _last


def _events(text: str) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of a server-sent-event stream."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((lines["event"], orjson.loads(lines["data"])))
    return out


async def test_a_responses_reasoning_item_is_in_openais_shape(store, redis_url, prefix, upstream):
    """The prober saw an engine answer with ``reasoning_content`` become the output item ``{"type": "reasoning",
    "role": "assistant", "content": [{"type": "output_text", ...}]}``: no ``summary``, parts of another type, a
    ``role``; the ``openai`` SDK's ``Response`` / ``ResponseReasoningItem`` refused it, in the complete answer and in a
    synthesized stream's ``response.output_item.added``/``done`` and ``response.completed``. Now the item is
    OpenAI's (``summary: []``, ``reasoning_text`` parts holding the engine's reasoning) in one place
    (``translate.chat_to_responses``) that both use, and sent back in ``input`` the next turn is still a 200 that
    reaches the engine as before (the reasoning as ``reasoning_content``)."""
    from openai.types.responses import (Response, ResponseCompletedEvent, ResponseOutputItemAddedEvent,
                                        ResponseOutputItemDoneEvent, ResponseReasoningItem)

    await make_rollout(store, "r1")
    answer = chat_answer("up", [1, 2, 3], [7, 8, 9, 2])
    answer["choices"][0]["message"]["reasoning_content"] = "3 and 4 make 7"
    upstream.app.state.plan = ("body", 200, orjson.dumps(answer))
    with gateway(redis_url, prefix, upstream.url) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/responses"
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url, json={"model": "m", "input": "3+4?"})
            assert r.status_code == 200, r.text[:300]
            raw = r.json()
            Response.model_validate(raw)  # whole: usage too (round 19: its detail objects were null)
            item = ResponseReasoningItem.model_validate(raw["output"][0])
            assert item.summary == [] and [(p.type, p.text) for p in item.content] == [("reasoning_text",
                                                                                         "3 and 4 make 7")]
            assert "role" not in raw["output"][0] and raw["output"][1]["type"] == "message"

            r = await c.post(url, json={"model": "m", "input": "3+4?", "stream": True})
            assert r.status_code == 200, r.text[:300]
            events = _events(r.text)
            kinds = {"response.output_item.added": ResponseOutputItemAddedEvent,
                     "response.output_item.done": ResponseOutputItemDoneEvent}
            for name, data in events:
                if name in kinds:
                    kinds[name].model_validate(data)
            done = [d["item"] for n, d in events if n == "response.output_item.done"]
            assert done[0]["type"] == "reasoning" and done[0]["content"][0]["type"] == "reasoning_text"
            completed = events[-1][1]
            ResponseCompletedEvent.model_validate(completed)
            assert completed["response"]["output"][0] == done[0]

            n = len(upstream.app.state.calls)
            r = await c.post(url, json={"model": "m", "input": [{"role": "user", "content": "3+4?"}, *raw["output"],
                                                                {"role": "user", "content": "and 5+5?"}]})
            assert r.status_code == 200, r.text[:300]
            sent = upstream.app.state.calls[n]["messages"]
            assert sent[1]["role"] == "assistant" and sent[1].get("reasoning_content") == "3 and 4 make 7", sent
    upstream.app.state.plan = None


async def test_a_token_id_prompt_is_compared_with_the_engines_prompt_ids(store, redis_url, prefix, upstream):
    """The prober sent a completions ``prompt`` of token ids (``[900, ..., 904]``); the engine answered
    ``prompt_token_ids: [1, 2, 3]`` and the call was recorded ``ok`` with prompt ids the agent never sent. vLLM
    answers a token-id prompt for exactly those ids, so the gateway has the truth: the record is now an ``error``
    naming the difference (the agent still gets its answer, as for the other capture checks); ids the engine
    echoes are ``ok``, as is a prompt the engine was asked to cut (``truncate_prompt_tokens``) whose ids are the
    end of the agent's; a text prompt is not compared (only the engine's tokenizer knows its ids)."""
    await make_rollout(store, "r1")
    sent = [900, 901, 902, 903, 904]
    cases = [  # (prompt, extra request fields, the engine's prompt ids, the record's status)
        (sent, {}, [1, 2, 3], "error"),
        ([sent], {}, [1, 2, 3], "error"),
        (sent, {}, sent[:4], "error"),
        (sent, {}, [*sent, 905], "error"),
        (sent, {"truncate_prompt_tokens": 2}, [1, 2], "error"),
        (sent, {}, sent, "ok"),
        ([sent], {}, sent, "ok"),
        (sent, {"truncate_prompt_tokens": 2}, sent[-2:], "ok"),
        ("3+4=", {}, [1, 2, 3], "ok"),
    ]
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for prompt, extra, engine_ids, status in cases:
                upstream.app.state.plan = ("body", 200, orjson.dumps(completion_answer("up", engine_ids)))
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/completions",
                                 json={"model": "m", "prompt": prompt, **extra})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == " 7", r.text[:300]
                rec = await _last(store)
                assert rec.status == status, (prompt, extra, engine_ids, rec.status, rec.error)
                if status == "error":
                    assert "prompt token ids are not the agent's" in rec.error, rec.error
    upstream.app.state.plan = None


async def test_responses_store_is_answered_false_and_background_is_refused(store, redis_url, prefix, upstream):
    """The prober saw ``store: true`` echoed back (``"store": true``) though nothing is stored (a later
    ``previous_response_id`` is a 400), and ``background: true`` answered at once as ``completed`` (nothing could
    be polled). Now every answer, and a synthesized stream's responses, say ``"store": false``; ``background:
    true`` is a 400 naming the field before the engine; ``background: false`` is served as before."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/responses"
        async with httpx.AsyncClient(timeout=30) as c:
            for flag in (True, False, None):
                body = {"model": "m", "input": "3+4?", **({} if flag is None else {"store": flag})}
                r = await c.post(url, json=body)
                assert r.status_code == 200 and r.json()["store"] is False, (flag, r.text[:300])
                r = await c.post(url, json={**body, "stream": True})
                got = [d["response"]["store"] for _, d in _events(r.text) if "response" in d]
                assert r.status_code == 200 and got and set(got) == {False}, (flag, got)
            n = len(upstream.app.state.calls)
            for value in (True, "yes", 1):
                r = await c.post(url, json={"model": "m", "input": "3+4?", "background": value})
                assert r.status_code == 400 and "'background'" in r.text, (value, r.status_code, r.text[:300])
            assert len(upstream.app.state.calls) == n  # refused before the engine
            r = await c.post(url, json={"model": "m", "input": "3+4?", "background": False})
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text[:300]


async def test_a_gate_change_during_a_heartbeat_write_is_published_at_once():
    """The prober read ``_heartbeat_loop``: it cleared its wake-up after writing a heartbeat, so a gate change (a
    pause, a drain) made while that write was awaited was lost, and published only ``heartbeat_s`` later (a
    drain waited that long to see this replica drained). Now the wake-up is cleared before the status is read: a
    change during the write is published by the next heartbeat at once."""
    wake = asyncio.Event()
    gate = PauseGate(60.0, on_change=wake.set)
    writing, release = asyncio.Event(), asyncio.Event()
    seen: list[tuple[float, bool]] = []

    class Store:
        async def heartbeat(self, status, owner):
            seen.append((time.monotonic(), status.paused))
            if len(seen) == 1:  # the first write is slow; the gate changes meanwhile
                writing.set()
                await release.wait()
            return True

    st = SimpleNamespace(gate=gate, policy=None, settings=SimpleNamespace(replica_id="gw", heartbeat_s=30.0),
                         store=Store(), owner="o", displaced=False, metrics=Metrics())
    loop = asyncio.create_task(_heartbeat_loop(st, wake))
    try:
        await asyncio.wait_for(writing.wait(), 5)
        gate.hold(frozenset({"p1"}))  # a pause, while the first heartbeat is being written
        t0 = time.monotonic()
        release.set()
        for _ in range(100):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.05)
        assert len(seen) >= 2, "the pause was not published: the next heartbeat waits heartbeat_s (30 s)"
        assert seen[1][1] is True and seen[1][0] - t0 < 5
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
