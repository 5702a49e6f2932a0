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


async def test_odd_chat_fields_and_other_choices_are_an_upstream_error(store, redis_url, prefix, upstream):
    """Round 9 left open: on the chat route an answer with ``tool_calls: "oops"``, ``content: 7`` or a tool call
    without a name passed through and was recorded ``ok`` (the translated routes answered 502), and with ``n > 1``
    the choices after the recorded one were not looked at. Now each is a 502 and an error record."""
    import copy

    from fakes import chat_answer

    await make_rollout(store, "r1")
    good = chat_answer("up", [1, 2, 3], [5, 6, 2])
    cases = []
    for field, value in (("tool_calls", "oops"), ("content", 7), ("tool_calls", [{"id": "t", "function": {}}]),
                         ("tool_calls", [{"id": "t", "function": {"name": "f", "arguments": {"x": 1}}}])):
        body = copy.deepcopy(good)
        body["choices"][0]["message"][field] = value
        cases.append((body, {}))
    two = copy.deepcopy(good)
    other = copy.deepcopy(two["choices"][0])
    other.update(index=1, message="not a message")
    two["choices"].append(other)
    two["usage"]["completion_tokens"] *= 2
    cases.append((two, {"n": 2}))
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for body, extra in cases:
                upstream.app.state.plan = ("body", 200, orjson.dumps(body))
                r = await _one(c, gw, extra)
                assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", (body, r.text[:300])
                assert (await _last(store)).status == "error"
            upstream.app.state.plan = ("body", 200, orjson.dumps(good))
            assert (await _one(c, gw)).status_code == 200 and (await _last(store)).status == "ok"
    upstream.app.state.plan = None


async def test_an_engine_status_other_than_200_is_no_answer(store, redis_url, prefix, upstream):
    """Round 9 left open: an engine answering 201 or 206 with a body was read as its answer (recorded, passed on).
    vLLM answers 200; any other status is the engine's error (502 naming it)."""
    from fakes import chat_answer

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for status in (201, 206):
                upstream.app.state.plan = ("body", status, orjson.dumps(chat_answer("up", [1, 2, 3], [5, 6, 2])))
                r = await _one(c, gw)
                assert r.status_code == 502 and str(status) in r.json()["error"]["message"], (status, r.text[:300])
                assert (await _last(store)).status == "error"
    upstream.app.state.plan = None


async def test_a_later_attempt_is_not_called_stale_and_event_types_are_printable(store, redis_url, prefix,
                                                                                  upstream):
    """Round 9 left open: a reward (or call) for an attempt that has not started was answered "is stale"; an
    event ``type`` could be empty or hold escape sequences (``\\x1b[31m``, a newline) that a terminal or log reader
    would act on. The 409 keeps its code (``stale_attempt``) and says "has not started"; such types are 400."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/3/reward", json={"value": 1.0})
            assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt", r.text
            assert "has not started" in r.json()["error"]["message"], r.text
            for bad in ("", "a\x1b[31m", "a\nb", "\x00"):
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/events", json={"type": bad, "data": {}})
                assert r.status_code == 400, (bad, r.status_code, r.text[:200])
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/events", json={"type": "tool: grep é", "data": {}})
            assert r.status_code == 200, r.text


async def test_an_anthropic_prefill_continues_the_assistant_turn(store, redis_url, prefix, upstream):
    """Round 9 left open: a conversation ending in an assistant turn (Anthropic's prefill) was sent to the engine
    as a finished turn followed by a new one (vLLM's default ``add_generation_prompt``), so the model answered
    after the prefill instead of continuing it. Now the engine is asked to continue that turn (for the call and
    for ``count_tokens``); a conversation ending in a user turn is sent as before."""
    await make_rollout(store, "r1")
    prefill = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"},
                                                            {"role": "assistant", "content": "The answer is"}]}
    plain = {**prefill, "messages": prefill["messages"][:1]}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for body, continued in ((prefill, True), (plain, False)):
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages", json=body)
                assert r.status_code == 200, r.text[:300]
                sent = upstream.app.state.calls[-1]
                assert (sent.get("continue_final_message"), sent.get("add_generation_prompt")) == (
                    (True, False) if continued else (None, None)), sent
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages/count_tokens", json=prefill)
            assert r.status_code == 200, r.text[:300]


def test_train_config_refuses_booleans_for_numbers_and_a_subset_past_the_eval(tmp_path, monkeypatch):
    """Round 9 left open: ``steps: true`` trained 1 step (pydantic reads a boolean as 1), an ``eval_subset`` larger
    than ``eval_size`` was cut down silently, and a field error came in pydantic's form (a line for the field, one
    for the message, one with a URL). Now each is one line naming the field, exit 2, nothing run; a boolean field,
    a small ``eval_size`` with the default subset, and YAML's string ``1e-3`` still load."""
    from typer.testing import CliRunner

    from agl_trainer import cli

    ran = []
    monkeypatch.setattr(cli, "_run", lambda cfg, resume=None: ran.append(cfg))
    config = tmp_path / "c.yaml"
    for bad, field in (("steps: true", "steps"), ("groups_per_step: yes", "groups_per_step"),
                       ("eval_size: 64\neval_subset: 100", "eval_subset"), ("concurrency: 0", "concurrency")):
        config.write_text(bad + "\n")
        result = CliRunner().invoke(cli.app, ["train", str(config)], terminal_width=1000)
        assert result.exit_code == 2, (bad, result.output)
        assert field in result.output and "errors.pydantic.dev" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert ran == []
    for good in ("norm_by_std: false", "eval_size: 8", "lr: 1e-3", "eval_size: 0\neval_subset: 64"):
        config.write_text(good + "\n")
        result = CliRunner().invoke(cli.app, ["train", str(config)], terminal_width=1000)
        assert result.exit_code == 0, (good, result.output)
    assert len(ran) == 4


async def test_a_keyless_gateway_on_loopback_answers_only_loopback_host_names(store, redis_url, prefix, upstream):
    """Round 6 left open: a gateway without a key answered any ``Host``, so a web page could read its ``GET``
    answers (``/v1/models``, ``/openapi.json``) through DNS rebinding. Bound to a loopback address and keyless, it
    now answers only ``127.0.0.1``/``localhost`` (as the dashboard does); with a key, the key guards it."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            port = gw.url.rsplit(":", 1)[1]
            assert (await c.get(f"{gw.url}/v1/models", headers={"Host": "evil.example"})).status_code == 400
            for name in ("127.0.0.1", "localhost"):
                r = await c.get(f"{gw.url}/v1/models", headers={"Host": f"{name}:{port}"})
                assert r.status_code == 200, (name, r.text)
            assert (await _one(c, gw)).status_code == 200
    with gateway(redis_url, prefix, upstream.url, key="k" * 32) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(f"{gw.url}/v1/models", headers={"Host": "evil.example"})
            assert r.status_code == 401, r.text


async def test_an_engine_that_cannot_swap_policies_is_refused_before_training():
    """Round 9 left open: an ``engine_url`` without vLLM's ``/collective_rpc`` (no ``VLLM_SERVER_DEV_MODE``) or
    without runtime LoRA loading failed the first weight swap with a traceback. ``check_engine`` finds it at start
    (a ``GET`` is 405 where the ``POST`` route exists, 404 where it does not) and names what serves it."""
    from fastapi import FastAPI
    from fakes import Served

    from agl_trainer.cycle import EngineError, check_engine

    full = FastAPI()
    for route in ("/collective_rpc", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        full.post(route)(lambda: {})
    bare = FastAPI()
    bare.post("/v1/load_lora_adapter")(lambda: {})
    bare.post("/v1/unload_lora_adapter")(lambda: {})
    with Served(full) as ok, Served(bare) as no_dev:
        for serving in ("merged", "adapter"):
            await check_engine(ok.url, serving)
        await check_engine(no_dev.url, "adapter")
        try:
            await check_engine(f"{ok.url},{no_dev.url}", "merged")  # every engine of a list is checked
        except EngineError as exc:
            assert "/collective_rpc" in str(exc) and "VLLM_SERVER_DEV_MODE=1" in str(exc), exc
        else:
            raise AssertionError("an engine without /collective_rpc passed")
    try:
        await check_engine(ok.url, "merged")  # stopped now
    except EngineError as exc:
        assert "cannot be reached" in str(exc), exc
    else:
        raise AssertionError("an engine that is gone passed")


def test_train_against_an_engine_without_swap_routes_is_one_line(upstream, redis_url, prefix, tmp_path):
    """The CLI's side: ``agl-trainer train`` with an ``engine_url`` that serves chat but no swap routes (the
    shared fake engine) exits 1 with one line naming the route, before any agent starts."""
    import subprocess
    import sys

    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"engine_url": upstream.url.removesuffix("/v1"), "model_name": "fake-model",
                                      "redis_url": redis_url,
                                      "prefix": prefix, "out_dir": str(tmp_path / "runs"), "eval_size": 0}))
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(config)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "/collective_rpc" in out.stderr, out.stderr[-2000:]
    assert len([ln for ln in out.stderr.splitlines() if ln.startswith("error:")]) == 1, out.stderr[-2000:]


def test_dry_run_reads_its_inputs_as_strictly_as_rollouts_create(tmp_path):
    """Round 9 left open: ``agl-controller run --mode k8s --dry-run --input '{"cpu": NaN}'`` rendered
    ``cpu: NaN`` (a manifest the API server refuses), where ``rollouts create`` refuses that input: the two
    parsed inputs two ways. Both read it with ``agl_common.schemas.parse_input`` now: one line, exit 2."""
    from typer.testing import CliRunner

    from agl_controller.cli import app
    from agl_trainer.cli import app as trainer

    tpl = tmp_path / "job.yaml.j2"
    tpl.write_text("spec:\n  template:\n    spec:\n      containers:\n      - name: h\n        image: busybox\n"
                   "        resources: {limits: {cpu: {{ input.cpu }}}}\n")
    for bad in ('{"cpu": NaN}', '{"cpu": Infinity}', '{"cpu": 1e999}', "[1]", "{"):
        res = CliRunner().invoke(app, ["run", "--mode", "k8s", "--dry-run", "--template", str(tpl), "--gateway",
                                       "http://gw", "--input", bad])
        assert res.exit_code == 2 and "NaN" not in res.stdout and "Traceback" not in res.output, (bad, res.output)
        assert len(res.output.strip().splitlines()) == 1, (bad, res.output)
        res = CliRunner().invoke(trainer, ["rollouts", "create", "--input", bad, "--redis", "redis://127.0.0.1:1/0"])
        assert res.exit_code == 2, (bad, res.output)
    res = CliRunner().invoke(app, ["run", "--mode", "k8s", "--dry-run", "--template", str(tpl), "--gateway",
                                   "http://gw", "--input", '{"cpu": 2}'])
    assert res.exit_code == 0 and "cpu: '2'" in res.output, res.output  # (a quantity, as the API server takes it)


# ------------------------------------------------------------------ the round-10 prober's findings on the above


async def test_an_empty_message_and_a_tool_call_finish_without_calls_are_no_answer(store, redis_url, prefix,
                                                                                   upstream):
    """A message ``{}`` with token ids became Anthropic ``content: []`` / Responses ``output: []``, recorded ``ok``;
    ``finish_reason: "tool_calls"`` with ``tool_calls: []`` became ``stop_reason: "tool_use"`` with no tool use."""
    from fakes import chat_answer

    await make_rollout(store, "r1")
    empty = chat_answer("up", [1, 2, 3], [5, 6, 2])
    empty["choices"][0]["message"] = {}
    no_calls = chat_answer("up", [1, 2, 3], [5, 6, 2])
    no_calls["choices"][0].update(finish_reason="tool_calls")
    no_calls["choices"][0]["message"].update(content=None, tool_calls=[])
    routes = {"chat/completions": {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]},
              "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"}]},
              "responses": {"model": "m", "input": "3+4?"}}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for body in (empty, no_calls):
                upstream.app.state.plan = ("body", 200, orjson.dumps(body))
                for route, request in routes.items():
                    r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", json=request)
                    assert r.status_code == 502, (route, body["choices"][0], r.status_code, r.text[:300])
                    assert (await _last(store)).status == "error"
    upstream.app.state.plan = None


async def test_a_stream_is_checked_as_a_complete_answer_and_an_empty_error_event_is_an_error(store, redis_url,
                                                                                             prefix, upstream):
    """A live stream with a tool call without a name was 200 and ``ok`` (the complete answer: 502); an engine
    ``{"error": ""}`` event reached the agent as sent, which an OpenAI SDK reads past (it raises only for a truthy
    ``error``), taking the cut answer for a whole one."""
    from fakes import chat_chunks

    await make_rollout(store, "r1")
    role, *tokens, usage = chat_chunks("up", [1, 2, 3], [7, 8])
    nameless = orjson.loads(tokens[-1][len(b"data: "):])
    nameless["choices"][0].update(delta={"tool_calls": [{"index": 0, "id": "t", "function": {"arguments": "{}"}}]},
                                  finish_reason="tool_calls")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            upstream.app.state.plan = ("stream", [role, tokens[0], b"data: " + orjson.dumps(nameless) + b"\n\n",
                                                  usage], "done")
            r = await _one(c, gw, {"stream": True})
            assert "upstream_error" in r.text and "[DONE]" not in r.text, r.text[-400:]
            assert (await _last(store)).status == "error"
            for empty in (b'""', b"{}"):
                upstream.app.state.plan = ("stream", [role, tokens[0], b'data: {"error": ' + empty + b"}\n\n"],
                                           "done")
                r = await _one(c, gw, {"stream": True})
                events = [orjson.loads(line[len("data: "):]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                assert any(e.get("error") and e["error"].get("message") for e in events), r.text[-400:]
                assert (await _last(store)).status == "error"
    upstream.app.state.plan = None


async def test_a_keyless_gateway_on_ipv6_loopback_answers_only_loopback_names(store, redis_url, prefix, upstream):
    """``--host ::1`` was not taken for loopback (only ``127.*`` and ``localhost`` were): it answered any Host."""
    from agl_common.settings import allowed_hosts

    assert allowed_hosts("::1") == ["127.0.0.1", "[::1]", "localhost"]
    assert allowed_hosts("0.0.0.0") == allowed_hosts("::") == allowed_hosts("gw.internal") == ["*"]
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url, host="::1") as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(f"{gw.url}/v1/models", headers={"Host": "evil.example"})).status_code == 400
            assert (await c.get(f"{gw.url}/v1/models", headers={"Host": "[::1]:8080"})).status_code == 200


def test_event_types_are_printable_and_role_numbers_are_not_booleans():
    """Event types took C1 controls (``\\x9b``), bidi overrides, zero-width and line-separator characters and a lone
    space; a role's ``lr: true`` was the largest learning rate (1.0), its ``lora_rank: true`` a rank of 1."""
    import pytest
    from agl_common.schemas import EventIn
    from pydantic import ValidationError

    from agl_trainer.config import TrainConfig

    for bad in ("\x9b31m", "\u202eab", "a\u2028b", "\u200b", " "):
        with pytest.raises(ValidationError):
            EventIn(type=bad)
    assert EventIn(type="tool: grep é").type == "tool: grep é"
    for field in ("lr", "lora_rank", "lora_alpha"):
        with pytest.raises(ValidationError, match=field):
            TrainConfig(policy_serving="adapter", roles={"solver": {"models": ["s"], field: True}})
