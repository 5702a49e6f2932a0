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


def _two_choices(finish_1: str | None) -> dict:
    """A chat answer of two choices (choice 1 a copy of choice 0 ending with ``finish_1``), usage counting both."""
    import copy

    from fakes import chat_answer

    body = chat_answer("up", [1, 2, 3], [5, 6, 2])
    second = copy.deepcopy(body["choices"][0])
    second.update(index=1, finish_reason=finish_1)
    second["message"]["content"] = "INJECTED"
    body["choices"].append(second)
    body["usage"]["completion_tokens"] *= 2
    return body


async def test_every_choice_must_be_asked_for_and_end_as_an_answer(store, redis_url, prefix, upstream):
    """The prober (round 11): a second choice nobody asked for reached the agent (the Anthropic and Responses
    routes merged it into the one message: text the recorded sample never produced), recorded ``ok``; with
    ``n: 2`` a choice 1 without a finish reason, or aborted by a weight update, was a 200 too. Now the number of
    choices must be the request's ``n`` and every choice must end as an answer (502, an error record); an aborted
    choice is retried as an aborted choice 0 is (503 after the retries); ``n: 2`` done right is still ``ok``."""
    await make_rollout(store, "r1")
    anthropic = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"}]}
    responses = {"model": "m", "input": "3+4?", "max_output_tokens": 16}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            upstream.app.state.plan = ("body", 200, orjson.dumps(_two_choices("stop")))
            for path, body in (("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                               ("messages", anthropic), ("responses", responses)):
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{path}", json=body)
                assert r.status_code == 502 and "INJECTED" not in r.text, (path, r.status_code, r.text[:300])
                rec = await _last(store)
                assert rec.status == "error" and "2 choices for a request of n=1" in rec.error, (path, rec.error)
            for finish, status, word in ((None, 502, "no finish reason (choice 1)"),
                                         ("banana", 502, "finish reason 'banana' (choice 1)"),
                                         ("abort", 503, "aborted")):
                upstream.app.state.plan = ("body", 200, orjson.dumps(_two_choices(finish)))
                r = await _one(c, gw, {"n": 2})
                assert r.status_code == status, (finish, r.status_code, r.text[:300])
                rec = await _last(store)
                assert rec.status == "error" and word in rec.error, (finish, rec.error)
            upstream.app.state.plan = ("body", 200, orjson.dumps(_two_choices("length")))
            r = await _one(c, gw, {"n": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:300]
            assert (await _last(store)).status == "ok"
    upstream.app.state.plan = None


def test_gateway_settings_read_from_the_environment_are_checked(redis_url):
    """The prober: ``AGL_UPSTREAM_TIMEOUT_S=0`` (or -5, nan) gave aiohttp no timeout at all (a hung engine held
    its calls, and every drain, for ever); ``AGL_HEARTBEAT_S=0`` would busy-loop Redis writes; an empty
    ``AGL_REPLICA_ID`` was taken. Each is one line and exit 2 before anything starts."""
    import subprocess
    import sys

    for name, value in (("AGL_UPSTREAM_TIMEOUT_S", "0"), ("AGL_UPSTREAM_TIMEOUT_S", "-5"),
                        ("AGL_UPSTREAM_TIMEOUT_S", "nan"), ("AGL_HEARTBEAT_S", "0"), ("AGL_HEARTBEAT_S", "nan"),
                        ("AGL_REPLICA_ID", ""), ("AGL_REPLICA_ID", "a b"), ("AGL_REDIS_MAX_CONNECTIONS", "0")):
        out = subprocess.run([sys.executable, "-m", "agl_gateway", "serve", "--port", "0"], capture_output=True,
                             text=True, timeout=60, env={"AGL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin",
                                                         name: value})
        assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 3, \
            (name, value, out.returncode, out.stderr[-2000:])
        assert name.removeprefix("AGL_").lower() in out.stderr, (name, out.stderr)


async def test_a_live_replica_id_is_refused_and_a_dead_ones_is_taken(store, redis_url, prefix, upstream):
    """The prober: a second gateway started with the first one's ``AGL_REPLICA_ID`` overwrote its status: a
    pause counted one replica, said "drained" while the other forwarded a call (answered 12 s after). Now a
    gateway does not start under the id of a live replica; a replica that crashed (its last heartbeat ageing)
    leaves its id free within seconds."""
    import time

    import pytest
    from agl_common.schemas import ReplicaStatus

    with gateway(redis_url, prefix, upstream.url, replica_id="gw-1"):
        with pytest.raises(RuntimeError, match="did not start"):
            with gateway(redis_url, prefix, upstream.url, replica_id="gw-1"):
                pass
        assert [r.replica_id for r in await store.replicas()] == ["gw-1"]
        with gateway(redis_url, prefix, upstream.url, replica_id="gw-2"):
            assert sorted(r.replica_id for r in await store.replicas()) == ["gw-1", "gw-2"]
    assert await store.claim_replica("gw-3", "dead")  # a replica killed ~29 s after its last heartbeat
    await store.heartbeat(ReplicaStatus(replica_id="gw-3"), "dead")
    await store.r.pexpire(store.key("replica-owner", "gw-3"), 1000)
    t0 = time.monotonic()
    with gateway(redis_url, prefix, upstream.url, replica_id="gw-3"):
        assert time.monotonic() - t0 < 15


async def test_a_streamed_records_message_keeps_what_the_agent_got(store, redis_url, prefix, upstream):
    """The prober: a live stream's ``delta.reasoning`` (vLLM's reasoning parser; ``reasoning_content`` elsewhere)
    and ``delta.refusal`` reached the agent, but the record's message held only ``content`` (CONTRACT §3: the
    response as the agent received it); the same answer not streamed kept them. Now the record's message has
    every delta field, string pieces joined."""
    from fakes import chat_chunks

    await make_rollout(store, "r1")
    chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
    for k, (field, piece) in enumerate((("reasoning", "Add "), ("reasoning", "them."),
                                         ("reasoning_content", "ok"), ("refusal", None))):
        event = orjson.loads(chunks[1 + k].removeprefix(b"data: "))
        event["choices"][0]["delta"][field] = piece
        chunks[1 + k] = b"data: " + orjson.dumps(event) + b"\n\n"
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            upstream.app.state.plan = ("stream", chunks, "done")
            r = await _one(c, gw, {"stream": True})
            assert r.status_code == 200 and "Add " in r.text, r.text[-300:]
            rec = await _last(store)
            message = rec.response["choices"][0]["message"]
            assert rec.status == "ok" and message["reasoning"] == "Add them." and message["reasoning_content"] == "ok"
            assert "refusal" not in message and message["content"] and message["role"] == "assistant", message
    upstream.app.state.plan = None


def test_a_run_drains_longer_than_its_gateway_waits_on_the_engine(tmp_path):
    """The prober: a run's drain gave up after 120 s while its gateway waited up to 600 s on the engine: one
    generation over 120 s in flight at an update ended the whole run (exit 1, blaming "a gateway left from a
    killed run"). Now the gateway a run starts times engine calls out after ``rollout_timeout_s`` (the call's
    rollout is over by then) and the drain waits 60 s longer unless set."""
    from agl_trainer.config import TrainConfig
    from agl_trainer.stack import start_agents

    class Recorder:  # the Services calls start_agents makes
        def start_gateway(self, *args, **kw):
            self.gateway = kw
            return "http://127.0.0.1:1"

        def start_controller(self, *args, **kw):
            self.controller = args

    cfg = TrainConfig(rollout_timeout_s=300)
    svc = Recorder()
    start_agents(svc, cfg, "http://127.0.0.1:2/v1", "redis://127.0.0.1:6379/0", "m", tmp_path)
    assert svc.gateway["upstream_timeout_s"] == 300 and cfg.drain_s == 360 > svc.gateway["upstream_timeout_s"]
    assert TrainConfig().drain_s > TrainConfig().rollout_timeout_s
    assert TrainConfig(drain_timeout_s=30).drain_s == 30


def test_calls_that_did_not_sample_from_their_logprobs_are_not_trained():
    """The prober: ``temperature: 0``, ``top_p: 0.1``, a ``logit_bias``, ``allowed_token_ids``, a JSON
    ``response_format``... reached the engine and the calls were trained as any other; but vLLM records *raw*
    logprobs (before temperature, truncation, penalties, masks), and the trainer scores the policy the same way:
    PPO's behaviour logprobs were not those of the distribution the tokens came from. Such calls are now
    skipped by the row builder (one definition, :func:`sampling_not_plain`), counted; plain ones train."""
    from agl_common.schemas import CallRecord, sampling_not_plain
    from agl_trainer.algorithm.aggregate import AggregateStats, build_rows

    def call(seq: int, request: dict) -> CallRecord:
        return CallRecord(rollout_id="r", attempt_id="0", seq=seq, route="chat", request=request, response={},
                          prompt_token_ids=[1, 2], response_token_ids=[3, 4], response_logprobs=[-0.5, -0.25])

    odd = [{"temperature": 0}, {"temperature": 0.7}, {"top_p": 0.1}, {"top_k": 40}, {"logit_bias": {"7": 100}},
           {"allowed_token_ids": [7, 8]}, {"response_format": {"type": "json_object"}}, {"min_tokens": 3},
           {"tool_choice": "required"}, {"repetition_penalty": 1.2}, {"temperature": True},
           {"structured_outputs": {"choice": ["a", "b"]}},
           # the third prober: Anthropic structured outputs, which LiteLLM turns into a strict json_schema
           {"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
           {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}]
    plain = [{}, {"temperature": 1.0, "top_p": 1, "top_k": -1, "max_tokens": 64, "seed": 3, "stop": ["\n"]},
             {"tool_choice": "auto", "response_format": {"type": "text"}, "logit_bias": {}},
             {"output_config": {"effort": "low"}}]
    for request in odd:
        stats = AggregateStats()
        assert sampling_not_plain(request), request
        assert build_rows([call(0, request)], stats=stats) == [] and stats.skipped_calls["sampling_not_plain"] == 1
    for request in plain:
        assert sampling_not_plain(request) is None, request
        assert len(build_rows([call(0, request)])) == 1
    assert sampling_not_plain({"temperature": 0.7, "top_p": 0.9}) == "temperature=0.7, top_p=0.9"


async def test_ids_that_disagree_are_refused(store, redis_url, prefix, upstream):
    """The prober: a path-form call carrying ``X-AGL-Rollout-Id: other`` silently used the path (which rollout
    the caller meant cannot be told: now 400 ``conflicting_ids``, and headers that agree are fine); an answer
    whose top-level ``prompt_token_ids`` differ from choice 0's was recorded ``ok`` with the top-level ones (now a
    502 and an error record)."""
    from fakes import completion_answer

    await make_rollout(store, "r1")
    await make_rollout(store, "other")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for headers in ({"X-AGL-Rollout-Id": "other"}, {"X-AGL-Attempt-Id": "3"}):
                r = await c.post(url, json=body, headers=headers)
                assert r.status_code == 400 and "conflicting_ids" in r.text, (headers, r.status_code, r.text[:300])
            r = await c.post(url, json=body, headers={"X-AGL-Rollout-Id": "r1", "X-AGL-Attempt-Id": "0"})
            assert r.status_code == 200, r.text[:300]
            answer = completion_answer("up", [1, 2, 3], [5, 2])
            answer["prompt_token_ids"] = [9, 9, 9]
            upstream.app.state.plan = ("body", 200, orjson.dumps(answer))
            r = await _one(c, gw, {"prompt": "3+4?"}, route="completions")
            assert r.status_code == 502 and "prompt_token_ids" in r.text, (r.status_code, r.text[:300])
            assert (await _last(store)).status == "error"
    upstream.app.state.plan = None


async def test_a_tool_call_the_agent_cannot_answer_is_an_upstream_error(store, redis_url, prefix, upstream):
    """Round 10 left open: a tool call of ``type: "banana"``, one without an ``id`` (the agent answers a call by its
    id) or a function name with control characters was passed on, recorded ``ok``. Each is now a 502 and an error
    record, on chat as on the translated routes; a good tool call is still 200."""
    from fakes import chat_answer, tool_call

    await make_rollout(store, "r1")
    good = tool_call("add", {"a": 3, "b": 4})
    no_id = tool_call("add", {"a": 3, "b": 4})
    del no_id["tool_calls"][0]["id"]
    banana = tool_call("add", {"a": 3, "b": 4})
    banana["tool_calls"][0]["type"] = "banana"
    escape = tool_call("add\x1b[2J", {"a": 3})
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for message, word, status in ((no_id, "no id", 502), (banana, "banana", 502),
                                          (escape, "control characters", 502), (good, "", 200)):
                upstream.app.state.plan = ("body", 200, orjson.dumps(chat_answer("up", [1, 2, 3], [5, 6, 2], message)))
                for path, body in (("chat/completions", {"model": "m", "tools": tools,
                                                         "messages": [{"role": "user", "content": "3+4?"}]}),
                                   ("messages", {"model": "m", "max_tokens": 16, "messages": [
                                       {"role": "user", "content": "3+4?"}], "tools": [
                                       {"name": "add", "input_schema": {"type": "object"}}]})):
                    r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{path}", json=body)
                    assert r.status_code == status and word in r.text, (path, word, r.status_code, r.text[:300])
                    rec = await _last(store)
                    assert rec.status == ("ok" if status == 200 else "error"), (path, word, rec.error)
    upstream.app.state.plan = None


async def test_logprobs_an_agent_cannot_parse_are_an_upstream_error(store, redis_url, prefix, upstream):
    """The prober: a completions answer with ``logprobs.tokens: 5`` or ``top_logprobs: "x"``, or a chat choice 1
    with ``logprobs: "zz"``, reached an agent that asked for logprobs as sent, recorded ``ok``. Now 502, recorded
    ``error`` (``check_choice``); well-formed logprobs still pass."""
    from fakes import completion_answer

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for field, value in (("tokens", 5), ("top_logprobs", "x"), ("text_offset", {"a": 1})):
                answer = completion_answer("up", [1, 2, 3], [5, 2])
                answer["choices"][0]["logprobs"][field] = value
                upstream.app.state.plan = ("body", 200, orjson.dumps(answer))
                r = await _one(c, gw, {"prompt": "3+4?", "logprobs": 1}, route="completions")
                assert r.status_code == 502 and "logprobs" in r.text, (field, r.status_code, r.text[:300])
                assert (await _last(store)).status == "error"
            body = _two_choices("stop")
            body["choices"][1]["logprobs"] = "zz"
            upstream.app.state.plan = ("body", 200, orjson.dumps(body))
            r = await _one(c, gw, {"n": 2, "logprobs": True})
            assert r.status_code == 502 and "logprobs" in r.text, (r.status_code, r.text[:300])
            upstream.app.state.plan = ("body", 200, orjson.dumps(completion_answer("up", [1, 2, 3], [5, 2])))
            r = await _one(c, gw, {"prompt": "3+4?", "logprobs": 1}, route="completions")
            assert r.status_code == 200 and (await _last(store)).status == "ok", r.text[:300]
    upstream.app.state.plan = None


def test_the_engine_a_run_starts_samples_as_each_request_says(tmp_path, monkeypatch):
    """The second prober: vLLM's default ``--generation-config auto`` fills every sampling field a request leaves
    out from the model's ``generation_config.json`` (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20): a
    call without ``temperature`` passed ``sampling_not_plain`` and was trained, off-policy. The engine a run
    starts now ignores those defaults (``--generation-config vllm``)."""
    from agl_trainer.services import Services

    started = {}
    svc = Services(tmp_path)
    monkeypatch.setattr(svc, "start", lambda name, argv, env=None: started.setdefault(name, argv))
    monkeypatch.setattr(svc, "wait_http", lambda *a, **kw: None)
    svc.start_vllm(tmp_path, "m", port=1)
    argv = started["vllm"]
    assert argv[argv.index("--generation-config") + 1] == "vllm", argv


async def test_an_n_that_is_not_a_positive_integer_is_refused_before_the_engine(store, redis_url, prefix, upstream):
    """The second prober: ``"n": 2.0`` reached the engine (vLLM reads it as 2), which generated two choices, then
    the gateway called them a wrong count (502, the generation wasted). ``n`` is now a positive JSON integer or a
    400, before anything is forwarded; ``n: 1`` is fine."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for n in (2.0, "2", 0, -1, True, [2]):
                before = len(upstream.app.state.calls)
                r = await _one(c, gw, {"n": n})
                assert r.status_code == 400 and "'n' must be an integer from 1 to 16" in r.text, \
                    (n, r.status_code, r.text)
                assert len(upstream.app.state.calls) == before, n
            assert (await _one(c, gw, {"n": 1})).status_code == 200


def test_the_dashboard_reads_hostile_run_files_as_missing(redis_url, prefix, tmp_path):
    """The second prober: one number in a run folder took the dashboard down: a 400-digit integer in
    ``summary.json`` (500 on ``/``: every run gone from the index) or in ``metrics.jsonl``, ``1e400`` in
    ``summary.json`` (500 on the polled ``/api/runs/{run}``); a FIFO named ``metrics.jsonl`` (a harness with a
    shell runs in the project root) hung every page, ``/healthz`` too, for good; a hand-written ``config.json``
    showed its Redis password and keys. Now such numbers read as missing, only regular files of bounded size are
    read, and the config is shown redacted."""
    import os

    from agl_trainer.ui.server import create_app

    from fakes import Served

    root = tmp_path / "runs" / "demo"
    for name, files in {
        "r1": {"metrics.jsonl": '{"step": 1, "reward_mean": 1' + "0" * 400 + ', "roles": {"a": {"reward_mean": 1'
               + "0" * 400 + '}}}\n', "config.json": "{}"},
        "r2": {"summary.json": '{"heldout_after": 1' + "0" * 400 + "}", "config.json": "{}"},
        "r3": {"summary.json": '{"heldout_before": 1e400}', "config.json": "{}"},
        "r4": {"config.json": '{"redis_url": "redis://:hunter2@db:6379/0", "key": "adminkey123", '
               '"wandb": {"api_key": "sk-secret"}, "engine_url": "http://u:pw2@e:8000,http://f:8000"}'},
    }.items():
        (root / name).mkdir(parents=True)
        for file, text in files.items():
            (root / name / file).write_text(text)
    (root / "r5").mkdir()
    (root / "r5" / "config.json").write_text("{}")
    os.mkfifo(root / "r5" / "metrics.jsonl")
    with Served(create_app(redis_url, prefix, tmp_path / "runs")) as ui:
        with httpx.Client(timeout=20) as c:
            for path in ("/", "/api/runs", "/healthz", *(f"/runs/r{k}" for k in range(1, 6)),
                         *(f"/api/runs/r{k}" for k in range(1, 6))):
                r = c.get(ui.url + path)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
            page = c.get(ui.url + "/runs/r4").text
            for secret in ("hunter2", "adminkey123", "sk-secret", "pw2"):
                assert secret not in page, secret
            assert "db:6379" in page


def test_a_gateway_started_under_a_live_replica_id_says_so_in_one_line(redis_url, prefix):
    """The second prober: the refusal above was uvicorn's 55-line start-up traceback and exit 3; ``agl-gateway
    serve`` now says it in one line, exit 2, like every other refusal at start."""
    import subprocess
    import sys

    from test_gateway import gateway as serve

    with serve(redis_url, prefix, "http://127.0.0.1:9/v1", replica_id="gw-live"):
        out = subprocess.run([sys.executable, "-m", "agl_gateway", "serve", "--port", "0", "--prefix", prefix],
                             capture_output=True, text=True, timeout=60,
                             env={"AGL_REDIS_URL": redis_url, "AGL_REPLICA_ID": "gw-live", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 2, \
        (out.returncode, out.stderr[-2000:])
    assert "'gw-live' is live" in out.stderr


def test_a_run_does_not_start_on_a_prefix_another_runs_gateway_serves(redis_url, prefix, tmp_path):
    """The second prober: `agl-trainer train` took any Redis that answered and started its gateway and controller
    on a prefix a live experiment used (default ``agl:``): a second controller took the first run's queued
    rollouts and ran them with its own harness and key; pauses and policies would cross too. A run that starts its
    own gateway now refuses (one line, exit 2, before anything starts) while a live replica serves its prefix; a
    config naming that gateway (``gateway_url``) is fine, and so is the prefix once the replica is gone."""
    import subprocess
    import sys

    import pytest
    import yaml
    from agl_trainer.config import TrainConfig
    from agl_trainer.stack import PrefixInUse, check_prefix_free

    from test_gateway import gateway as serve

    cfg = TrainConfig(redis_url=redis_url, prefix=prefix)
    with serve(redis_url, prefix, "http://127.0.0.1:9/v1", replica_id="other-run") as gw:
        with pytest.raises(PrefixInUse, match="other-run"):
            check_prefix_free(cfg, wait_s=1.0)
        check_prefix_free(cfg.with_fields(gateway_url=gw.url))
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump({"redis_url": redis_url, "prefix": prefix, "out_dir": str(tmp_path / "runs")}))
        out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(path)], capture_output=True,
                             text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert out.returncode == 2 and "is in use" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    check_prefix_free(cfg)


def test_a_controller_without_the_key_of_a_keyed_gateway_refuses_to_start(redis_url, prefix, tmp_path):
    """The second prober: a controller started without ``--key`` in front of a gateway with one gave every harness
    a key the gateway refused (401): every rollout ``failed no_model_calls``, the agent's own failure, never
    retried, nothing said at start. Now one line, exit 2; ``--max-attempts 1000000000`` (endless retries) too."""
    import subprocess
    import sys

    from test_gateway import gateway as serve

    env = {"AGL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"}
    with serve(redis_url, prefix, "http://127.0.0.1:9/v1", key="adminkey123") as gw:
        for extra, says in (([], "has an admin key"), (["--max-attempts", "1000000000"], "max-attempts")):
            out = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--command", "true", "--gateway",
                                  gw.url, "--prefix", prefix, "--log-dir", str(tmp_path), *extra],
                                 capture_output=True, text=True, timeout=60, env=env)
            assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, \
                (extra, out.returncode, out.stderr[-2000:])


def test_a_job_template_runs_one_attempt_in_one_pod_once():
    """The third prober: a Job template with ``parallelism: 3, completions: 3`` (three harness pods sharing one
    attempt's scoped key, their calls interleaved, three rewards), a ``podFailurePolicy`` that ignores failures or
    ``completionMode: Indexed`` with ``backoffLimitPerIndex`` (a failed pod rerun inside the attempt) rendered and
    validated. Each is refused now (a template error naming the field); a Job runs one pod once."""
    import pytest
    from agl_common.schemas import Rollout
    from agl_controller.k8s import JobRenderer

    base = ("apiVersion: batch/v1\nkind: Job\nspec:\n  {extra}\n  template:\n    spec:\n      containers:\n"
            "        - name: h\n          image: busybox\n")
    for extra, field in (("parallelism: 3", "parallelism"), ("completions: 3", "completions"),
                         ("completionMode: Indexed", "completionMode"),
                         ("backoffLimitPerIndex: 3", "backoffLimitPerIndex"),
                         ("podFailurePolicy: {rules: [{action: Ignore, onExitCodes: {operator: NotIn, values: [0]}}]}",
                          "podFailurePolicy"),
                         ("successPolicy: {rules: [{succeededCount: 1}]}", "successPolicy")):
        with pytest.raises(ValueError, match=f"spec.{field}"):
            JobRenderer(base.format(extra=extra), "http://gw", "m").render(Rollout(rollout_id="r", input={}))
    manifest = JobRenderer(base.format(extra="parallelism: 1"), "http://gw", "m").render(Rollout(rollout_id="r"))
    assert (manifest["spec"]["parallelism"], manifest["spec"]["completions"], manifest["spec"]["backoffLimit"]) == (1, 1, 0)


async def test_a_drain_does_not_take_an_empty_registry_at_its_word(store, redis_url, prefix, upstream):
    """The third prober: right after Redis came back without the replica registry (a restart, a failover),
    ``pause`` said "drained: 0 replica(s)" in 0.6 s while a call was still in flight (a trainer would swap weights
    under it). An empty registry is now believed only after a replica would have heartbeaten into it: the pause
    waits for the replica to come back and drain."""
    import asyncio
    import time

    from agl_common.control import pause_and_drain, resume

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url, replica_id="gw-a", max_hold=60) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            slow = asyncio.create_task(c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "x_delay": 2.0}))
            while not upstream.app.state.calls:
                await asyncio.sleep(0.02)
            await store.drop_replica("gw-a")  # what Redis coming back empty looks like to the trainer
            t0 = time.monotonic()
            replicas = await pause_and_drain(store, timeout_s=30)
            assert [r.replica_id for r in replicas] == ["gw-a"] and slow.done(), time.monotonic() - t0
            assert (await slow).status_code == 200
            await resume(store, release_all=True)


def test_rows_of_an_unregistered_group_do_not_change_with_the_filter(redis_url, prefix):
    """The third prober: a group made with ``rollouts create --group g1`` (never registered by a trainer) was
    taken as "the rollouts the filter kept": its rows had advantages ±0.707 with ``--shape rows`` alone, 0.0 with
    ``--min-reward 0.5``, and ``--rollout X`` gave no row at all. The group is now every rollout carrying its id."""
    import asyncio
    import json

    import pytest
    from agl_common.schemas import Rollout, RolloutStatus
    from agl_common.store import Store
    from agl_trainer.cli import app
    from typer.testing import CliRunner

    from test_export import chat

    async def seed() -> None:
        store = Store(redis_url, prefix)
        q = {"role": "user", "content": "3+4?"}
        for k, reward in enumerate((1.0, 1.0, 0.0, 0.0)):
            rid = f"made-{k}"
            await store.create_rollout(Rollout(rollout_id=rid, input={"q": 1}, group_id="g1"), enqueue=False)
            await store.set_status(rid, RolloutStatus.running)
            await store.record_call(chat(rid, 0, [q], {"role": "assistant", "content": "7"}, [1, 2, 3], [7, 2]))

            def change(r, reward=reward):
                r.reward = reward
            await store.update_rollout(rid, change)
            await store.set_status(rid, RolloutStatus.succeeded)
        await store.close()

    asyncio.run(seed())

    def rows(*args: str) -> dict[str, float]:
        res = CliRunner().invoke(app, ["rollouts", "export", "--shape", "rows", "--redis", redis_url, "--prefix",
                                       prefix, *args])
        assert res.exit_code == 0, res.output
        return {r["rollout_id"]: r["advantage"] for r in map(json.loads, res.stdout.splitlines())}

    every = rows()
    assert every["made-0"] == pytest.approx(0.866, abs=1e-3) and every["made-3"] == pytest.approx(-0.866, abs=1e-3)
    assert rows("--min-reward", "0.5") == {k: every[k] for k in ("made-0", "made-1")}
    assert rows("--rollout", "made-2") == {"made-2": every["made-2"]}
