"""Bad input, property-based (hypothesis): every gateway route gets malformed, oversized and wrongly typed
bodies, bad headers, and an upstream that answers garbage or cuts its stream.

Invariants checked after every example:
- never a 500, never a crash (``/healthz`` answers), every non-2xx is JSON in the OpenAI shape (Anthropic's
  on ``/messages`` routes);
- the gateway's pause gate is back to 0 in flight and 0 held (a leaked slot would block every drain);
- every upstream model call that reached the recording step left exactly one record, and every record in
  Redis validates as :class:`CallRecord`, with ``seq`` 0, 1, 2... per attempt (no gap, no duplicate).

The gateway runs in-process over real HTTP (uvicorn thread) against the fake upstream of tests/fakes.py,
scripted through its ``plan``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import defaultdict

import httpx
import orjson
import pytest
import redis
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from agl_gateway import GatewaySettings, create_app
from fakes import IDS, Served, chat_answer, chat_chunks, completion_answer, fake_upstream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_BODY = 16 * 1024


def dumps(obj) -> bytes:
    """JSON bytes of anything hypothesis draws (stdlib: orjson refuses ints over 64 bits)."""
    return json.dumps(obj, ensure_ascii=False).encode()
H = settings(max_examples=int(os.environ.get("AGL_HYPOTHESIS_EXAMPLES", "40")), deadline=None, database=None,
             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------- fake upstream
# The engine is tests/fakes.py's; a test scripts its answers with ``app.state.plan`` and counts arrivals on the
# model routes with ``len(app.state.calls)`` (each must leave exactly one record).
def good_chat() -> dict:
    return chat_answer("up", [1, 2, 3], IDS)


def good_completion() -> dict:
    return completion_answer("up")


def good_stream_chunks() -> list[bytes]:
    return chat_chunks("up", [1, 2, 3], IDS)


# ----------------------------------------------------------------------------------------- fixtures
class Env:
    def __init__(self, gw, up, r: redis.Redis, prefix: str, app):
        self.gw, self.up, self.r, self.prefix, self.app = gw, up, r, prefix, app
        self.client = httpx.Client(timeout=30)

    @property
    def gate(self):
        return self.app.state.agl.gate

    def n_records(self) -> int:
        return sum(self.r.xlen(k) for k in self.r.scan_iter(match=self.prefix + "calls:*", count=1000))


@pytest.fixture(scope="module")
def env(redis_url):
    prefix = f"test-bad-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(redis_url)
    for rid, attempt in (("r1", "0"), ("r2", "1")):
        r.set(prefix + "rollout:{" + rid + "}", Rollout(rollout_id=rid, attempt_id=attempt,
                                                 status=RolloutStatus.running).model_dump_json())
    with Served(fake_upstream(model="up")) as ups:
        app = create_app(GatewaySettings(upstream=ups.url, redis_url=redis_url, prefix=prefix, model="agent-model",
                                         max_body_bytes=MAX_BODY, heartbeat_s=0.5, upstream_timeout_s=10))
        with Served(app) as gw:
            e = Env(gw, ups.app.state, r, prefix, app)
            from agl_gateway import translate
            translate.warm()  # LiteLLM's import takes seconds: not inside a hypothesis example
            yield e
            e.client.close()
            check_all_records(e)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)


def check_all_records(e: Env) -> None:
    """Every record validates; seq is 0..n-1 per (rollout, attempt), each once."""
    seqs = defaultdict(list)
    for key in e.r.scan_iter(match=e.prefix + "calls:*", count=1000):
        for _, fields in e.r.xrange(key):
            rec = CallRecord.model_validate_json(fields[b"d"])
            seqs[(rec.rollout_id, rec.attempt_id)].append(rec.seq)
            assert rec.ended_at >= rec.started_at > 0
            if rec.response_logprobs is not None:
                assert len(rec.response_logprobs) == len(rec.response_token_ids)
    for k, s in seqs.items():
        assert sorted(s) == list(range(len(s))), (k, sorted(s))


# ----------------------------------------------------------------------------------------- helpers
MODEL_ROUTES = ["chat/completions", "completions", "messages", "messages/count_tokens", "responses"]
VALID = {
    "chat/completions": {"model": "m", "messages": [{"role": "user", "content": "3+4?"}], "max_tokens": 5},
    "completions": {"model": "m", "prompt": "3+4=", "max_tokens": 5},
    "messages": {"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": "3+4?"}]},
    "messages/count_tokens": {"model": "claude", "messages": [{"role": "user", "content": "3+4?"}]},
    "responses": {"model": "m", "input": "3+4?"},
    "reward": {"value": 0.5, "message": "ok"},
    "events": {"type": "tool", "data": {"n": 1}},
}
FIELDS = ["model", "messages", "max_tokens", "stream", "stream_options", "n", "tools", "tool_choice", "logprobs",
          "top_logprobs", "temperature", "prompt", "input", "system", "instructions", "value", "message", "type",
          "data", "content", "x-unknown", "response_format", "stop", "seed"]

leaf = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(leaf, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch,
                                                                                          max_size=3),
                           max_leaves=8)


@st.composite
def bodies(draw, route: str) -> tuple[bytes, dict]:
    """(raw body, extra httpx kwargs): a mutated valid body, or bytes that are not one."""
    valid = VALID[route]
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes", "bad_utf8", "truncated",
                                 "oversized", "oversized_chunked", "deep"]))
    if kind == "mutate":
        body = dict(valid)
        for field in draw(st.lists(st.sampled_from(FIELDS + list(valid)), min_size=1, max_size=3)):
            if draw(st.booleans()) and field in body:
                del body[field]
            else:
                body[field] = draw(json_values)
        return dumps(body), {}
    if kind == "json":
        return dumps(draw(json_values)), {}
    if kind == "bytes":
        return draw(st.binary(max_size=64)), {}
    if kind == "bad_utf8":
        raw = dumps(valid)
        i = draw(st.integers(0, len(raw)))
        return raw[:i] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])) \
            + raw[i:], {}
    if kind == "truncated":
        raw = dumps(valid)
        return raw[:draw(st.integers(0, len(raw) - 1))], {}
    if kind == "deep":
        n = draw(st.integers(100, 3000))
        return b'{"model": "m", "messages": ' + b"[" * n + b"]" * n + b"}", {}
    raw = dumps({**valid, "pad": "x" * MAX_BODY})
    if kind == "oversized":
        return raw, {}
    return b"", {"content": iter([raw[i:i + 4096] for i in range(0, len(raw), 4096)])}  # chunked, no length


def target(e: Env, route: str, form: str, attempt: str | None = "0") -> tuple[str, dict]:
    if route in ("reward", "events"):
        return f"{e.gw.url}/rollouts/r1/attempts/0/{route}", {}
    if form == "path":
        return f"{e.gw.url}/rollouts/r1/attempts/0/v1/{route}", {}
    headers = {"X-AGL-Rollout-Id": "r1"}
    if attempt is not None:
        headers["X-AGL-Attempt-Id"] = attempt
    return f"{e.gw.url}/v1/{route}", headers


def check_response(url: str, resp: httpx.Response) -> None:
    assert resp.status_code < 500 or resp.status_code in (502, 503, 504), (resp.status_code, resp.text[:500])
    if resp.status_code < 400:
        return
    body = resp.json()  # every error is JSON
    if url.endswith(("/messages", "/messages/count_tokens")):
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
        assert isinstance(body["error"]["message"], str), body
    else:
        err = body["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), body
        assert err["code"] is None or isinstance(err["code"], str), body


def settle(e: Env, before_calls: int, before_records: int) -> None:
    """The gate is back to idle and each upstream model call left exactly one record."""
    deadline = time.monotonic() + 5
    while (e.gate.in_flight or e.gate.held) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.gate.in_flight == 0 and e.gate.held == 0, "a gate slot leaked"
    assert e.n_records() - before_records == len(e.up.calls) - before_calls


def post(e: Env, url: str, raw: bytes, headers: dict, kw: dict) -> httpx.Response:
    headers = {"content-type": "application/json", **headers}
    if "content" in kw:
        return e.client.post(url, headers=headers, **kw)
    return e.client.post(url, content=raw, headers=headers)


# ----------------------------------------------------------------------------------------- the tests
@H
@given(data=st.data(), route=st.sampled_from(MODEL_ROUTES + ["reward", "events"]),
       form=st.sampled_from(["path", "header"]), attempt=st.sampled_from(["0", None]))
def test_malformed_bodies_on_every_route(env, data, route, form, attempt):
    raw, kw = data.draw(bodies(route))
    url, headers = target(env, route, form, attempt)
    calls, records = len(env.up.calls), env.n_records()
    resp = post(env, url, raw, headers, kw)
    check_response(url, resp)
    if resp.status_code == 200 and "text/event-stream" in resp.headers.get("content-type", ""):
        assert resp.text.endswith("data: [DONE]\n\n") or "message_stop" in resp.text \
            or "response.completed" in resp.text or '"error"' in resp.text
    if "oversized" in str(kw) or len(raw) > MAX_BODY:
        assert resp.status_code == 413
    settle(env, calls, records)


def good_body_for(route: str) -> dict:
    return good_completion() if route == "completions" else good_chat()


PATHS = [("prompt_token_ids",), ("choices",), ("choices", 0), ("choices", 0, "token_ids"),
         ("choices", 0, "token_ids", 1), ("choices", 0, "logprobs"), ("choices", 0, "logprobs", "content"),
         ("choices", 0, "logprobs", "content", 0), ("choices", 0, "logprobs", "content", 0, "logprob"),
         ("choices", 0, "finish_reason"), ("choices", 0, "message"), ("choices", 0, "message", "content"),
         ("choices", 0, "message", "tool_calls"), ("choices", 0, "text"), ("choices", 0, "prompt_token_ids"),
         ("choices", 0, "logprobs", "token_logprobs"), ("usage",), ("model",), ("id",), ("error",)]


def corrupt(obj, path, value):
    """A copy of ``obj`` with the value at ``path`` replaced (or the path dropped when value is ...)."""
    obj = orjson.loads(dumps(obj))
    cur = obj
    for p in path[:-1]:
        try:
            cur = cur[p]
        except (KeyError, IndexError, TypeError):
            return obj
    try:
        if value is ...:
            del cur[path[-1]]
        else:
            cur[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        pass
    return obj


weird = json_values | st.sampled_from(["nan", "inf", "-inf", "abort", "1.5", [1.5, 2], [-1], ["a"], [True],
                                       [2**80], {"content": "x"}, [None], ...])


@st.composite
def upstream_plans(draw, route: str, stream: bool):
    kind = draw(st.sampled_from(["corrupt", "corrupt", "corrupt", "missing_ids", "json", "bytes", "status"]
                                + (["stream"] * 4 if stream else [])))
    if kind == "corrupt":
        body = good_body_for(route)
        for _ in range(draw(st.integers(1, 2))):
            body = corrupt(body, draw(st.sampled_from(PATHS)), draw(weird))
        return ("body", 200, dumps(body))
    if kind == "missing_ids":
        body = corrupt(corrupt(good_body_for(route), ("prompt_token_ids",), ...), ("choices", 0, "token_ids"), ...)
        return ("body", 200, dumps(body))
    if kind == "json":
        return ("body", draw(st.sampled_from([200, 400, 404, 422, 500, 503])), dumps(draw(json_values)))
    if kind == "bytes":
        return ("body", draw(st.sampled_from([200, 500])), draw(st.binary(max_size=40)))
    if kind == "status":
        return ("body", draw(st.sampled_from([401, 403, 404, 418, 429, 500, 502])),
                dumps({"error": {"message": draw(json_values)}}))
    chunks = good_stream_chunks()
    cut_at = draw(st.integers(0, len(chunks)))
    chunks = chunks[:cut_at] + draw(st.lists(
        st.sampled_from([b"data: {not json\n\n", b"data: [1, 2]\n\n", b"data: null\n\n", b": comment\n\n",
                         b"event: x\n\n", b"data: \xff\xfe\n\n"])
        | st.builds(lambda p, v: b"data: " + dumps(corrupt(orjson.loads(chunks[min(1, len(chunks) - 1)][6:]),
                                                                  p, v)) + b"\n\n",
                    st.sampled_from([("choices",), ("choices", 0), ("choices", 0, "token_ids"),
                                     ("choices", 0, "delta"), ("choices", 0, "logprobs"),
                                     ("choices", 0, "logprobs", "content"), ("prompt_token_ids",), ("usage",),
                                     ("choices", 0, "delta", "tool_calls"), ("choices", 0, "finish_reason")]),
                    weird), max_size=2))
    return ("stream", chunks, draw(st.sampled_from(["done", "eof", "cut"])))


@H
@given(data=st.data(), route=st.sampled_from(["chat/completions", "chat/completions", "completions", "messages",
                                              "messages/count_tokens", "responses"]),
       stream=st.booleans())
def test_upstream_garbage_never_a_500_or_a_bad_record(env, data, route, stream):
    stream = stream and route != "completions"
    plan = data.draw(upstream_plans(route if route != "messages/count_tokens" else "chat/completions",
                                    stream and route == "chat/completions"))
    url, headers = target(env, route, "path")
    body = {**VALID[route], **({"stream": True} if stream else {})}
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = plan
    try:
        resp = post(env, url, dumps(body), headers, {})
    finally:
        env.up.plan = None
    check_response(url, resp)
    if resp.status_code == 200 and stream:  # a stream either ends normally or carries an error event
        assert resp.text.rstrip().endswith(("data: [DONE]", '"message_stop"}', "}")), resp.text[-300:]
    settle(env, calls, records)


@pytest.mark.parametrize("end", ["eof", "cut"])
def test_stream_cut_short_is_an_error_not_a_complete_answer(env, end):
    """An upstream that closes mid-stream: the agent gets an error event, never ``[DONE]``; the record says error."""
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = ("stream", good_stream_chunks()[:3], end)
    try:
        resp = env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                               json={**VALID["chat/completions"], "stream": True})
    finally:
        env.up.plan = None
    assert resp.status_code == 200 and "data: [DONE]" not in resp.text and '"error"' in resp.text
    settle(env, calls, records)
    last = env.r.xrevrange(env.prefix + "calls:{r1}", count=1)[0][1][b"d"]
    assert CallRecord.model_validate_json(last).status == "error"


def last_record(env) -> CallRecord:
    return CallRecord.model_validate_json(env.r.xrevrange(env.prefix + "calls:{r1}", count=1)[0][1][b"d"])


def two_choices() -> dict:
    body, other = good_chat(), good_chat()["choices"][0]
    body["choices"].append({**other, "index": 1, "token_ids": [4, 5]})
    body["usage"]["completion_tokens"] = len(IDS) + 2  # usage counts every choice's tokens
    return body


#: answers that must never be recorded as good: (name, route, engine's answer, what the record's error says)
NEVER_GOOD = [
    ("no-prompt-ids", "chat/completions", lambda: corrupt(good_chat(), ("prompt_token_ids",), ...),
     "prompt token ids missing"),
    ("no-ids-no-usage", "chat/completions",
     lambda: corrupt(corrupt(good_chat(), ("choices", 0, "token_ids"), ...), ("usage",), ...),
     "usage.prompt_tokens missing"),
    ("no-ids-at-all", "chat/completions",
     lambda: corrupt(corrupt(good_chat(), ("prompt_token_ids",), ...), ("choices", 0, "token_ids"), ...),
     "prompt token ids missing"),
    ("chat-logprob-missing", "chat/completions",
     lambda: corrupt(good_chat(), ("choices", 0, "logprobs", "content", 1, "logprob"), ...), "logprobs missing"),
    ("chat-logprob-null", "chat/completions",
     lambda: corrupt(good_chat(), ("choices", 0, "logprobs", "content", 0, "logprob"), None), "logprobs missing"),
    ("completion-logprob-null", "completions",
     lambda: corrupt(good_completion(), ("choices", 0, "logprobs", "token_logprobs", 1), None), "logprobs missing"),
    # (round 2) values that are numbers but cannot be what they claim: one made every later update NaN
    ("chat-logprob-positive", "chat/completions",
     lambda: corrupt(good_chat(), ("choices", 0, "logprobs", "content", 0, "logprob"), 5.0), "not a log-probability"),
    ("chat-logprob-engine-floor", "chat/completions",
     lambda: corrupt(good_chat(), ("choices", 0, "logprobs", "content", 2, "logprob"), -9999.0),
     "not a log-probability"),
    ("completion-logprob-huge", "completions",
     lambda: corrupt(good_completion(), ("choices", 0, "logprobs", "token_logprobs", 0), 1e308),
     "not a log-probability"),
    ("negative-token-id", "chat/completions", lambda: corrupt(good_chat(), ("choices", 0, "token_ids", 0), -5),
     "token id -5 out of range"),
    ("huge-prompt-id", "chat/completions", lambda: corrupt(good_chat(), ("prompt_token_ids", 1), 2**63 + 5),
     "out of range"),
    ("usage-not-an-integer", "chat/completions", lambda: corrupt(good_chat(), ("usage", "completion_tokens"), "2"),
     "usage.completion_tokens is not a count"),
    # (round 9) a prompt count of another type switched the prompt-ids check off: 3 ids against "99" were `ok`
    *[(f"prompt-count-{kind}", "chat/completions",
       (lambda v: lambda: corrupt(good_chat(), ("usage", "prompt_tokens"), v))(value),
       "usage.prompt_tokens is not a count")
      for kind, value in (("string", "99"), ("float", 99.0), ("bool", True), ("list", [1]), ("negative", -1))],
]


@pytest.mark.parametrize("name, route, answer, says", NEVER_GOOD, ids=[c[0] for c in NEVER_GOOD])
def test_invented_or_missing_data_is_never_recorded_as_good(env, name, route, answer, says):
    """A missing logprob used to be recorded as 0.0 (an invented behaviour logprob in the PPO ratio), and
    an answer without prompt token ids, or without token ids and usage, as ``ok`` with empty ids. The agent
    still gets the engine's answer; the record says why it is not training data."""
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = ("body", 200, dumps(answer()))
    try:
        resp = env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/{route}", json=VALID[route])
    finally:
        env.up.plan = None
    assert resp.status_code == 200
    settle(env, calls, records)
    rec = last_record(env)
    assert rec.status == "error" and says in rec.error, (rec.status, rec.error)
    assert rec.response_logprobs is None or 0.0 not in rec.response_logprobs


def test_n_above_one_is_recorded_ok_with_choice_0(env):
    """usage.completion_tokens sums every choice: every ``n > 1`` call used to be an error ("4 of 6")."""
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = ("body", 200, dumps(two_choices()))
    try:
        resp = env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                               json={**VALID["chat/completions"], "n": 2})
    finally:
        env.up.plan = None
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
    settle(env, calls, records)
    rec = last_record(env)
    assert rec.status == "ok" and rec.error is None and rec.response_token_ids == IDS
    body = two_choices()
    body["usage"]["completion_tokens"] = len(IDS) + 3  # one token id of choice 1 lost: still caught
    env.up.plan = ("body", 200, dumps(body))
    try:
        env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                        json={**VALID["chat/completions"], "n": 2})
    finally:
        env.up.plan = None
    assert last_record(env).error == f"token ids incomplete: {len(IDS) + 2} of {len(IDS) + 3}"


def test_a_stream_that_fails_mid_generation_is_recorded_as_an_error(env):
    """vLLM ends a generation that fails with an ``error`` event and then ``[DONE]``: that call used to be
    recorded ``ok`` with the truncated ids and ``finish_reason: null``. The agent gets the error event."""
    chunks = good_stream_chunks()[:3]  # the role chunk and two token chunks, no finish reason
    error = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = ("stream", chunks + [error], "done")
    try:
        resp = env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                               json={**VALID["chat/completions"], "stream": True})
    finally:
        env.up.plan = None
    assert resp.status_code == 200 and "engine died" in resp.text
    settle(env, calls, records)
    rec = last_record(env)
    assert rec.status == "error" and "engine error during generation: engine died" in rec.error, rec.error
    env.up.plan = ("stream", chunks, "done")  # no error event, but no finish reason either
    try:
        env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                        json={**VALID["chat/completions"], "stream": True})
    finally:
        env.up.plan = None
    assert last_record(env).status == "error" and "no finish reason" in last_record(env).error


def test_a_stream_with_a_long_prompt_is_recorded(env):
    """vLLM sends every prompt token id in a stream's first event: past aiohttp's default line limit (a ~20k-token
    prompt) the agent got a 500 and nothing was recorded."""
    prompt = list(range(1, 150_001))  # ~1 MB first line
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = ("stream", chat_chunks("up", prompt, IDS), "done")
    try:
        resp = env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                               json={**VALID["chat/completions"], "stream": True})
    finally:
        env.up.plan = None
    assert resp.status_code == 200 and "[DONE]" in resp.text
    settle(env, calls, records)
    rec = last_record(env)
    assert rec.status == "ok" and rec.prompt_token_ids == prompt and rec.response_token_ids == IDS


def test_bad_headers_and_paths(env):
    c, gw = env.client, env.gw.url
    chat = VALID["chat/completions"]
    calls, records = len(env.up.calls), env.n_records()
    cases = [
        # attempt ids that are digits to str.isdigit() but not decimal strings
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r1", "X-AGL-Attempt-Id": b"\xb2"}, 400),
        (f"{gw}/rollouts/r1/attempts/%D9%A3/v1/chat/completions", {}, 400),
        (f"{gw}/rollouts/r1/attempts/%C2%B2/reward", {}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r1", "X-AGL-Attempt-Id": "-1"}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "", "X-AGL-Attempt-Id": "0"}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r2"}, 200),  # attempt defaults to current (1)
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r2", "X-AGL-Attempt-Id": "0"}, 409),
        (f"{gw}/rollouts/%FF%FE/attempts/0/v1/chat/completions", {}, 400),  # not UTF-8, as a header would be
        (f"{gw}/rollouts/r1/attempts/0/v1/chat/completions", {"X-AGL-Rollout-Id": "r2"}, 400),  # which? (round 11)
        (f"{gw}/rollouts/r1/attempts/0/v1/chat/completions", {"X-AGL-Rollout-Id": "r1"}, 200),  # they agree
        # ids that cannot name a rollout: too long, whitespace, control characters, hash-tag braces
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r" * 8000}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "a b"}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r1}"}, 400),
        (f"{gw}/rollouts/%20/attempts/0/v1/chat/completions", {}, 400),
        (f"{gw}/rollouts/r%0A1/attempts/0/v1/chat/completions", {}, 400),
        (f"{gw}/rollouts/r%7B1%7D/attempts/0/v1/chat/completions", {}, 400),
        # ids that would misroute: the same refusal in both forms of the route
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "x%41"}, 400),
        (f"{gw}/rollouts/x%2541/attempts/0/v1/chat/completions", {}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "a?b"}, 400),
        (f"{gw}/rollouts/a%3Fb/attempts/0/v1/chat/completions", {}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "a#b"}, 400),
        (f"{gw}/rollouts/a%23b/attempts/0/v1/chat/completions", {}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "../r1"}, 400),
        (f"{gw}/rollouts/..%5Cr1/attempts/0/v1/chat/completions", {}, 400),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r" * 256}, 404),  # the longest id: a valid name
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r1", "X-Junk": "j" * 8000}, 200),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r1", "Content-Type": "text/plain"}, 200),
        (f"{gw}/v1/chat/completions", {"X-AGL-Rollout-Id": "r1", "Origin": "http://evil.example"}, 403),  # round 7
    ]
    for url, headers, status in cases:
        resp = c.post(url, json=chat, headers=headers)
        assert resp.status_code == status, (url, headers.keys(), resp.status_code, resp.text[:300])
        check_response(url, resp)
    for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/rollouts/r1/attempts/0/reward"),
                         ("DELETE", "/v1/messages")):
        resp = c.request(method, gw + path)
        assert resp.status_code in (404, 405) and resp.json()["error"]["message"] if "messages" not in path \
            else resp.json()["type"] == "error"
    settle(env, calls, records)
    assert c.get(gw + "/healthz").status_code == 200


@pytest.mark.parametrize("route", [r for r in MODEL_ROUTES if r != "messages/count_tokens"])  # (no stream)
def test_stream_and_logprobs_flags_must_be_booleans(env, route):
    """``"stream": "false"`` used to be read by truthiness (an SSE stream for an agent that asked for none);
    a flag that is not a JSON boolean is a 400, and nothing reaches the engine or is recorded."""
    url, _ = target(env, route, "path")
    calls, records = len(env.up.calls), env.n_records()
    flags = [("stream", "false"), ("stream", 0), ("stream", "no")]
    flags += [("logprobs", "no"), ("logprobs", 1)] if route == "chat/completions" else []
    for name, value in flags:
        resp = env.client.post(url, json={**VALID[route], name: value})
        assert resp.status_code == 400, (route, name, value, resp.status_code, resp.text[:300])
        check_response(url, resp)
        assert name in resp.text
    settle(env, calls, records)
    assert len(env.up.calls) == calls
    assert env.client.post(url, json={**VALID[route], "stream": None}).status_code == 200  # null: the default


@pytest.mark.parametrize("route, body", [
    ("messages", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}),
    ("messages", {"messages": [{"role": "user", "content": 5}]}),
    ("messages", {"messages": [{"role": "user"}]}),
    ("messages", {"messages": [1, 2]}),
    ("messages/count_tokens", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("responses", {"input": 5}),
    ("responses", {"input": None}),
    ("responses", {"input": []}),
    ("responses", {"input": [5]}),
    ("responses", {"input": [{"role": "robot", "content": "x"}]}),
    ("responses", {"input": [{"type": "bogus"}]}),
    ("chat/completions", {"messages": []}),
    ("chat/completions", {"messages": [1, 2]}),
    ("chat/completions", {"messages": [{"content": "no role"}]}),
])
def test_a_conversation_is_never_lost_in_translation(env, route, body):
    """LiteLLM's adapters drop a turn they cannot read without a word: these bodies used to reach the engine
    as an empty (or shortened) conversation and get a 200 answer to a question nobody asked (or the engine's
    5xx). Each is a 400 naming the problem, and nothing reaches the engine or is recorded."""
    url, _ = target(env, route, "path")
    calls, records = len(env.up.calls), env.n_records()
    resp = env.client.post(url, json={**VALID[route], **body})
    assert resp.status_code == 400, (route, body, resp.status_code, resp.text[:300])
    check_response(url, resp)
    settle(env, calls, records)
    assert len(env.up.calls) == calls


def test_still_alive_after_everything(env):
    assert env.client.get(env.gw.url + "/healthz").json() == {"status": "ok"}
    assert env.client.get(env.gw.url + "/metrics").status_code == 200
    check_all_records(env)


def test_reward_must_be_a_finite_number(env):
    """A reward is a JSON number (CONTRACT §1: ``<float>``) within ±REWARD_LIMIT: strings ("inf" would be stored
    as null, "1_000" read as 1000), booleans and rewards that would overflow the advantage are refused with 400."""
    url = f"{env.gw.url}/rollouts/r1/attempts/0/reward"
    # (an earlier test of this module's shared env may have posted a valid reward to r1: compare with that)
    before = Rollout.model_validate_json(env.r.get(env.prefix + "rollout:{r1}")).reward
    for value in ("inf", "-Infinity", "nan", "1e999", "0.25", True, "1_000", 1e10, -3e38, 1e308):
        resp = env.client.post(url, json={"value": value})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", (value, resp.text)
    resp = env.client.post(url, json={"value": 0.25, "message": "x" * 5000})
    assert resp.status_code == 400 and "message" in resp.text
    assert Rollout.model_validate_json(env.r.get(env.prefix + "rollout:{r1}")).reward == before  # nothing stored
    assert env.client.post(url, json={"value": 1}).status_code == 200
    assert env.client.post(url, json={"value": 0.25}).status_code == 200
    stored = Rollout.model_validate_json(env.r.get(env.prefix + "rollout:{r1}"))
    assert stored.reward == 0.25


def streamed_record(env, chunks: list[bytes]) -> CallRecord:
    """The record of one streamed chat call whose engine sends ``chunks`` then ``[DONE]``."""
    calls, records = len(env.up.calls), env.n_records()
    env.up.plan = ("stream", chunks, "done")
    try:
        env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                        json={**VALID["chat/completions"], "stream": True})
    finally:
        env.up.plan = None
    settle(env, calls, records)
    return last_record(env)


def test_a_stream_whose_tool_call_indexes_are_not_integers_is_recorded_as_an_error(env):
    """Round 5: tool-call deltas with indexes 0 and "x" (or 0 and null) made ``sorted`` fail after the stream: the
    agent got an internal_error event and *no record* was written. Now a malformed answer, recorded."""
    role, *_ = good_stream_chunks()
    for second in ('"x"', "null", "-1", "true"):
        deltas = [b'data: {"id":"c","object":"chat.completion.chunk","model":"up","choices":[{"index":0,"delta":'
                  b'{"tool_calls":[{"index":' + i.encode() + b',"id":"t","function":{"name":"f","arguments":"{}"}}]},'
                  b'"finish_reason":null,"token_ids":[5]}]}\n\n' for i in ("0", second)]
        rec = streamed_record(env, [role, *deltas])
        assert rec.status == "error" and "index" in (rec.error or ""), (second, rec.error)


def test_an_error_beside_choices_and_an_empty_finish_reason_are_errors(env):
    """Round 5: a stream chunk carrying both ``error`` and ``choices`` was recorded ok; a complete answer with
    ``finish_reason: ""`` was ok where the same in a stream was an error."""
    role, first, *rest = good_stream_chunks()
    chunk = orjson.loads(first[len(b"data: "):])
    chunk["error"] = {"message": "engine died"}
    rec = streamed_record(env, [role, b"data: " + orjson.dumps(chunk) + b"\n\n", *rest])
    assert rec.status == "error" and "engine died" in rec.error
    body = good_chat()
    body["choices"][0]["finish_reason"] = ""
    env.up.plan = ("body", 200, orjson.dumps(body))
    try:
        resp = env.client.post(f"{env.gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=VALID["chat/completions"])
    finally:
        env.up.plan = None
    assert last_record(env).status == "error" and "no finish reason" in last_record(env).error, resp.text


def test_stream_logprobs_that_add_up_but_belong_to_other_chunks_are_errors(env):
    """Round 5: chunk logprob counts that differed from their chunk's ids (2 ids with 1 logprob, then 1 id with 2)
    but added up were recorded ok: each token's behaviour logprob would be another token's."""
    chunks = [orjson.loads(c[len(b"data: "):]) if c.startswith(b"data: {") else c for c in good_stream_chunks()]
    carrying = [c for c in chunks if isinstance(c, dict) and c["choices"] and c["choices"][0].get("token_ids")]
    assert len(carrying) >= 2
    a, b = carrying[0]["choices"][0], carrying[1]["choices"][0]
    moved = a["logprobs"]["content"].pop()  # a keeps its ids, loses one logprob; b gets it
    b["logprobs"]["content"].insert(0, moved)
    sent = [b"data: " + orjson.dumps(c) + b"\n\n" if isinstance(c, dict) else c for c in chunks]
    rec = streamed_record(env, sent)
    assert rec.status == "error" and "logprobs" in (rec.error or ""), rec.error
    assert streamed_record(env, good_stream_chunks()).status == "ok"
