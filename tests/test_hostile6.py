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
    ("responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"input": "hi", "conversation": "conv_1"}, "conversation"),
    ("responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "server"),
    ("responses", {"input": "hi", "instructions": 5}, "'instructions'"),
    ("responses", {"input": [{"type": "weird"}]}, "'weird'"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, 5]}]}, "object"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "'input_file'"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c1", "output": 5}]}, "'output'"),
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
    with a relative command and log dir: the agent's failure, for the controller's change."""
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
            assert Path.cwd() == Path("/")  # the judge moved the whole process
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
    for args in (("--redis", "redis://127.0.0.1:9/0", "--command", "python x.py"),
                 ("--redis", redis_url, "--command", "python x.py", "--lease-ttl", "1e300"),
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
