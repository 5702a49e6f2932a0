"""Round 23 of hostile input (docs/operations.md, "A twenty-third round"): each test failed before its fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_otel import otlp  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_the_verl_entry_point_makes_its_log_records_printable():
    """(Left open by round 22's nineteenth prober.) ``train --backend verl`` runs its lease in ``python -m
    agl_trainer.backends.verl.main``, which did not install the printable log records: its lease warnings would print
    a hostile Redis's terminal escapes raw. It installs them first, as the three CLIs do."""
    code = ("import logging\n"
            "from agl_trainer.backends.verl.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "record = logging.getLogger('agl.lease').makeRecord('agl.lease', 30, 'x', 1, 'lost: %s', ('\\x1b]8;;x\\x07',), None)\n"
            "print(repr(record.getMessage()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert "\\\\x1b" in last, last  # (repr: an escaped ESC shows two backslashes, a raw one one)


async def test_what_a_judge_runs_cannot_reach_the_controller_or_forge_a_reward(monkeypatch, tmp_path):
    """(The twenty-first prober's first finding.) The reward worker's descriptors were inheritable (spawn passes them
    so) and the controller unpickled whatever came through its pipe: a candidate program a judge ran with
    ``os.system`` wrote one framed pickle into the inherited socket and ran code in the controller (the admin key
    read from its memory), its forged reward 123456 was recorded, and the worker's real answer was read as the next
    call's. Now what crosses the pipe is JSON under a nonce per request, checked again in the controller; the
    worker's descriptors are closed on exec; a worker whose pipe holds more than its answer is not kept."""
    from agl_controller.reward import RewardFunctionError, RewardPool

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "harnesses"))
    proof = tmp_path / "ran-in-controller"
    payload = (
        "import os, pickle, struct\n"
        "class P:\n"
        "    def __reduce__(self):\n"
        f"        return (eval, (\"(open({str(proof)!r}, 'w').write('x'), (True, 123456.0))[1]\",))\n"
        "data = pickle.dumps(P())\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        if os.readlink(f'/proc/self/fd/{fd}').startswith(('socket:', 'pipe:')):\n"
        "            os.write(int(fd), struct.pack('!i', len(data)) + data)\n"
        "            os.write(int(fd), struct.pack('!i', 22) + b'[\"0\", true, 123456.0]')\n"
        "    except OSError:\n"
        "        pass\n")
    pool = RewardPool("rewards:judge_runs", idle=1)
    try:
        assert await pool.score({"code": payload, "worth": 1.0}, "", 60) == 1.0
        assert await pool.score({"code": "raise SystemExit(1)"}, "", 60) == 0.0
        assert await pool.score({"code": "pass", "worth": 0.25}, "", 60) == 0.25
        assert not proof.exists()
    finally:
        pool.close()

    pool = RewardPool("rewards:writes_into_its_pipe", idle=1)
    try:
        for forged in ("x", '["0", true, 5.0]', '[null, true, 5.0]', '[]', '{"a": 1}', "[1e999]"):
            with pytest.raises(RewardFunctionError, match="out of turn"):
                await pool.score({"forged": forged}, "", 60)
            assert pool._idle == []  # (a worker that answered out of turn is never kept)
        with pytest.raises(RewardFunctionError, match="more than 4096 bytes"):
            await pool.score({"forged": "[" + " " * 5000 + "]"}, "", 60)
    finally:
        pool.close()


async def test_a_judge_may_start_processes_of_its_own(monkeypatch):
    """(The twenty-first prober's second finding.) The worker was a daemonic process, and multiprocessing refuses
    children to those: a judge shaped like HumanEval's ``check_correctness`` (the candidate in a
    ``multiprocessing.Process`` with a time limit), a ``Pool``, verl's ``prime_code`` failed every run with
    ``reward_error``. An input holding an integer beyond 64 bits still reaches the judge."""
    from agl_controller.reward import RewardPool

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "harnesses"))
    pool = RewardPool("rewards:judge_in_process", idle=1)
    try:
        assert await pool.score({"code": "assert 1 + 1 == 2", "big": 10**30}, "", 120) == 1.0
        assert await pool.score({"code": "assert 1 + 1 == 3"}, "", 120) == 0.0
    finally:
        pool.close()


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agl_trainer", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(180)
def test_a_model_directorys_file_that_cannot_be_read_is_one_line(tmp_path, redis_url, prefix):
    """(The twentieth prober.) A FIFO ``generation_config.json`` in a model or tokenizer directory hung every command
    that loads its vocabulary (``rollouts show --config``, ``export --shape rows``, ``ui --tokenizer``, and a training
    run with every service up); one that is not JSON was a traceback there. Each is one line naming the file, and a
    run loads the vocabulary before any service starts."""
    import shutil

    from agl_trainer.model import ModelFilesError, load_vocabulary

    tiny = ROOT / "packages" / "trainer" / "src" / "agl_trainer" / "assets" / "tiny-tokenizer"
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "config.json").write_text('{"vocab_size": 1000, "model_type": "llama"}')
    os.mkfifo(model / "generation_config.json")
    with pytest.raises(ModelFilesError, match="generation_config.json: not a regular file"):
        load_vocabulary(model)
    (model / "generation_config.json").unlink()
    for text, why in (("{", "not JSON"), ('{"eos_token_id": "two"}', "no token id")):
        (model / "generation_config.json").write_text(text)
        with pytest.raises(ModelFilesError, match=why):
            load_vocabulary(model)
    (model / "generation_config.json").unlink()
    os.mkfifo(model / "generation_config.json")
    (tmp_path / "cfg.yaml").write_text(f"base_model: {model}\n")
    assert _cli("rollouts", "create", "--input", "{}", "--id", "m-1", "--redis", redis_url,
                "--prefix", prefix).returncode == 0
    out = _cli("rollouts", "show", "m-1", "--config", str(tmp_path / "cfg.yaml"), "--redis", redis_url,
               "--prefix", prefix, timeout=60)
    assert "generation_config.json: not a regular file" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = _cli("ui", "--tokenizer", str(model), "--port", "1", timeout=60)
    assert out.returncode == 2 and "generation_config.json: not a regular file" in out.stderr, out.stderr

    from agl_trainer.config import TrainConfig
    from agl_trainer.run import run_training

    with pytest.raises(ModelFilesError):  # (before any service: no Redis, engine or gateway is started for it)
        run_training(TrainConfig(base_model=str(model), redis_url="redis://127.0.0.1:1/0", out_dir=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").rglob("logs/*"))


def test_a_record_this_version_cannot_read_is_one_line_and_left_out_of_listings(tmp_path, redis_url, prefix):
    """(The twentieth prober.) One stored record this version cannot read (another version's, a hand's) made the
    trainer's commands 100-line tracebacks: a rollout of an unknown status (``rollouts list``, ``export``, the
    dashboard's step, group and rollout pages: 500), a replica's heartbeat (``gateway status`` and ``pause``), the
    policy (``gateway status``, and ``gateway resume --model``, so no command could replace it). Now listings leave
    such a rollout out and say so, every other reader says one line naming the record, ``resume --model`` replaces an
    unreadable policy, and the dashboard's pages name it."""
    import redis as sync_redis

    from agl_common.store import Store

    r = sync_redis.Redis.from_url(redis_url)
    args = ("--redis", redis_url, "--prefix", prefix)
    for rid in ("good-1", "bad-1"):
        assert _cli("rollouts", "create", "--input", "{}", "--id", rid, *args).returncode == 0
    store = Store(redis_url, prefix)
    bad_key = store.rollout_key("rollout", "bad-1")
    r.set(bad_key, '{"rollout_id": "bad-1", "status": "paused"}')
    out = _cli("rollouts", "list", "--json", *args)
    assert out.returncode == 0 and [json.loads(x)["rollout_id"] for x in out.stdout.split()] == ["good-1"], out
    assert "1 of them left out" in out.stderr, out.stderr
    out = _cli("rollouts", "export", *args)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    out = _cli("rollouts", "show", "bad-1", *args)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "rollout 'bad-1'" in out.stderr \
        and "status" in out.stderr, out.stderr

    r.zadd(store.key("replicas"), {"rep-x": 9999999999})
    r.set(store.key("replica", "rep-x"), '{"replica_id": "rep-x", "in_flight": "many"}')
    for cmd in (("gateway", "status"), ("gateway", "pause", "--timeout", "2")):
        out = _cli(*cmd, *args)
        assert out.returncode == 1 and "Traceback" not in out.stderr and "replica 'rep-x'" in out.stderr, out.stderr
    assert r.hlen(store.key("pauses")) == 0  # (the pause was withdrawn)
    r.delete(store.key("replicas"), store.key("replica", "rep-x"))

    r.set(store.key("policy"), '{"model": "", "version": 1}')
    out = _cli("gateway", "status", *args)
    assert out.returncode == 1 and "the current policy" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = _cli("gateway", "resume", "--model", "smollm2", "--version", "0", *args)
    assert out.returncode == 0, out.stderr
    assert json.loads(r.get(store.key("policy")))["model"] == "smollm2"

    import httpx
    from agl_trainer.ui.server import create_app

    from fakes import Served

    run = tmp_path / "demo" / "run1"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "groups": ["g"]}) + "\n")
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        page = httpx.get(ui.url + "/rollouts/bad-1", timeout=60)
        assert page.status_code == 500 and "Unreadable record" in page.text and "bad-1" in page.text, page.text[:500]
        assert httpx.get(ui.url + "/rollouts/good-1", timeout=60).status_code in (200, 303)


def test_an_adapter_whose_directory_name_is_no_served_name_is_refused_at_start(tmp_path, redis_url, prefix):
    """(The twentieth prober.) ``eval --policy PATH`` took an adapter directory whose name makes no served name (255
    characters, an ESC sequence), and after every service had started stored a policy no reader could parse
    (``model_copy`` validates nothing): ``gateway status`` failed from then on. The name is refused before anything
    starts, and the Store checks a policy before storing it. A Rich table's title printed the name's escapes raw."""
    import asyncio

    from agl_common.schemas import Policy
    from agl_common.store import Store
    from agl_trainer.config import TrainConfig
    from agl_trainer.evaluation import EvalPolicy, PolicyNotFound, resolve_policy
    from agl_trainer.report import output_console
    from rich.table import Table

    for name in ("a" * 255, "adapter\x1b[31mRED"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
        with pytest.raises(PolicyNotFound, match="would be served as"):
            resolve_policy(str(tmp_path / name), TrainConfig())
    with pytest.raises(ValueError):
        EvalPolicy("eval-\x1b[31m", 0, tmp_path).policy(TrainConfig())

    async def store_it():
        store = Store(redis_url, prefix)
        try:
            with pytest.raises(ValueError):
                await store.set_policy(Policy(model="ok").model_copy(update={"model": ""}))
            assert await store.get_policy() is None
        finally:
            await store.close()

    asyncio.run(store_it())
    console = output_console()
    table = Table(title="evaluation of \x1b[31mRED")
    table.add_column("metric\x1b]8;;x\x07")
    table.add_row("cell\x1b[2J")
    with console.capture() as got:
        console.print(table)
    assert "\x1b" not in got.get() and all(x in got.get() for x in ("\\x1b[31mRED", "\\x1b]8;;x", "\\x1b[2J"))


async def test_an_engine_urls_credentials_are_masked_in_answers_and_records(store, redis_url, prefix):
    """(The twenty-second prober.) An engine reached as ``http://user:password@host`` (aiohttp sends ``Authorization:
    Basic``) that echoes the request's ``Authorization`` handed the agent, and the call record, the base64 of
    ``user:password``: only ``AGL_UPSTREAM_KEY`` was masked. And with that key, an echo inside a 200 answer was masked
    for the agent but kept in clear in the record's ``response``. Every credential the gateway sends is masked in
    every answer and in the whole record."""
    import base64

    import orjson
    from fakes import Served, fake_upstream
    from test_gateway import MSG, gateway, make_rollout

    b64 = base64.b64encode(b"engineuser:S3cretEnginePassword").decode()
    key = "EngineKey_0123456789abcdef"

    def answer(content: str) -> bytes:
        return orjson.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                             "prompt_token_ids": [1, 2], "usage": {"prompt_tokens": 2, "completion_tokens": 2,
                                                                   "total_tokens": 4},
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                          "finish_reason": "stop", "token_ids": [5, 6], "logprobs": None}]})

    app = fake_upstream()
    await make_rollout(store, "r1")
    seen = []
    with Served(app) as up:
        with_password = up.url.replace("http://", "http://engineuser:S3cretEnginePassword@")
        for upstream, kw, secret in ((with_password, {"upstream_key": None}, f"Basic {b64}"),  # (not the suite's
                                     (up.url, {"upstream_key": key}, f"Bearer {key}")):  # AGL_UPSTREAM_KEY)
            with gateway(redis_url, prefix, upstream, **kw) as gw:
                async with httpx.AsyncClient(timeout=30) as c:
                    plans = [("body", 400, orjson.dumps({"error": {"message": f"Authorization was '{secret}'"}})),
                             ("body", 200, answer(f"auth={secret}"))]
                    if kw["upstream_key"] is None:  # (the password itself, and user:password, echoed by the engine)
                        plans.append(("body", 200, answer("pw=S3cretEnginePassword u:p=engineuser:S3cretEnginePassword")))
                    for plan in plans:
                        app.state.plan = plan
                        r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG)
                        assert len(r.content) == int(r.headers["content-length"])
                        seen.append(r.text)
    assert not [t for t in seen if b64[:12] in t or key[:16] in t or "S3cretEngine" in t], seen
    assert "Basic ****" in seen[0] and "Bearer ****" in seen[3], seen
    records = [c.model_dump_json() for c in await store.read_calls("r1")]
    assert len(records) == 5 and not [t for t in records if b64[:12] in t or key[:16] in t or "S3cretEngine" in t], \
        records


@pytest.mark.timeout(300)
async def test_a_streams_late_events_and_text_fields_cost_linear_time(store, redis_url, prefix):
    """(The twenty-second prober.) Each event after a stream's finish reason copied the list of those before it (160k
    empty closing deltas: 46 s, the event loop stalled for seconds), and the reasoning text and tool-call arguments
    were joined chunk by chunk (64 MB of ``reasoning_content``: 167 s, against 1.7 s as ``content``). Both are now
    collected and joined once. (Bounds 10x and more above the time taken now: they catch the quadratic form only.)"""
    import time

    import orjson
    from agl_gateway.capture import StreamCapture
    from fakes import Served, fake_upstream
    from test_gateway import MSG, gateway, make_rollout

    cap = StreamCapture({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "m")
    cap.cap.prompt_token_ids = [1, 2]
    piece = "r" * 4000
    t0 = time.perf_counter()
    for i in range(6000):
        cap.feed(_chunk({"reasoning_content": piece, "tool_calls": [
            {"index": 0, "id": "t1" if i == 0 else None, "function": {"name": "f" if i == 0 else None,
                                                                      "arguments": piece}}]}, [5]))
    cap.feed(_chunk({}, [], "tool_calls"))
    message = cap.result()[1]["choices"][0]["message"]
    took = time.perf_counter() - t0
    assert len(message["reasoning_content"]) == len(message["tool_calls"][0]["function"]["arguments"]) == 24_000_000
    assert message["tool_calls"][0]["function"]["name"] == "f" and took < 10, took

    events = [_chunk({"role": "assistant", "content": "hi"}, [5], "stop")] + [_chunk({}, [])] * 100_000
    app = fake_upstream()
    app.state.plan = ("stream", [b"data: " + orjson.dumps(e) + b"\n\n" for e in events], "done")
    await make_rollout(store, "r1")
    with Served(app) as up, gateway(redis_url, prefix, up.url) as gw:
        async with httpx.AsyncClient(timeout=300) as c:
            t0 = time.perf_counter()
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json={**MSG, "stream": True})
            took = time.perf_counter() - t0
    assert r.status_code == 200 and r.text.count("data: ") == 100_002 and took < 30, took


def _chunk(delta: dict, ids: list[int], finish: str | None = None) -> dict:
    """A vLLM-shaped chat stream chunk of one choice: ``delta``, its token ``ids`` with a logprob each, ``finish``."""
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": delta, "token_ids": ids, "finish_reason": finish, "logprobs": {"content": [
            {"token": "x", "logprob": -0.1, "bytes": None, "top_logprobs": []} for _ in ids]}}]}


def test_gateway_options_a_served_policy_cannot_hold_are_one_line():
    """(The twenty-second prober.) ``agl-gateway serve --model ' x'`` (a name the policy refuses) was a 59-line
    lifespan traceback, ``--log-level foo`` a ``KeyError`` traceback, and ``AGL_REDIS_MAX_CONNECTIONS=1`` was taken
    (every call then waited 10 s and failed ``store_unavailable``: the control channel holds a connection). One line
    each, exit 2."""
    env = {**os.environ, "AGL_REDIS_URL": "redis://127.0.0.1:1/0"}
    for args, extra, said in ((["--model", " x"], {}, "model"), (["--model", "a\x1b[31m"], {}, "model"),
                              (["--log-level", "foo"], {}, "--log-level"),
                              ([], {"AGL_REDIS_MAX_CONNECTIONS": "1"}, "redis_max_connections")):
        out = subprocess.run([sys.executable, "-m", "agl_gateway", "serve", "--upstream", "http://127.0.0.1:1",
                              "--port", "0", *args], capture_output=True, text=True, timeout=60,
                             env={**env, **extra})
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and said in out.stderr \
            and "\x1b" not in out.stderr, (args, out.stderr[-1500:])


def test_a_runs_summary_is_shown_as_its_config_is(tmp_path):
    """(Noted by the twentieth prober.) The dashboard showed a run's ``summary.json`` without the redaction its
    ``config.json`` gets: a copied or hand-edited summary's password was shown in clear."""
    from agl_trainer.ui.runs import load_run

    (tmp_path / "summary.json").write_text(json.dumps({"heldout_after": 0.5, "api_key": "sk-live-123",
                                                       "redis": "redis://:hunter2pw@h:6379/0"}))
    summary = load_run(tmp_path).summary
    assert summary["heldout_after"] == 0.5 and summary["api_key"] == "***" and "hunter2pw" not in summary["redis"]


async def test_an_engines_echo_of_its_key_is_masked_in_the_calls_spans_too(store, redis_url, prefix, otlp,
                                                                           monkeypatch):
    """(Found while fixing the twenty-second prober's records.) With ``--otel`` and message content captured, a span
    carried the call's answer as the engine wrote it: the engine key an engine (or a proxy) echoed there reached the
    trace collector, though the agent and the record had it masked. A span is made of the record as written."""
    from agl_common.schemas import Rollout, RolloutStatus
    from agl_gateway import GatewaySettings, create_app
    from fakes import Served, fake_upstream

    key = "EngineKey_0123456789abcdef"
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    await store.create_rollout(Rollout(rollout_id="r1", attempt_id="0", status=RolloutStatus.running), enqueue=False)
    with Served(fake_upstream(reply=f"auth=Bearer {key}")) as up:
        settings = GatewaySettings(upstream=up.url, redis_url=redis_url, prefix=prefix, model="m", heartbeat_s=0.2,
                                   upstream_key=key, otel=True)
        with Served(create_app(settings)) as gw:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "Bearer ****" in r.text, r.text
    spans = otlp.app.state.spans
    assert len(spans) == 1 and "Bearer ****" in repr(spans) and key[:16] not in repr(spans), spans


def test_a_job_templates_escaping_filters_cannot_add_keys_to_the_pod_spec():
    """(The twenty-third prober.) Every ``{{ }}`` of a Job template is written as JSON except ``tojson``'s output,
    which was told apart as ``markupsafe.Markup``: but ``| e``, ``| safe``, ``| forceescape`` (and any string method
    on their output) return ``Markup`` too, so a rollout's input through ``| e`` — the filter an operator reaches for
    to escape — kept its newlines and added ``hostPID: true`` and a ``hostPath`` of ``/`` to the pod spec. Only this
    environment's own ``tojson`` output is kept as written."""
    from agl_common.schemas import Rollout
    from agl_controller.k8s import JobRenderer

    hostile = "hi\n          hostPID: true\n          volumes: [{name: r, hostPath: {path: /}}]"
    for flt in ("e", "safe", "forceescape", "e | lower", "tojson | lower"):
        template = ("apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n      containers:\n"
                    "        - name: harness\n          image: registry.example.com/h:1\n"
                    f"          args: [{{{{ input.q | {flt} }}}}, {{{{ input.n | tojson }}}}]\n")
        spec = JobRenderer(template, "http://gw:8080", "m").render(Rollout(rollout_id="r", input={
            "q": hostile, "n": "7"}))["spec"]["template"]["spec"]
        assert "hostPID" not in spec and "volumes" not in spec, (flt, spec)
        args = spec["containers"][0]["args"]
        assert args[1] == "7" and "hostpid" in args[0].lower() and isinstance(args[0], str), (flt, args)


async def test_the_anthropic_route_carries_tool_arguments_exactly_or_refuses_them(store, redis_url, prefix):
    """(The twenty-third prober.) On ``/v1/messages``, tool-call arguments holding ``NaN``, ``Infinity`` or ``1e400``
    reached the agent as ``null`` (LiteLLM reads them leniently, the answer wrote non-finite numbers as null) and were
    recorded ``ok``; an integer beyond 64 bits was a 502 blaming the engine (orjson cannot write it); two engine ids
    that LiteLLM's id rewriting makes one (``call<1``, ``call>1``) reached the agent as two ``tool_use`` blocks of one
    id. Now the first are refused (502, an error record), the integer is carried exactly, the ids refused."""
    import orjson
    from fakes import Served, fake_upstream
    from test_gateway import gateway, make_rollout

    def answer(*calls: tuple[str, str]) -> bytes:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "f", "arguments": args}} for cid, args in calls]}
        return orjson.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                             "prompt_token_ids": [1, 2], "usage": {"prompt_tokens": 2, "completion_tokens": 3,
                                                                   "total_tokens": 5},
                             "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls",
                                          "token_ids": [5, 6, 7], "logprobs": {"content": [
                                              {"token": "x", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                                          ] * 3}}]})

    body = {"model": "m", "max_tokens": 10, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"}]}
    app = fake_upstream()
    await make_rollout(store, "r1")
    got = {}
    with Served(app) as up, gateway(redis_url, prefix, up.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            for name, calls in (("nan", [("call_1", '{"x": NaN, "n": 2}')]), ("inf", [("call_1", '{"x": -Infinity}')]),
                                ("huge", [("call_1", '{"y": 1e400}')]),
                                ("bigint", [("call_1", '{"n": 123456789012345678901234567890}')]),
                                ("ids", [("call<1", '{"a": 1}'), ("call>1", '{"b": 2}')])):
                app.state.plan = ("body", 200, answer(*calls))
                for stream in (False, True):
                    r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages", json={**body, "stream": stream})
                    got[name, stream] = (r.status_code, r.text)
    for name in ("nan", "inf", "huge", "ids"):
        for stream in (False, True):
            assert got[name, stream][0] == 502, (name, stream, got[name, stream])
    assert json.loads(got["bigint", False][1])["content"][0]["input"] == {"n": 123456789012345678901234567890}
    assert "123456789012345678901234567890" in got["bigint", True][1]
    statuses = [(c.status, c.error) for c in await store.read_calls("r1")]
    assert [s for s, _ in statuses] == ["error"] * 6 + ["ok"] * 2 + ["error"] * 2, statuses[6:]


async def test_round_23s_gateway_fixes_as_the_twenty_fourth_prober_found_them(store, redis_url, prefix):
    """(The twenty-fourth prober, on round 23's fixes.) An engine password with an accent showed as the base64 aiohttp
    sends (latin-1; the list held the UTF-8 one); an engine URL whose user part aiohttp cannot send (a character
    beyond latin-1, a ``:`` in the user) was accepted and every call a 500 with a traceback; ``user:password`` was
    never masked (``:`` was not a maskable character); a stored policy this version cannot read stopped the control
    loop before it listened (no pause was ever applied); a call to a rollout whose record it cannot read was a 500 and
    a traceback per call."""
    import base64

    from agl_common.control import pause_and_drain, resume
    from agl_gateway.settings import GatewaySettings
    from agl_gateway.upstream import engine_credentials
    from fakes import Served, fake_upstream
    from pydantic import ValidationError
    from test_gateway import MSG, gateway, make_rollout

    got = engine_credentials(None, "http://bob:p%C3%A9ssw0rd-long@h:1")
    assert base64.b64encode("bob:péssw0rd-long".encode("latin-1")) in got
    assert b"bob:s3cret" in engine_credentials(None, "http://bob:s3cret@h:1")
    for url in ("http://u:%E5%AF%86%E7%A0%81-secret@h:1", "http://a%3Ab:pw-secret@h:1"):
        with pytest.raises(ValidationError, match="cannot be sent as Basic credentials"):
            GatewaySettings(upstream=url)

    await make_rollout(store, "r1")
    await make_rollout(store, "odd")
    await store.r.set(store.rollout_key("rollout", "odd"), '{"rollout_id": "odd", "status": "scheduled"}')
    await store.r.set(store.key("policy"), '{"model": "fake", "version": -1}')
    with Served(fake_upstream()) as up, gateway(redis_url, prefix, up.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{gw.url}/rollouts/odd/attempts/0/v1/chat/completions", json=MSG)
            assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_unreadable", r.text
            await pause_and_drain(store, timeout_s=10, pause_id="p1")
            try:
                import asyncio

                held = asyncio.create_task(c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=MSG))
                await asyncio.sleep(1.0)
                assert not held.done()  # (held by the pause)
            finally:
                await resume(store, release="p1")
            assert (await held).status_code == 200


def test_any_broken_tokenizer_file_is_one_line_and_eos_ids_are_token_ids(tmp_path):
    """(The twenty-fourth prober.) ``train`` with a truncated ``tokenizer.json`` (or a ``tokenizer_config.json`` that is
    a list, nested too deeply...) was a 137-line traceback: only round 23's own checks were one line. Whatever loading
    the tokenizer raises is one line naming the directory; an ``eos_token_id`` of 2.9, ``"2"`` or -7 was read as an id."""
    import shutil

    from agl_trainer.model import ModelFilesError, load_vocabulary

    tiny = ROOT / "packages" / "trainer" / "src" / "agl_trainer" / "assets" / "tiny-tokenizer"
    for name, text in (("tokenizer.json", (tiny / "tokenizer.json").read_text()[:100]),
                       ("tokenizer_config.json", "[1, 2]"), ("tokenizer_config.json", "[" * 100_000)):
        model = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny, model)
        (model / name).write_text(text)
        with pytest.raises(ModelFilesError, match="cannot load the tokenizer in"):
            load_vocabulary(model)
    model = tmp_path / "eos"
    shutil.copytree(tiny, model)
    for bad in (2.9, "2", -7, [2, True]):
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ModelFilesError, match="eos_token_id"):
            load_vocabulary(model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert {0, 2} <= load_vocabulary(model).eos_ids


def test_a_controller_skips_a_rollout_it_cannot_read_in_one_line(tmp_path, redis_url, prefix):
    """(The twenty-fourth prober.) A queued rollout whose record this version cannot read made the controller log
    "failed unexpectedly" and then a traceback at every reconcile, for ever, its claim kept. It is skipped in one line,
    its claim released, the record left as it is."""
    import redis as sync_redis

    from agl_common.store import Store

    assert _cli("rollouts", "create", "--input", "{}", "--id", "odd-1", "--redis", redis_url,
                "--prefix", prefix).returncode == 0
    r = sync_redis.Redis.from_url(redis_url)
    key = Store(redis_url, prefix).rollout_key("rollout", "odd-1")
    r.set(key, r.get(key).replace(b'"status":"queuing"', b'"status":"scheduled"'))
    proc = subprocess.Popen([sys.executable, "-m", "agl_controller", "run", "--command", "true", "--lease-ttl", "3",
                             "--log-dir", str(tmp_path / "logs"), "--controller-id", "c23", "--redis", redis_url,
                             "--prefix", prefix], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=12)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out and out.count("odd-1") == 1 and "cannot be read" in out, out[-3000:]
    assert b'"status":"scheduled"' in r.get(key)
    assert not [k for k in r.scan_iter(f"{prefix}*") if b"claim" in k and r.type(k) == b"list" and r.llen(k)]


async def test_round_23s_evaluation_fixes_as_the_twenty_fifth_prober_found_them(store, tmp_path, monkeypatch):
    """(The twenty-fifth prober: ``eval`` and its data.) An evaluation out of time (or interrupted) left its rollouts
    queued, and the next controller on the prefix ran them under another policy, recorded ``succeeded`` under the first
    evaluation's run; its time in all was ``4 × rollout_timeout_s`` whatever its size; an ``is_correct`` failing on an
    input but the first was a traceback after the whole evaluation; the reward histogram lost counts (a later value
    printed alike overwrote an earlier one); MLflow refused a histogram key of ``2e+06`` after the whole run; a run's
    own ``config.json`` was refused by ``--config`` for ``eval_size`` below 64; ``WANDB_MODE`` was read only when the
    tracker opened, after the evaluation."""
    from agl_common.schemas import RolloutStatus
    from agl_trainer.algorithm.evalstats import reward_distribution
    from agl_trainer.config import TrainConfig
    from agl_trainer.scheduler import eval_timeout_s, evaluate
    from agl_trainer.tasks import TaskError, load_is_correct
    from agl_trainer.trackers import MlflowTracker, check_trackers

    with pytest.raises(TimeoutError):  # (no controller runs them)
        await evaluate(store, [{"q": 1}, {"q": 2}], "ev-1", 0, 0.1, lambda t, r: True, n=2)
    rollouts = await store.get_rollouts(await store.rollout_ids())
    assert len(rollouts) == 4 and {(r.status, r.failure) for r in rollouts} == {(RolloutStatus.failed, "withdrawn")}
    assert eval_timeout_s(5, 10, 1) == 65 and eval_timeout_s(600, 2048, 32) == 600 * 67

    (tmp_path / "task.py").write_text("def is_correct(task, reward):\n    return task['answer'] == 1\n")
    check = load_is_correct(tmp_path / "task.py")
    assert check({"answer": 1}, 1.0) is True
    with pytest.raises(TaskError, match=r"is_correct\(input, 1.0\) raised KeyError"):
        check({"q": 2}, 1.0)

    for values, n in (([0.1234561, 0.1234562, 0.1234562], 3), ([1 + i * 1e-5 for i in range(11)], 11)):
        assert sum(reward_distribution(values)["hist"].values()) == n, reward_distribution(values)["hist"]

    tracker = MlflowTracker(tmp_path / "runs" / "r1", "r1")
    tracker.log_eval("after", {"reward": {"hist": {"2e+06": 1, "0": 3}}}, 0)
    tracker.close()

    shown = TrainConfig(eval_size=8).shown()
    assert TrainConfig.model_validate(shown).eval_subset == 8

    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ValueError, match="WANDB_MODE"):
        check_trackers(["wandb"])


def test_a_record_edited_in_redis_is_not_made_a_row():
    """(The twenty-fifth prober.) A call record edited in Redis (6 response ids, 2 logprobs, one of them +5.0) was
    exported as a training row (``has_logprobs: true``) and would have been trained: ``record_fault`` checked records
    where they are written only. The row builder reads each record under the same rule."""
    from agl_common.schemas import CallRecord
    from agl_trainer.algorithm.aggregate import AggregateStats, build_rows

    def record(lps):
        return CallRecord(rollout_id="r", attempt_id="0", seq=0, route="chat", request={}, response=None, status="ok",
                          prompt_token_ids=[1, 2], response_token_ids=[3, 4, 5, 6, 7, 8], response_logprobs=lps)

    stats = AggregateStats()
    assert build_rows([record([5.0, -0.2])], stats=stats) == [] and stats.skipped_calls["record_fault"] == 1
    assert len(build_rows([record([-0.1] * 6)])) == 1


def test_the_chunk_relayed_to_the_agent_is_the_one_the_engine_sent():
    """(Found by the suite on round 23's own fix.) Taking a delta's strings out for the record took them out of the
    chunk relayed to the agent: a ``function_call``'s name and arguments reached the agent empty."""
    import copy

    from agl_gateway.capture import StreamCapture

    cap = StreamCapture({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "m")
    cap.cap.prompt_token_ids = [1, 2]
    sent = _chunk({"role": "assistant", "content": "", "reasoning_content": "why",
                   "function_call": {"name": "lookup", "arguments": "{}"}, "audio": {"type": "x", "id": "a"}}, [5])
    relayed, _ = cap.feed(copy.deepcopy(sent))
    assert relayed["choices"][0]["delta"] == sent["choices"][0]["delta"], relayed


async def test_round_23s_fixes_as_the_twenty_sixth_and_seventh_probers_found_them(store, tmp_path):
    """(The twenty-sixth prober, on the fixes above; the twenty-seventh, on resuming.) A stream field sent as a string
    then as something else was recorded by type, not as the agent's SDK read it (now an error record), and a ``null``
    then a string kept the ``null``; a legacy ``function_call`` or ``audio`` answer on ``/v1/messages`` reached the
    agent as an empty message, recorded ``ok`` (now a ``tool_use`` block, and a 502); masking a credential right after a backslash (``\\\\n`` + ``ightowl``)
    made the answer and its record invalid JSON; one unreadable pause entry (``soon``, ``inf``, a key not UTF-8) broke
    the gateway's control loop and ``gateway resume --pause``; a trainer lease not UTF-8 was a traceback; an ``async
    def is_correct`` counted every answer right; an interrupted evaluation's running rollouts were handed back to the
    queue after it withdrew the queued ones; a checkpoint without its weights (or a FIFO for them) failed once every
    service was up; a ``state.json`` version of 2**63 passed; a checkpoint of another backend passed."""
    from agl_gateway.capture import StreamCapture, unreadable
    from agl_gateway.translate import chat_to_anthropic
    from agl_gateway.upstream import mask_key
    from agl_trainer.checkpoint import NotResumable, load_checkpoint
    from agl_trainer.config import TrainConfig
    from agl_trainer.evaluation import _withdraw_run
    from agl_trainer.run import check_cpu_checkpoint, check_resumable
    from agl_trainer.scheduler import create_rollouts
    from agl_trainer.tasks import TaskError, load_is_correct

    for first, second, ok in (({"x": {"y": None}}, {"x": {"y": "a"}}, True), ({"x": "a"}, {"x": 5}, False),
                              ({"x": "a"}, {"x": {"y": "b"}}, False)):
        cap = StreamCapture({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "m")
        cap.cap.prompt_token_ids = [1, 2]
        cap.feed(_chunk({"role": "assistant", "content": "a", **first}, [5]))
        cap.feed(_chunk(second, [6], "stop"))
        got, answer = cap.result()
        assert (unreadable(got) is None) == ok, (first, second, unreadable(got))
        if ok:
            assert answer["choices"][0]["message"]["x"] == {"y": "a"}

    def answer_with(**field):
        return {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": None, **field}, "finish_reason": "function_call"}]}

    out = chat_to_anthropic(answer_with(function_call={"name": "f", "arguments": '{"a": 1}'}), {"model": "m"})
    assert [(b["type"], b["name"], b["input"]) for b in out["content"]] == [("tool_use", "f", {"a": 1})], out
    assert out["stop_reason"] == "tool_use"
    with pytest.raises(ValueError, match="Anthropic route carries"):
        chat_to_anthropic(answer_with(audio={"id": "a", "data": "xx"}), {"model": "m"})

    body = b'{"a":"Owls:\\nightowl-2024 x nightowl-2024"}'
    assert json.loads(mask_key(body, b"nightowl-2024")) == {"a": "Owls:\nightowl-2024 x *************"}

    await store.r.hset(store.key("pauses"), mapping={"handmade": "soon", "forever": "inf", b"\xff\xfe": "9e9",
                                                     "good": "9e9"})
    assert await store.pauses() == {"good": 9e9}
    await store.r.set(store.key("trainer"), b"\xff\xfe someone\x1b[2J", px=60_000)
    run, _ = await store.trainer_of()
    assert "\x1b" not in run

    (tmp_path / "task.py").write_text("async def is_correct(task, reward):\n    return False\n")
    with pytest.raises(TaskError, match="not a truth value"):
        load_is_correct(tmp_path / "task.py")({}, 1.0)

    ids = await create_rollouts(store, [{"q": 1}], 2, "ev-2", 0, run="eval-r1")
    await _withdraw_run(store.redis_url, store.prefix, "eval-r1")
    assert {(r.status.value, r.failure) for r in await store.get_rollouts(ids)} == {("failed", "withdrawn")}

    run_dir = tmp_path / "run"
    (run_dir / "checkpoint").mkdir(parents=True)
    state = {"step": 1, "version": 2**63, "metrics": {"groups": []}, "active": []}
    (run_dir / "checkpoint" / "state.json").write_text(json.dumps(state))
    with pytest.raises(NotResumable, match="version"):
        load_checkpoint(run_dir)
    with pytest.raises(NotResumable, match="adapter_model.safetensors: No such file"):
        check_cpu_checkpoint(TrainConfig(), run_dir)
    (run_dir / "checkpoint" / "adapter_model.safetensors").write_bytes(b"x")
    os.mkfifo(run_dir / "checkpoint" / "optimizer.pt")
    with pytest.raises(NotResumable, match="optimizer.pt: not a regular file"):
        check_cpu_checkpoint(TrainConfig(), run_dir)
    (run_dir / "config.json").write_text(json.dumps({**TrainConfig().shown(), "backend": "verl"}))
    with pytest.raises(NotResumable, match="verl"):
        check_resumable(TrainConfig(), run_dir)


def test_one_run_directory_is_trained_by_one_process(tmp_path):
    """(The twenty-seventh prober.) Two trainers resumed one run directory under two prefixes (the lease is the
    prefix's) and both wrote its checkpoint, metrics and adapters. A run directory is locked while a trainer holds it."""
    from agl_trainer.checkpoint import NotResumable
    from agl_trainer.run import hold_run_dir

    first = hold_run_dir(tmp_path)
    with pytest.raises(NotResumable, match="another process"):
        hold_run_dir(tmp_path)
    first.close()
    hold_run_dir(tmp_path).close()
