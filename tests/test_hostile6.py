"""Hostile input, round 6 (docs/operations.md "Hostile input"): what round 5 left open and a fresh probing round
found."""

from __future__ import annotations

import httpx
import orjson

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)

USER = [{"role": "user", "content": "3+4?"}]
CALL = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]

#: (route, body, a word the 400 must hold): each was translated without it (LiteLLM dropped the part it could
#: not read) and the engine answered another conversation than the one the agent sent
DROPPED = [
    ("messages", {"system": 5, "messages": USER}, "'system'"),
    ("messages", {"system": {"a": 1}, "messages": USER}, "'system'"),
    ("messages", {"system": [{"type": "image", "source": {}}], "messages": USER}, "'image'"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "weird"}, {"type": "text", "text": "q"}]}]},
     "'weird'"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text",
                                                                                           "data": "x"}}]}]},
     "'document'"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "'text'"),
    ("messages", {"messages": CALL + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                    "content": 5}]}]}, "content"),
    ("messages", {"messages": CALL + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                    "content": [{"type": "weird"}]}]}]}, "'weird'"),
    ("messages", {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                                  "input": "x"}]}]}, "'input'"),
    ("messages", {"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server"),
    ("messages", {"messages": "hi"}, "'messages'"),
    # round 7: image sources LiteLLM cannot read, a tool_choice flag it drops, an empty turn it removes
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file",
                                                                                        "file_id": "f1"}}]}]}, "source"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png"}}]}]}, "source"),
    ("messages", {"messages": USER, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                  "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "disable_parallel_tool_use"),
    ("messages", {"messages": [*USER, {"role": "assistant", "content": []}, *USER]}, "empty"),
    ("responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"input": "hi", "conversation": "conv_1"}, "conversation"),
    ("responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "server"),
    ("responses", {"input": "hi", "instructions": 5}, "'instructions'"),
    ("responses", {"input": [{"type": "weird"}]}, "'weird'"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, 5]}]}, "object"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "'input_file'"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c1", "output": 5}]}, "'output'"),
    # round 8 (left open by round 7): options the translation drops
    ("responses", {"input": "hi", "top_logprobs": 3}, "'top_logprobs'"),
    ("responses", {"input": "hi", "max_tool_calls": 1}, "'max_tool_calls'"),
    ("responses", {"input": "hi", "truncation": "auto"}, "'truncation'"),
    # round 9: a stored prompt, what Anthropic's servers run, and an n no Anthropic agent reads
    ("responses", {"input": "hi", "prompt": {"id": "pmpt_1"}}, "'prompt'"),
    ("messages", {"messages": USER, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
     "'mcp_servers'"),
    ("messages", {"messages": USER, "container": "cntr_1"}, "'container'"),
    ("messages", {"messages": USER, "n": 3}, "'n'"),
]


async def test_a_translated_call_the_gateway_cannot_carry_whole_is_a_400_and_never_reaches_the_engine(
        store, redis_url, prefix, upstream):
    """Anthropic ``system: 5``, unknown blocks, a ``tool_result`` with ``content: 5``, a Responses
    ``previous_response_id`` or a server tool were dropped by the translation without a word (the answer was to
    another conversation, and recorded ``ok``)."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            for route, body, word in DROPPED:
                body = {"model": "m", "max_tokens": 5, **body}
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", json=body)
                assert r.status_code == 400, (route, body, r.status_code, r.text)
                assert word in r.text, (route, body, r.text)
            assert upstream.app.state.calls == []
            # what is carried whole still goes through: text, images, tool results, earlier reasoning
            fine = [("messages", {"system": [{"type": "text", "text": "S"}], "messages": CALL + [
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                      "content": [{"type": "text", "text": "r"}]}]}]}),
                    ("messages", {"messages": [{"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "7"}]},
                        *USER]}),
                    ("responses", {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": [
                        {"type": "input_text", "text": "q"}]}], "instructions": "S",
                        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})]
            for route, body in fine:
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}",
                                 json={"model": "m", "max_tokens": 5, **body})
                assert r.status_code == 200, (route, r.text)
    assert len(upstream.app.state.calls) == len(fine)


async def test_stream_options_that_is_not_an_object_is_a_400_on_every_route(store, redis_url, prefix, upstream):
    """Round 5: a synthesized stream (chat with tools) with ``stream_options: 5`` failed after the engine's answer
    (502, the call spent); a live stream passed it on to the engine."""
    await make_rollout(store, "r1")
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            for extra in ({"tools": tool}, {}):
                for odd in (5, "x", [True]):
                    r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={
                        "model": "m", "messages": USER, "stream": True, "stream_options": odd, **extra})
                    assert r.status_code == 400 and "stream_options" in r.text, (extra, odd, r.status_code, r.text)
            assert upstream.app.state.calls == []
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={
                "model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": True},
                "tools": tool})
            assert r.status_code == 200 and '"usage"' in r.text


async def test_a_record_is_written_only_for_the_rollouts_running_attempt_and_within_its_bounds(store):
    """Round 6: the record script wrote whatever it was sent: a call held by a pause (or in flight) while its
    rollout succeeded, or its attempt was retried, was recorded ``ok``; and one scoped key could record calls
    without end (each up to 8 MiB of request body)."""
    import pytest
    from agl_common.schemas import CallRecord, Rollout, RolloutStatus
    from agl_common.store import RecordRefused

    def rec(rid, attempt="0", size=0):
        return CallRecord(rollout_id=rid, attempt_id=attempt, seq=-1, route="chat", request={"x": "y" * size},
                          response={}).model_dump_json().encode()

    async def refused(code, rid, attempt="0", size=0, **bounds):
        with pytest.raises(RecordRefused) as err:
            await store.record_call_json(rid, attempt, rec(rid, attempt, size), **bounds)
        assert err.value.code == code

    await refused("rollout_not_found", "nobody")
    await store.create_rollout(Rollout(rollout_id="r1"), enqueue=False)
    assert await store.record_call_json("r1", "0", rec("r1")) == 0  # queuing: accepted
    await refused("stale_attempt", "r1", "1")
    await store.set_status("r1", RolloutStatus.running)
    await store.set_status("r1", RolloutStatus.succeeded)
    await refused("rollout_finished", "r1")
    await store.create_rollout(Rollout(rollout_id="r2", status=RolloutStatus.running), enqueue=False)
    await store.retry_attempt("r2", "0")
    await refused("stale_attempt", "r2", "0")
    await store.create_rollout(Rollout(rollout_id="r3", status=RolloutStatus.running), enqueue=False)
    for k in range(3):
        assert await store.record_call_json("r3", "0", rec("r3"), max_calls=3) == k
    await refused("too_many_calls", "r3", max_calls=3)
    await store.create_rollout(Rollout(rollout_id="r4", status=RolloutStatus.running), enqueue=False)
    assert await store.record_call_json("r4", "0", rec("r4", size=600), max_bytes=1000) == 0
    await refused("too_many_bytes", "r4", size=600, max_bytes=1000)
    assert [c.seq for c in await store.read_calls("r3")] == [0, 1, 2] and len(await store.read_calls("r4")) == 1


async def test_a_call_whose_rollout_ends_while_it_is_in_flight_is_refused_not_recorded(store, redis_url, prefix,
                                                                                       upstream):
    """The gateway checked the rollout once, when the call came in: a call held by a pause or in flight while its
    rollout finished was answered 200 and recorded ``ok`` after the rollout's reward was computed."""
    import asyncio

    from agl_common.schemas import RolloutStatus

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            call = asyncio.create_task(c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                                              json={"model": "m", "messages": USER, "x_delay": 1.0}))
            while not upstream.app.state.calls:
                await asyncio.sleep(0.02)
            await store.set_status("r1", RolloutStatus.succeeded)
            r = await call
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_finished", r.text
    assert await store.read_calls("r1") == []


# ------------------------------------------------------------------------------------------ the controller
async def test_a_reward_function_that_changes_directory_moves_no_later_run(store, tmp_path, monkeypatch, redis_url,
                                                                          prefix):
    """A judge's ``os.chdir("/")`` made every later run fail ``exit_code:2`` (``can't open file '/harness.py'``)
    with a relative command and log dir: the agent's failure, for the controller's change. (Round 15: the judge
    runs in a process of its own, so it moves that process only.)"""
    import shutil
    import sys
    from pathlib import Path

    from agl_common.schemas import Rollout, RolloutStatus
    from agl_controller import LocalRunner
    from agl_gateway import GatewaySettings, create_app
    from fakes import Served, fake_upstream

    here = Path(__file__).parent
    shutil.copy(here / "harnesses" / "scripted.py", tmp_path / "harness.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(here / "harnesses"))
    with Served(fake_upstream()) as up, Served(create_app(GatewaySettings(
            upstream=up.url, redis_url=redis_url, prefix=prefix, model="m", key="k3y"))) as gw:
        runner = LocalRunner(store, gw.url, [sys.executable, "harness.py"], "m", key="k3y", log_dir="logs",
                             reward_fn="rewards:hostile")
        out = {}
        for rid in ("first", "second"):
            await store.create_rollout(Rollout(rollout_id=rid, input={"calls": 1, "kind": "chdir"}))
            await runner.run_one(await store.pop_queued())
            out[rid] = await store.get_rollout(rid)
            assert Path.cwd() == tmp_path  # the judge moved its own process, not the controller
    for rid in ("first", "second"):
        assert (out[rid].status, out[rid].reward) == (RolloutStatus.succeeded, 0.5), (rid, out[rid].failure)
    assert (tmp_path / "logs" / "second.0.log").exists()


async def test_a_controller_under_a_live_id_is_refused_and_a_dead_ones_lease_is_waited_for(store):
    """A second controller with the id of a live one adopted its claims at once: every running rollout ended
    ``controller_lost`` (or ran twice) while the first was healthy."""
    import asyncio
    import time

    import pytest
    from agl_controller.base import ControllerIdLive, Runner

    live = Runner(store, controller_id="ctl-x", lease_ttl_s=1.5)
    stop = asyncio.Event()
    renewing = asyncio.create_task(live.lease_loop(stop))
    while await store.lease_of("ctl-x") is None:
        await asyncio.sleep(0.02)
    try:
        with pytest.raises(ControllerIdLive, match="ctl-x"):
            await Runner(store, controller_id="ctl-x", lease_ttl_s=1.5).take_lease()
    finally:
        stop.set()
        await renewing
    # a crash leaves the lease to expire: the next run under the id waits for it, then adopts
    await store.renew_lease("ctl-y", 1.0)
    t0 = time.monotonic()
    await Runner(store, controller_id="ctl-y", lease_ttl_s=1.0).take_lease()
    assert 0.5 < time.monotonic() - t0 < 3


async def test_reward_and_event_routes_check_the_key_before_reading_a_body(store, redis_url, prefix, upstream):
    """Round 6: /reward and /events parsed and judged the body (400s about it, an 8 MiB body buffered and an event
    measured) for a caller without a key; the model routes answered 401 first since round 5."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url, key="adminkey") as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            base = f"{gw.url}/rollouts/r1/attempts/0"
            for route, body in (("reward", b"{}"), ("reward", b'{"value":"x"}'), ("events", b"{}"),
                                ("events", b"{not json"), ("events", orjson.dumps({"type": "t", "data": "x" * 70000}))):
                for headers in ({}, {"Authorization": "Bearer agl-wrong"}):
                    r = await c.post(f"{base}/{route}", content=body, headers=headers)
                    assert r.status_code == 401, (route, body[:20], headers, r.status_code, r.text)
            ok = await c.post(f"{base}/reward", json={"value": 1.0}, headers={"Authorization": "Bearer adminkey"})
            assert ok.status_code == 200, ok.text


def test_a_rollout_input_cannot_change_the_structure_of_the_operators_job_template():
    """Round 6: the docs' own template (``cpu: {{ input.get("cpus", 1) }}``) let an input close the mapping and
    add a privileged container, host namespaces and the node's / mounted; ``--dry-run`` called it valid."""
    from agl_common.schemas import Rollout
    from agl_controller.k8s import JobRenderer

    template = ('apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n      containers:\n'
                '        - name: harness\n          image: {{ "registry.example.com/" ~ input.get("image", "h:1") }}\n'
                '          resources: {limits: {cpu: {{ input.get("cpus", 1) }}, memory: 2Gi}}\n')
    renderer = JobRenderer(template, "http://gw:8080", "m")
    evil = ("1}}\n      hostPID: true\n      containers:\n        - name: harness\n          image: evil/miner:1\n"
            "          securityContext: {privileged: true}\n          resources: {limits: {cpu: 1")
    for inp in ({"cpus": evil}, {"image": "x\n      hostNetwork: true"}):
        try:
            m = renderer.render(Rollout(rollout_id="r", input=inp))
        except ValueError:
            continue  # refused (an invalid Job) is fine too; what must never happen is the structure changing
        pod = m["spec"]["template"]["spec"]
        assert set(pod) <= {"containers", "restartPolicy", "automountServiceAccountToken"}, pod
        assert set(pod["containers"][0]) == {"name", "image", "resources", "env"}, pod["containers"][0]
    ok = renderer.render(Rollout(rollout_id="r", input={"cpus": 2, "image": "h:2"}))
    container = ok["spec"]["template"]["spec"]["containers"][0]
    assert str(container["resources"]["limits"]["cpu"]) == "2" and container["image"] == "registry.example.com/h:2"


#: a harness command whose script exists (run from the repository root): ``agl-controller run`` checks it (round 16)
HARNESS_CMD = "python examples/arithmetic/agent.py"


def _cli(*args, env=None, timeout=120):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_train_and_eval_refuse_what_the_controller_cannot_import_or_where_nothing_can_be_written(tmp_path):
    """Round 6: a ``reward_fn`` (or ``preload``) module that does not import failed only once the controller
    started, after vLLM; an ``out_dir`` that cannot be created was a traceback. Each is one line, exit 2, at once."""
    import time

    import yaml

    for fields in ({"reward_fn": "no_such_module_r6:score"}, {"preload": ["no_such_module_r6"]},
                   {"out_dir": "/proc/r6-nowhere"}, {"out_dir": str(tmp_path / "file")}):
        (tmp_path / "file").write_text("x")
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({**fields, "redis_url": "redis://127.0.0.1:9/0"}))
        for command in (("agl_trainer", "train", str(config)), ("agl_trainer", "eval", str(config))):
            t0 = time.monotonic()
            out = _cli(*command)
            assert out.returncode == 2 and "Traceback" not in out.stderr, (fields, command, out.stderr[-500:])
            assert time.monotonic() - t0 < 60
            assert next(iter(fields)) in out.stderr, out.stderr[-300:]


def test_cli_refusals_are_one_line_and_change_nothing(redis_url, prefix, tmp_path):
    """Round 6: ``gateway resume --pause UNKNOWN`` said "resumed" (and ended nothing); ``--version`` without
    ``--model`` dropped the version and ended every pause; ``--model " x "`` or with terminal escapes was
    published; ``rollouts show --tokenizer`` on a broken tokenizer and ``agl-controller run`` with Redis out of
    reach or an out-of-range option were tracebacks; ``rollouts create --n 3`` queued part of a group unprinted."""
    base = ("--redis", redis_url, "--prefix", prefix)
    for args in (("--pause", "nobody-holds-this"), ("--version", "5"), ("--model", " x ", "--version", "1"),
                 ("--model", "x\x1b]8;;http://evil\x07y", "--version", "1")):
        out = _cli("agl_trainer", "gateway", "resume", *args, *base)
        assert out.returncode == 2 and "resumed" not in out.stdout and "Traceback" not in out.stderr, (args, out)
    bad_tok = tmp_path / "tok"
    bad_tok.mkdir()
    (bad_tok / "tokenizer.json").write_text("{not json")
    out = _cli("agl_trainer", "rollouts", "show", "r1", "--tokenizer", str(bad_tok), *base)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-500:]
    for args in (("--redis", "redis://127.0.0.1:9/0", "--command", HARNESS_CMD),
                 ("--redis", redis_url, "--command", HARNESS_CMD, "--lease-ttl", "1e300"),
                 ("--redis", redis_url, "--mode", "k8s", "--template", str(bad_tok / "tokenizer.json"), "--dry-run",
                  "--ttl-after-finished", "-5")):
        out = _cli("agl_controller", "run", "--gateway", "http://127.0.0.1:9", "--prefix", prefix, *args)
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr, (args, out.stderr[-600:])
    assert _cli("agl_trainer", "rollouts", "create", "--input", "{}", "--id", "pc-1", *base).returncode == 0
    out = _cli("agl_trainer", "rollouts", "create", "--input", "{}", "--id", "pc", "--n", "3", *base)
    assert out.returncode == 1 and out.stdout.split() == ["pc-0"] and "pc-1" in out.stderr, out


def test_a_runs_config_json_with_its_hidden_redis_password_asks_for_the_url(tmp_path, redis_url):
    """Round 6: resuming from a run's config.json (its Redis password shown as ***) tried ``:***@`` as the password,
    took the refusal for "no Redis", started a redis-server of its own on that port and failed 20 s later."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"redis_url": "redis://:***@127.0.0.1:6379/0"}))
    out = _cli("agl_trainer", "train", str(config))
    assert out.returncode == 2 and "--redis" in out.stderr and "Traceback" not in out.stderr, out.stderr[-400:]


# ------------------------------------------------------------------------------------------ the gateway, round 6
async def _one(c, gw, body=None, route="chat/completions", rid="r1"):
    return await c.post(f"{gw.url}/rollouts/{rid}/attempts/0/v1/{route}",
                        json={"model": "m", "messages": USER, **(body or {})})


async def _last(store, rid="r1"):
    calls = await store.read_calls(rid)
    return calls[-1] if calls else None


async def test_an_engine_redirect_is_an_engine_error_never_followed(store, redis_url, prefix):
    """Round 6: a 307 from the engine re-sent the agent's whole conversation to the Location (any host) and handed
    that host's answer to the agent; a redirect to a dead port marked the engine down for every rollout."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, RedirectResponse
    from fakes import Served

    seen = []
    elsewhere = FastAPI()

    @elsewhere.post("/elsewhere")
    async def stolen(request: Request):
        seen.append(await request.body())
        return JSONResponse({"stolen": True})

    with Served(elsewhere) as thief:
        engine = FastAPI()

        @engine.get("/v1/models")
        async def models():
            return {"data": [{"id": "m"}]}

        @engine.post("/v1/chat/completions")
        async def redirect():
            return RedirectResponse(thief.url + "/elsewhere", status_code=307)

        await make_rollout(store, "r1")
        with Served(engine) as up, gateway(redis_url, prefix, up.url) as gw:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await _one(c, gw)
                again = await _one(c, gw)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error" and "307" in r.text, r.text
    assert again.status_code == 502 and again.json()["error"]["code"] == "upstream_error"  # not marked down
    assert seen == []


async def test_an_engine_answer_past_the_bound_is_a_502_and_keeps_nothing_of_it(store, redis_url, prefix, upstream,
                                                                              monkeypatch):
    """Round 6: a complete answer had no size bound (a 20 KB gzip body inflated to 20 MB reached the agent and the
    record; 400 MB blocked Redis for every client)."""
    from agl_gateway import upstream as up_mod
    from fakes import chat_answer

    monkeypatch.setattr(up_mod, "ANSWER_BYTES_MAX", 20_000)
    await make_rollout(store, "r1")
    big = chat_answer("up", [1, 2, 3], [5, 6, 2], message="x" * 30_000)
    upstream.app.state.plan = ("body", 200, orjson.dumps(big))
    try:
        with gateway(redis_url, prefix, upstream.url) as gw:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await _one(c, gw)
    finally:
        upstream.app.state.plan = None
    assert r.status_code == 502 and "exceeds" in r.text, r.text
    rec = await _last(store)
    assert rec.status == "error" and rec.response is None and len(rec.model_dump_json()) < 5000


async def test_records_that_contradict_the_engines_own_answer_are_errors(store, redis_url, prefix, upstream):
    """Round 6: prompt ids other than usage.prompt_tokens, a reply with text but no token ids (usage saying 0), an
    ``error`` beside valid choices, and in a stream: a second, different prompt_token_ids or a choice index "0"
    (relayed, not captured) were all recorded ``ok``."""
    from fakes import chat_answer, chat_chunks

    await make_rollout(store, "r1")
    bodies = []
    b = chat_answer("up", [1, 2, 3], [5, 6, 2])
    b["usage"]["prompt_tokens"] = 999
    bodies.append(("prompt token ids incomplete", b))
    b = chat_answer("up", [1, 2, 3], [], message="long text with no tokens", completion_tokens=0)
    bodies.append(("response token ids missing", b))
    b = chat_answer("up", [1, 2, 3], [5, 6, 2])
    b["error"] = {"message": "engine died"}
    bodies.append(("engine died", b))
    chunks = chat_chunks("up", [1, 2, 3], [5, 6, 7, 2])
    second = orjson.loads(chunks[1][len(b"data: "):])
    second["prompt_token_ids"] = [99, 98]
    two_prompts = [chunks[0], b"data: " + orjson.dumps(second) + b"\n\n", *chunks[2:]]
    string_index = [c.replace(b'"index":0', b'"index":"0"') if k else c for k, c in enumerate(chunks)]
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for word, body in bodies:
                upstream.app.state.plan = ("body", 200, orjson.dumps(body))
                await _one(c, gw)
                rec = await _last(store)
                assert rec.status == "error" and word in rec.error, (word, rec.status, rec.error)
            for word, sent in (("prompt_token_ids", two_prompts), ("index", string_index)):
                upstream.app.state.plan = ("stream", sent, "done")
                await _one(c, gw, {"stream": True})
                rec = await _last(store)
                assert rec.status == "error" and word in rec.error, (word, rec.status, rec.error)
            upstream.app.state.plan = ("stream", chunks, "done")
            await _one(c, gw, {"stream": True})
            assert (await _last(store)).status == "ok"
    upstream.app.state.plan = None


async def test_a_deep_stream_answer_is_an_error_record_every_reader_can_read(store, redis_url, prefix, upstream):
    """Round 6: a live stream whose usage chunk nested 220 levels was recorded ``ok`` and made every read of the
    rollout (show, export, training rows) fail; at 300 levels nothing was recorded and the agent got a 500 event."""
    from fakes import chat_chunks

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await _one(c, gw)).status_code == 200
            for depth in (220, 300):
                chunks = chat_chunks("up", [1, 2, 3], [5, 6, 7, 2])
                usage = orjson.loads(chunks[-1][len(b"data: "):])
                deep: object = 1
                for _ in range(depth if depth < 250 else 240):
                    deep = [deep]
                usage["usage"]["x"] = deep
                raw = b"data: " + orjson.dumps(usage) + b"\n\n"
                if depth >= 250:  # past orjson's own limit: written by hand
                    raw = raw.replace(b'"x":', b'"x":' + b"[" * (depth - 240), 1)
                    raw = raw.replace(b"]}}", b"]" * (depth - 240) + b"]}}", 1)
                upstream.app.state.plan = ("stream", [*chunks[:-1], raw], "done")
                r = await _one(c, gw, {"stream": True})
                assert r.status_code == 200 and "internal_error" not in r.text, r.text[-300:]
    upstream.app.state.plan = None
    calls = await store.read_calls("r1")  # every record readable, the good one kept
    assert [x.status for x in calls][0] == "ok" and all(x.status == "error" for x in calls[1:]), calls
    assert len(calls) == 3


async def test_completions_keep_the_agents_logprobs_and_refuse_odd_ones(store, redis_url, prefix, upstream):
    """Round 6: ``logprobs: 5`` was forced to 0 (no alternatives for the agent), ``logprobs: 0`` answered null,
    ``logprobs: "yes"`` passed."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            post = lambda body: c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/completions",  # noqa: E731
                                       json={"model": "m", "prompt": "3+4=", **body})
            for odd in ("yes", True, -1, 1.5):
                r = await post({"logprobs": odd})
                assert r.status_code == 400 and "logprobs" in r.text, (odd, r.text)
            r5 = await post({"logprobs": 5})
            assert r5.status_code == 200 and upstream.app.state.calls[-1]["logprobs"] == 5
            r0 = await post({"logprobs": 0})
            assert r0.status_code == 200 and r0.json()["choices"][0]["logprobs"] is not None, r0.text
            plain = await post({})
            assert plain.status_code == 200 and plain.json()["choices"][0]["logprobs"] is None
            assert upstream.app.state.calls[-1]["logprobs"] == 0


async def test_a_usage_chunk_with_choices_still_reaches_an_agent_that_did_not_ask_for_usage(
        store, redis_url, prefix, upstream):
    """Round 6: a last token chunk that also carried ``usage`` was dropped whole for an agent without
    stream_options: it never got the last text nor the finish reason (the record had them)."""
    from fakes import chat_chunks

    await make_rollout(store, "r1")
    chunks = chat_chunks("up", [1, 2, 3], [5, 6, 7, 2], text="the answer is 7")
    last, usage = orjson.loads(chunks[-2][len(b"data: "):]), orjson.loads(chunks[-1][len(b"data: "):])
    last["usage"] = usage["usage"]
    last["choices"][0]["delta"]["content"] = "LAST"
    sent = [*chunks[:-2], b"data: " + orjson.dumps(last) + b"\n\n"]
    upstream.app.state.plan = ("stream", sent, "done")
    try:
        with gateway(redis_url, prefix, upstream.url) as gw:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await _one(c, gw, {"stream": True})
    finally:
        upstream.app.state.plan = None
    assert "LAST" in r.text and '"finish_reason":"stop"' in r.text and '"usage"' not in r.text, r.text
    assert (await _last(store)).status == "ok"


async def test_a_held_call_is_checked_again_when_the_pause_ends_and_held_calls_are_bounded(store, redis_url,
                                                                                        prefix, upstream):
    """Round 6: a call held by a pause while its rollout succeeded (or its attempt was retried) was forwarded
    after the resume and recorded ``ok``; one scoped key could park any number of 8 MiB bodies while paused."""
    import asyncio

    import pytest
    from agl_common.control import pause_and_drain, resume
    from agl_common.schemas import RolloutStatus
    from agl_gateway.gate import PauseGate, TooManyHeld

    await make_rollout(store, "r1")
    await make_rollout(store, "r2")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            await pause_and_drain(store, "p1", timeout_s=10)
            held = [asyncio.create_task(_one(c, gw, rid=rid)) for rid in ("r1", "r2")]
            await asyncio.sleep(0.5)
            await store.set_status("r1", RolloutStatus.succeeded)
            await store.retry_attempt("r2", "0")
            await resume(store, release="p1")
            r1, r2 = await asyncio.gather(*held)
    assert (r1.status_code, r1.json()["error"]["code"]) == (409, "rollout_finished"), r1.text
    assert (r2.status_code, r2.json()["error"]["code"]) == (409, "stale_attempt"), r2.text
    assert upstream.app.state.calls == [] and await store.read_calls("r1") == []

    gate = PauseGate(5.0, max_held_per_attempt=2)
    gate.hold(frozenset({"p"}))
    waiting = [asyncio.create_task(gate.enter("r/0")) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(TooManyHeld):
        await gate.enter("r/0")
    other = asyncio.create_task(gate.enter("s/0"))  # another attempt is not refused
    await asyncio.sleep(0.05)
    gate.hold(frozenset())
    assert await asyncio.gather(*waiting, other) == [True, True, True]


async def test_controller_edges_of_round_6(store, redis_url, prefix, tmp_path, monkeypatch):
    """Round 6: a legal 250-character rollout id could never run locally (its log file name was too long); a
    rollout whose every call the engine failed succeeded on its posted reward; a judge was skipped whenever the
    harness posted a reward (now ``--reward-fn-always`` makes it the judge); ``--preload`` with ``python -u`` failed
    every rollout; ``--gateway`` without a scheme failed every run as the agent's ``exit_code:1``; ``--dry-run``
    printed the queued rollouts' working scoped keys."""
    from pathlib import Path

    import pytest
    from agl_common.auth import scoped_key
    from agl_common.schemas import CallRecord, Rollout, RolloutStatus
    from agl_controller import LocalRunner
    from agl_controller.spawn import LaunchError, Launcher
    from agl_gateway import GatewaySettings, create_app
    from fakes import Served, fake_upstream
    from test_controller import HARNESS

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    with Served(fake_upstream()) as up, Served(create_app(GatewaySettings(
            upstream=up.url, redis_url=redis_url, prefix=prefix, model="m", key="k3y"))) as gw:
        long_id = "L" * 250
        runner = LocalRunner(store, gw.url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs",
                             reward_fn="rewards:zero", reward_fn_always=True)
        for rid in (long_id, "self-rewarded"):
            await store.create_rollout(Rollout(rollout_id=rid, input={"calls": 1, "reward": 1e6}))
            await runner.run_one(await store.pop_queued())
        long_r, self_r = await store.get_rollout(long_id), await store.get_rollout("self-rewarded")
        assert long_r.status == RolloutStatus.succeeded, long_r.failure
        assert (self_r.status, self_r.reward) == (RolloutStatus.succeeded, 0.0)  # the judge's, not the harness's
        assert any(e["type"] == "reward_replaced" for e in await store.read_events("self-rewarded"))
        assert len(list((tmp_path / "logs").glob("L*"))) == 1
    # every call failed at the engine: the posted reward does not make it a success
    await store.create_rollout(Rollout(rollout_id="failed-calls", status=RolloutStatus.running, reward=1.0),
                               enqueue=False)
    await store.record_call(CallRecord(rollout_id="failed-calls", attempt_id="0", seq=-1, route="chat", request={},
                                       response=None, status="error", error="502 upstream_error"))
    out = await runner.finish_attempt("failed-calls", "0", None)
    assert (out.status, out.failure) == (RolloutStatus.failed, "no_model_calls")
    import sys
    with pytest.raises(LaunchError, match="-u"):
        Launcher([sys.executable, "-u", "x.py"], ["json"])
    for args in (("--gateway", "127.0.0.1:8080", "--command", HARNESS_CMD),
                 ("--gateway", "http://gw:8080", "--command", HARNESS_CMD, "--reward-fn-always")):
        res = _cli("agl_controller", "run", "--redis", redis_url, "--prefix", prefix, *args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr[-400:])
    template = tmp_path / "job.yaml.j2"
    template.write_text("spec: {template: {spec: {containers: [{name: c, image: x}]}}}\n")
    res = _cli("agl_controller", "run", "--redis", redis_url, "--prefix", prefix, "--mode", "k8s", "--template",
               str(template), "--dry-run", "--key", "adminkey", "--input", "{}")
    assert res.returncode == 0, res.stderr[-400:]
    assert scoped_key("adminkey", "dry-run-0", "0") not in res.stdout and "OPENAI_API_KEY" in res.stdout


def test_the_stack_swaps_only_a_python_interpreter_word():
    """Round 5: ``cfg.command.replace("python ", ...)`` rewrote ``mypython x.py`` and any argument holding
    ``python ``."""
    from agl_trainer.stack import harness_command

    assert harness_command('python a.py --note "a python b"', "/v/py") == "/v/py a.py --note 'a python b'"
    assert harness_command("mypython x.py", "/v/py") == "mypython x.py"
    assert harness_command("python3 -m pkg", "/v/py") == "/v/py -m pkg"


def test_the_dashboard_reads_numbers_past_float_range_as_missing(tmp_path):
    """Round 6: a ``1e400`` in a run's metrics.jsonl made /api/runs/{run} a 500 (it read as inf)."""
    import json as std_json

    from agl_trainer.ui.runs import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1e400}\n{"step": 2, "loss": -1e999, "kl": 0.5}\n')
    rows = read_jsonl(path)
    assert rows == [{"step": 1, "loss": None}, {"step": 2, "loss": None, "kl": 0.5}]
    std_json.dumps(rows, allow_nan=False)


def test_messages_export_writes_odd_tool_calls_in_one_shape(tmp_path):
    """Round 5: ``--shape messages`` failed on a call whose ``tool_calls`` was a string, and Parquet refused tool
    arguments that were an object in one call and a string in the next."""
    from agl_common.schemas import CallRecord
    from agl_trainer.export import ExportStats, conversations, write

    def call(seq, sent, answer):
        return CallRecord(rollout_id="r", attempt_id="0", seq=seq, route="chat", request={"messages": sent},
                          response={"choices": [{"message": answer}]})

    tc = lambda args: [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]  # noqa: E731
    calls = [call(0, USER, {"role": "assistant", "content": None, "tool_calls": tc({"x": 1})}),
             call(1, USER + [{"role": "assistant", "tool_calls": "not a list"}], {"role": "assistant",
                                                                                 "tool_calls": tc('{"x": 2}')}),
             call(2, [{"role": "user", "content": 5, "name": 7}], {"role": "assistant", "tool_calls": [5, None]})]
    convs = conversations(calls, ExportStats())
    records = [{"messages": m, "tools": t, "n_calls": n} for m, t, n, _ in convs]
    flat = [msg for r in records for msg in r["messages"]]
    assert all(v is None or isinstance(v, str) for msg in flat for k, v in msg.items() if k != "tool_calls")
    args = [c["function"]["arguments"] for msg in flat for c in msg["tool_calls"] or []]
    assert args and all(isinstance(a, str) for a in args)
    write(records, "messages", "parquet", tmp_path / "m.parquet")
    assert (tmp_path / "m.parquet").stat().st_size > 0


async def test_a_gateway_without_a_key_takes_no_request_from_a_web_page(store, redis_url, prefix, upstream):
    """Rounds 6 and 7: a keyless gateway took ``Content-Type: text/plain`` (no CORS preflight) and bodies with no
    Content-Type at all (``fetch(..., {mode: "no-cors", body: blob})``, ``sendBeacon``): any web page open on the
    machine could make model calls and post rewards. Browsers add ``Origin`` to every POST; agents' clients never."""
    await make_rollout(store, "r1")
    body = orjson.dumps({"model": "m", "messages": USER})
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            base = f"{gw.url}/rollouts/r1/attempts/0"
            for kind in ("text/plain", "application/x-www-form-urlencoded", None, "application/json"):
                for route, raw in (("v1/chat/completions", body), ("reward", b'{"value": 1}')):
                    headers = {"Origin": "http://evil.example", **({"Content-Type": kind} if kind else {})}
                    r = await c.post(f"{base}/{route}", content=raw, headers=headers)
                    assert r.status_code == 403 and r.json()["error"]["code"] == "browser_request", (kind, route)
            assert upstream.app.state.calls == [] and (await store.get_rollout("r1")).reward is None
            for kind in ("application/json", "text/plain", None):  # what agents' clients send
                ok = await c.post(f"{base}/v1/chat/completions", content=body,
                                  headers={"Content-Type": kind} if kind else {})
                assert ok.status_code == 200, (kind, ok.text)
    with gateway(redis_url, prefix, upstream.url, key="adminkey") as gw:  # with a key: browsers may call it
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", content=body,
                             headers={"Origin": "http://app.example", "Authorization": "Bearer adminkey"})
            assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------ round 7
async def test_round7_gateway_edges(store, redis_url, prefix, upstream):
    """Round 7: an answer the agent gave up on before it arrived was recorded ``ok`` (an SDK timeout then retried:
    several ok records for one turn); an attempt at its record bound still had the engine generate (then 429, which
    SDKs retry twice); with a key and ``--open`` a malformed call created its rollout; the synthesized Anthropic
    stream turned a thinking block into an empty text block; calls in flight per attempt were unbounded."""
    import asyncio

    from agl_common.store import RolloutNotFound
    from agl_gateway.gate import PauseGate, TooManyHeld
    from agl_gateway.translate import anthropic_sse

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=0.5) as c:
            try:
                await _one(c, gw, {"x_delay": 1.5})
            except httpx.TimeoutException:
                pass
        for _ in range(60):
            if await store.read_calls("r1"):
                break
            await asyncio.sleep(0.1)
        rec = await _last(store)
        assert rec.status == "error" and "abandoned" in rec.error, rec
    await make_rollout(store, "r2")
    with gateway(redis_url, prefix, upstream.url, max_calls_per_attempt=2) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            codes = [(await _one(c, gw, rid="r2")).status_code for _ in range(4)]
    assert codes == [200, 200, 403, 403] and len(upstream.app.state.calls) == 3  # (1 from r1, 2 from r2)
    with gateway(redis_url, prefix, upstream.url, key="adminkey", open=True) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{gw.url}/rollouts/fresh/attempts/0/v1/chat/completions", content=b"{not json",
                             headers={"Authorization": "Bearer adminkey"})
            assert r.status_code == 400
            try:
                await store.get_rollout("fresh")
                raise AssertionError("a malformed call created its rollout")
            except RolloutNotFound:
                pass
            ok = await c.post(f"{gw.url}/rollouts/fresh/attempts/0/v1/chat/completions",
                              json={"model": "m", "messages": USER}, headers={"Authorization": "Bearer adminkey"})
            assert ok.status_code == 200 and (await store.get_rollout("fresh")).rollout_id == "fresh"
    events = b"".join(anthropic_sse({"id": "m", "type": "message", "role": "assistant", "content": [
        {"type": "thinking", "thinking": "3+4=7", "signature": "sig"}, {"type": "text", "text": "7"}],
        "usage": {}}))
    assert b'"content_block":{"type":"thinking"' in events and b'"thinking_delta"' in events
    assert b'"signature_delta"' in events and b'"text_delta","text":""' not in events
    gate = PauseGate(5.0, max_held_per_attempt=2)
    assert [await gate.enter("r/0"), await gate.enter("r/0")] == [False, False]  # open gate: in flight
    try:
        await gate.enter("r/0")
        raise AssertionError("a third call in flight was let through")
    except TooManyHeld:
        pass
    gate.leave("r/0")
    assert await gate.enter("r/0") is False


async def test_round7_controller_edges(store, redis_url, prefix, tmp_path, monkeypatch):
    """Round 7: a newcomer with a shorter ``--lease-ttl`` took a live id's claims; a stop while the judge scored a
    finished run left it running (then ``controller_lost``); a ``--preload`` module that raises on import left every
    rollout running for ever; a hashed log name could be another id's plain one; ``--reward-fn-always`` kept the
    harness's reward message; ``--gateway http://h/v1`` and a YAML ``gateway_url`` without a scheme failed every run
    as the agent's fault."""
    import asyncio
    import sys
    from pathlib import Path

    import pytest
    from agl_common.schemas import Rollout, RolloutStatus, check_rollout_id
    from agl_controller import LocalRunner
    from agl_controller.base import ControllerIdLive, Runner
    from agl_controller.local import log_name
    from agl_controller.spawn import LaunchError, Launcher
    from agl_gateway import GatewaySettings, create_app
    from agl_trainer.config import TrainConfig
    from fakes import Served, fake_upstream
    from test_controller import HARNESS

    live = Runner(store, controller_id="ctl-z", lease_ttl_s=3.0)
    stop = asyncio.Event()
    renewing = asyncio.create_task(live.lease_loop(stop))
    while await store.lease_of("ctl-z") is None:
        await asyncio.sleep(0.02)
    try:
        with pytest.raises(ControllerIdLive):
            await Runner(store, controller_id="ctl-z", lease_ttl_s=0.2).take_lease()
    finally:
        stop.set()
        await renewing

    hashed = log_name("L" * 250, "0")
    assert "+" in hashed and len(hashed) < 200
    with pytest.raises(ValueError):  # no rollout id can spell the hashed form (a "+" is no id's character)
        check_rollout_id(hashed.removesuffix(".0.log"))

    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LaunchError, match="needs a GPU"):
        Launcher([sys.executable, "x.py"], ["raises_on_import"])
    from agl_controller.base import load_reward_fn
    with pytest.raises(ValueError, match="RuntimeError"):
        load_reward_fn("raises_on_import:f")

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    with Served(fake_upstream()) as up, Served(create_app(GatewaySettings(
            upstream=up.url, redis_url=redis_url, prefix=prefix, model="m", key="k3y"))) as gw:
        runner = LocalRunner(store, gw.url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs",
                             reward_fn="rewards:zero", reward_fn_always=True)
        await store.create_rollout(Rollout(rollout_id="msg", input={"calls": 1, "reward": 1e6}))
        await runner.run_one(await store.pop_queued())
        r = await store.get_rollout("msg")
        assert (r.reward, r.reward_message) == (0.0, None)
        # a stop while the judge scores: the attempt is handed back, not left running
        slow = LocalRunner(store, gw.url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs",
                           reward_fn="rewards:slow")
        await store.create_rollout(Rollout(rollout_id="judged", input={"calls": 1, "judge_s": 30}))
        task = asyncio.create_task(slow.run_one(await store.pop_queued()))
        for _ in range(200):
            await asyncio.sleep(0.05)
            if await store.read_calls("judged") and (await store.get_rollout("judged")).status == "running":
                if not slow._procs:
                    break
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = await store.get_rollout("judged")
        assert (r.status, r.attempt_id) == (RolloutStatus.queuing, "1"), r
    for args in (("--gateway", "http://127.0.0.1:8080/v1"), ("--gateway", "http://127.0.0.1:8080?x=1")):
        res = _cli("agl_controller", "run", "--redis", redis_url, "--prefix", prefix, "--command", HARNESS_CMD, *args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr[-300:])
    for bad in ({"gateway_url": "127.0.0.1:8080"}, {"gateway_url": "http://h/v1"}, {"rollout_timeout_s": 1e300}):
        with pytest.raises(ValueError):
            TrainConfig(**bad)


def test_round7_cli_edges(redis_url, prefix, tmp_path):
    """Round 7: a reward module imported by the start-up check (and any process it starts then) still had the admin
    key and Redis URL in its environment; ``--dry-run`` in local mode was ignored (the controller took the queue);
    an unusable ``--log-dir``, a template that does not parse, no cluster in k8s mode, ``demo --prefix 'a{b'``
    were tracebacks (or every rollout a template_error); ``rollouts show --config`` of a run's config.json was
    refused on a Redis with a password even with ``--redis``; a 200k-character served name passed."""
    import json

    import pytest
    from agl_common.schemas import check_served_name

    (tmp_path / "judge_env.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['ENV_OUT']).write_text(repr(os.environ.get('AGL_KEY')))\n"
        "def judge(i, o):\n    return 0.0\n")
    out = tmp_path / "env.txt"
    res = _cli("agl_controller", "run", "--redis", "redis://127.0.0.1:9/0", "--command", HARNESS_CMD,
               "--reward-fn", "judge_env:judge", env={"AGL_KEY": "s3cret-admin", "ENV_OUT": str(out),
                                                      "PYTHONPATH": f"{tmp_path}:" + __import__("os").environ.get(
                                                          "PYTHONPATH", "")})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-300:]
    assert out.read_text() == "None"
    bad_template = tmp_path / "job.j2"
    bad_template.write_text("spec: {{ input.x \n")
    (tmp_path / "file").write_text("x")
    for args in (("--command", HARNESS_CMD, "--dry-run"), ("--command", HARNESS_CMD, "--log-dir",
                                                              str(tmp_path / "file" / "logs")),
                 ("--mode", "k8s", "--template", str(bad_template)),
                 ("--mode", "k8s", "--template", str(bad_template).replace("job.j2", "file"))):
        res = _cli("agl_controller", "run", "--redis", redis_url, "--prefix", prefix, *args,
                   env={"KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}, timeout=60)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.returncode, res.stderr[-400:])
    res = _cli("agl_trainer", "demo", "--prefix", "a{b")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-300:]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"redis_url": "redis://:***@127.0.0.1:6379/0"}))
    res = _cli("agl_trainer", "rollouts", "show", "nobody", "--config", str(config), "--redis", redis_url,
               "--prefix", prefix)
    assert "***" not in res.stderr and "password" not in res.stderr, res.stderr[-300:]
    with pytest.raises(ValueError):
        check_served_name("m" * 257)
