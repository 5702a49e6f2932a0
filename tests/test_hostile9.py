"""Hostile input, round 9 (docs/operations.md "Hostile input"): what a fresh probing round found."""

from __future__ import annotations

import httpx
import orjson

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)
from test_hostile6 import _last, _one


async def test_tokens_after_a_streams_finish_reason_make_an_error_record(store, redis_url, prefix, upstream):
    """A stream that goes on after its finish reason (``stop``, then more tokens; or ``stop``, more, ``length``)
    was recorded ``ok`` with the extra ids: not one generation. The abort chunk and the usage chunk after the
    finish still pass."""
    from fakes import chat_chunks

    await make_rollout(store, "r1")
    chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
    extra = orjson.loads(chunks[-2][len(b"data: "):])  # the last token chunk (finish_reason "stop")
    extra["choices"][0].update(delta={"content": " EXTRA"}, token_ids=[5], finish_reason=None)
    more = b"data: " + orjson.dumps(extra) + b"\n\n"
    extra["choices"][0]["finish_reason"] = "length"
    more_then_length = b"data: " + orjson.dumps(extra) + b"\n\n"
    def usage(extra: int) -> bytes:  # the engine's usage counts the extra tokens too: only the order is wrong
        last = orjson.loads(chunks[-1][len(b"data: "):])
        last["usage"]["completion_tokens"] += extra
        return b"data: " + orjson.dumps(last) + b"\n\n"

    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for sent in ([*chunks[:-1], more, usage(1)], [*chunks[:-1], more, more_then_length, usage(2)]):
                upstream.app.state.plan = ("stream", sent, "done")
                await _one(c, gw, {"stream": True})
                rec = await _last(store)
                assert rec.status == "error" and "after the stream's finish reason" in rec.error, (rec.status,
                                                                                                    rec.error)
            for sent in (chunks, chat_chunks("up", [1, 2, 3], [], finish="abort")):
                upstream.app.state.plan = ("stream", sent, "done")
                await _one(c, gw, {"stream": True})
                rec = await _last(store)
                assert "after the stream's finish reason" not in (rec.error or ""), rec.error
            upstream.app.state.plan = ("stream", chunks, "done")
            await _one(c, gw, {"stream": True})
            assert (await _last(store)).status == "ok"
    upstream.app.state.plan = None


async def test_the_record_is_the_choice_with_index_0_and_indexes_must_be_whole(store, redis_url, prefix, upstream):
    """With ``n > 1`` the record took the list's first choice whatever its ``index``, and two choices both
    ``index: 0`` were ``ok``."""
    import copy

    from fakes import chat_answer

    await make_rollout(store, "r1")
    body = chat_answer("up", [1, 2, 3], [5, 6, 2])
    zero = body["choices"][0]
    one = copy.deepcopy(zero)
    one.update(index=1, token_ids=[7, 2])
    one["logprobs"]["content"] = one["logprobs"]["content"][:2]
    body["usage"]["completion_tokens"] = 5
    swapped = {**body, "choices": [one, zero]}
    twice = {**body, "choices": [zero, {**one, "index": 0}]}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            upstream.app.state.plan = ("body", 200, orjson.dumps(swapped))
            await _one(c, gw, {"n": 2})
            rec = await _last(store)
            assert (rec.status, rec.response_token_ids) == ("ok", [5, 6, 2]), (rec.status, rec.error)
            upstream.app.state.plan = ("body", 200, orjson.dumps(twice))
            await _one(c, gw, {"n": 2})
            rec = await _last(store)
            assert rec.status == "error" and "indexes" in rec.error, (rec.status, rec.error)
    upstream.app.state.plan = None
