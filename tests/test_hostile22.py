"""Round 22 of hostile input (docs/operations.md, "A twenty-second round"): each test failed before its fix."""
from __future__ import annotations

import ast
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fakes import Served, fake_upstream
from test_gateway import upstream  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
TASKS = "def heldout_problems():\n    return [{'question': '3 + 4?', 'answer': 7}, {'question': '1 + 1?', 'answer': 2}]\n"


def _eval_config(tmp_path: Path, redis_url: str, prefix: str, **fields) -> Path:
    """An evaluation config of two held-out inputs (tests/harnesses/eval_agent.py answers them) with ``fields``."""
    (tmp_path / "tasks.py").write_text(TASKS)
    cfg = {"command": f"python {ROOT / 'tests' / 'harnesses' / 'eval_agent.py'}", "task_file": str(tmp_path / "tasks.py"),
           "eval_size": 2, "redis_url": redis_url, "prefix": prefix, "out_dir": str(tmp_path / "runs"),
           "rollout_timeout_s": 60, **fields}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "eval.yaml"


def _chunk(delta: dict, ids: list[int], finish: str | None = None) -> dict:
    """A vLLM-shaped chat stream chunk of one choice: ``delta``, its token ``ids`` with a logprob each, ``finish``."""
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": delta, "token_ids": ids, "finish_reason": finish, "logprobs": {"content": [
            {"token": "x", "logprob": -0.1, "bytes": None, "top_logprobs": []} for _ in ids]}}]}


def _default_signals() -> None:
    """``preexec_fn`` of a child whose signals a test sends: SIGINT, SIGTERM and SIGHUP at their defaults, whatever
    this test process inherited (a CI started under ``nohup`` or in a background job ignores SIGHUP or SIGINT, and a
    child keeps an ignored disposition: the command would rightly ignore them too)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _stored_call(redis_url: str, prefix: str, rollout_id: str) -> None:
    """Store rollout ``rollout_id`` (not queued) with one recorded call: something for ``rollouts export``."""
    import asyncio

    from agl_common.schemas import CallRecord, Rollout
    from agl_common.store import Store

    async def main():
        store = Store(redis_url, prefix)
        try:
            await store.create_rollout(Rollout(rollout_id=rollout_id, input={}), enqueue=False)
            await store.record_call(CallRecord(rollout_id=rollout_id, attempt_id="0", seq=0, route="chat", request={},
                                               response={}))
        finally:
            await store.close()

    asyncio.run(main())


def test_redis_url_values_redis_py_takes_as_given_are_refused_in_one_line():
    """(The twelfth prober.) ``rediss://...?ssl_cert_reqs=foo`` was a ``RedisError`` traceback in every CLI and the
    gateway (the URL check caught ``TypeError``/``ValueError`` only); ``?socket_timeout=inf`` (or ``nan``, ``0``)
    passed and turned the timeout off: a silent socket hung every command. Now each is a bad Redis URL."""
    from agl_common.store import check_redis_url

    for url in ("rediss://u:pw@h/0?ssl_cert_reqs=foo", "redis://h/0?socket_timeout=inf", "redis://h/0?socket_timeout=nan",
                "redis://h/0?socket_timeout=0", "redis://h/0?socket_connect_timeout=-1", "redis://h/0?timeout=inf",
                "redis://h/0?max_connections=0", "redis://h/0?socket_read_size=0", "redis://h/0?health_check_interval=-5",
                "redis://h/0?socket_timeout=1e300", "redis://h/0?timeout=1e9",
                "redis://h/0?protocol=9"):
        with pytest.raises(ValueError, match="bad Redis URL") as got:
            check_redis_url(url)
        assert "pw" not in str(got.value), got.value
    for url in ("redis://h/0?socket_timeout=2.5", "redis://h/0?health_check_interval=0", "redis://h/0?max_connections=3"):
        assert check_redis_url(url) == url
    bad = "rediss://127.0.0.1:6379/0?ssl_cert_reqs=foo"
    for argv in (["agl_trainer", "rollouts", "list"], ["agl_controller", "run", "--mode", "local", "--command", "true"],
                 ["agl_gateway", "serve", "--upstream", "http://127.0.0.1:9/v1", "--open", "--port", "0"]):
        got = subprocess.run([sys.executable, "-m", *argv, "--redis", bad], capture_output=True, text=True, timeout=120)
        assert got.returncode == 2 and "Traceback" not in got.stderr and "ssl_cert_reqs" in got.stderr, \
            (argv, got.returncode, got.stderr[-2000:])


def test_every_console_of_the_trainer_prints_user_text_as_it_is():
    """(The twelfth prober.) Paths and prefixes were printed as Rich markup: an ``out_dir`` holding ``[/]`` was a
    ``MarkupError`` traceback after a whole evaluation, at the start of ``train`` and of ``ui``. Every console the
    trainer prints on is :func:`agl_trainer.report.output_console` (markup off, control characters escaped), every
    progress bar :func:`agl_trainer.report.progress_bars`, and nothing imports Rich's ``escape``: checked here in the
    source, so that a new ``Console()`` cannot bring it back."""
    from agl_trainer.report import output_console

    made = []
    for path in (ROOT / "packages" / "trainer" / "src" / "agl_trainer").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name = getattr(node, "func", None) and getattr(node.func, "id", getattr(node.func, "attr", None))
            if isinstance(node, ast.Call) and name in ("Console", "Progress", "TextColumn") and \
                    path.name != "report.py":
                made.append(f"{path.name}:{node.lineno} {name}")
            if isinstance(node, ast.ImportFrom) and node.module == "rich.markup":
                made.append(f"{path.name}:{node.lineno} rich.markup")
    assert not made, made
    console = output_console()
    with console.capture() as cap:
        console.print("outputs in runs/[/]x and [red]y[/red] \x1b[31mred\x1b]8;;http://x\x07")
    assert cap.get().strip() == "outputs in runs/[/]x and [red]y[/red] \\x1b[31mred\\x1b]8;;http://x\\x07"


@pytest.mark.timeout(300)
def test_an_evaluation_whose_out_dir_reads_as_markup_reports_its_result(tmp_path, redis_url, prefix):
    """The end-to-end case the prober ran: ``out_dir`` ``runs/[/]`` — the evaluation ran, then its last line
    (``JSON: .../eval.json``) was a ``MarkupError`` traceback and exit 1. Now exit 0 and the path as it is."""
    from agl_trainer.cli import app
    from typer.testing import CliRunner

    with Served(fake_upstream(model="smollm2")) as engine:
        config = _eval_config(tmp_path, redis_url, prefix, engine_url=engine.url, out_dir=str(tmp_path / "r[/]uns"))
        res = CliRunner().invoke(app, ["eval", str(config)])
    assert res.exit_code == 0, res.output
    assert f"JSON: {tmp_path / 'r[/]uns'}/eval-" in res.stdout, res.stdout
    assert list((tmp_path / "r[/]uns").glob("eval-*/eval.json"))


def test_an_evaluation_on_an_engine_serving_another_model_stops_at_start(tmp_path, redis_url, prefix, monkeypatch):
    """(The twelfth prober.) An engine that answers ``/v1/models`` but serves another model than ``model_name``
    (every call a 404) passed the engine check: an evaluation reported accuracy 0.000 and exit 0. The check now
    looks for ``model_name`` among every model the engine lists (its base model and adapters): one line, exit 1."""
    import asyncio

    from agl_trainer import cycle
    from agl_trainer.cli import app
    from fastapi import FastAPI
    from typer.testing import CliRunner

    with Served(fake_upstream(model="qwen-other")) as engine:
        config = _eval_config(tmp_path, redis_url, prefix, engine_url=engine.url)
        res = CliRunner().invoke(app, ["eval", str(config), "--json"])
    assert res.exit_code == 1 and "does not serve 'smollm2'" in res.output and "qwen-other" in res.output, res.output
    assert "--served-model-name smollm2" in res.output, res.output  # (demo has no model_name to set: serve it so)
    assert not list((tmp_path / "runs").glob("eval-*/eval.json")) and "accuracy" not in res.output

    web = FastAPI()  # the name second in the list (vLLM lists its base model, then each adapter) is served
    web.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "policy-v3"}, {"id": 5}, {"id": "smollm2"}]})
    with Served(web) as server:
        asyncio.run(cycle.check_reachable(server.url, "smollm2"))
        with pytest.raises(cycle.EngineError, match="lists 'policy-v3', 'smollm2'"):
            asyncio.run(cycle.check_reachable(server.url, "smollm3"))


@pytest.mark.parametrize("key", ["sk-0123456789abcdef ", "sk-0123456789abc\ndef", "sk-0123456789abcdéf", "short"])
def test_a_malformed_engine_key_is_named_not_read_as_an_engine_out_of_reach(key, tmp_path, redis_url, prefix,
                                                                            monkeypatch):
    """(The twelfth prober.) ``AGL_UPSTREAM_KEY`` with a trailing space, a newline or a non-ASCII letter was sent as
    is: the engine check said "cannot be reached: LocalProtocolError" or raised an ascii codec error. The key is
    checked where it is read, by the gateway's rule (:func:`agl_common.settings.check_engine_key`), and named
    (never shown); the gateway refuses the same keys."""
    from agl_common.settings import engine_headers
    from agl_gateway.settings import GatewaySettings
    from agl_trainer.cli import app
    from pydantic import ValidationError
    from typer.testing import CliRunner

    monkeypatch.setenv("AGL_UPSTREAM_KEY", key)
    with pytest.raises(ValueError, match="AGL_UPSTREAM_KEY"):
        engine_headers()
    with pytest.raises(ValidationError):
        GatewaySettings(upstream="http://127.0.0.1:1", upstream_key=key)
    with Served(fake_upstream(model="smollm2")) as engine:
        res = CliRunner().invoke(app, ["eval", str(_eval_config(tmp_path, redis_url, prefix, engine_url=engine.url)),
                                       "--json"])
    assert res.exit_code == 1 and "AGL_UPSTREAM_KEY" in res.output and "reached" not in res.output, res.output
    assert key.strip() not in res.output and res.exception.__class__ is SystemExit, (res.output, res.exception)
    monkeypatch.setenv("AGL_UPSTREAM_KEY", "sk-0123456789abcdef")  # a well-formed one is sent
    assert engine_headers() == {"Authorization": "Bearer sk-0123456789abcdef"}


def test_a_password_in_any_url_of_a_command_line_is_hidden_from_proc():
    """(The fourteenth prober.) ``--redis redis://h/0?password=pw`` (a password the Store takes as a query option)
    and ``--upstream http://u:pw@engine`` stayed readable in ``/proc/<pid>/cmdline`` of the gateway and the controller
    (any user reads it: a harness took the Redis password from its controller's): only ``--key`` and a Redis URL's
    user-part password were masked. Now every value that holds a URL with a secret (what ``redacted_url`` hides) is
    masked, whatever its option; a URL without one stays readable."""
    from agl_common.proc_secrets import argv_secrets
    from test_hostile15 import SPY

    argv = ["--redis", "redis://127.0.0.1:1/0?password=pw1-s3cret", "--upstream", "http://u:pw2-s3cret@127.0.0.1:2,"
            "http://e:3/v1", "--redis=redis://h/0?pass%77ord=pw3-s3cret", "--command", "x --base http://t:pw4-s3cret@h",
            "--gateway", "http://plain:1", "--key", "k5-s3cret"]
    out = subprocess.run([sys.executable, "-c", SPY, *argv], env={**__import__("os").environ, "AGL_KEY": "x"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert "s3cret" not in seen["spied"] and "http://plain:1" in seen["spied"], seen["spied"][-400:]
    assert seen["own"][1] == argv  # (the process's own argv is the parser's: unchanged)
    assert argv_secrets(["--gateway", "http://plain:1", "--redis", "redis://h:1/0?db=1", "--command", "python a.py"]) == []


async def test_a_message_field_after_a_streams_finish_is_an_error_record(store, redis_url, prefix, upstream):  # noqa: F811
    """(The fourteenth prober.) After a stream's finish reason, a chunk carrying a ``function_call`` (or any message
    field other than the content, tool calls and reasoning round 9 checked) was relayed to the agent and recorded
    ``ok``, the field in the record's message with no token ids behind it. Any non-empty delta field after the finish
    is now an error record, as tokens there are; an empty delta (an engine's closing chunk) still passes."""
    import httpx
    import orjson
    from fakes import chat_chunks
    from test_gateway import gateway, make_rollout
    from test_hostile6 import _last, _one

    await make_rollout(store, "r1")
    chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
    late = orjson.loads(chunks[-2][len(b"data: "):])  # the last token chunk (finish_reason "stop")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for delta, bad in (({"function_call": {"name": "rm_rf", "arguments": "{}"}}, True),
                               ({"annotations": [{"x": 1}]}, True), ({"refusal": "no"}, True),
                               ({}, False), ({"content": "", "role": "assistant"}, False)):
                after = {**late, "choices": [{**late["choices"][0], "delta": delta, "token_ids": [],
                                              "finish_reason": None, "logprobs": None}]}
                upstream.app.state.plan = ("stream", [*chunks[:-1], b"data: " + orjson.dumps(after) + b"\n\n",
                                                      chunks[-1]], "done")
                await _one(c, gw, {"stream": True})
                rec = await _last(store)
                assert (rec.status == "error" and "after the stream's finish reason" in rec.error) == bad, \
                    (delta, rec.status, rec.error)
                assert bad or rec.status == "ok", (delta, rec.error)
    upstream.app.state.plan = None


@pytest.mark.timeout(300)
def test_a_model_name_and_paths_holding_markup_are_printed_as_they_are(tmp_path, redis_url, prefix):
    """(The thirteenth prober.) Round 22's consoles still left two: the evaluation's progress bar read its
    description (``held-out eval (MODEL)``) as markup whatever its console's setting — a ``model_name`` ``a[/]b`` was
    a traceback before any call; ``rollouts export --out 'o[/]d/x.jsonl'`` wrote the file, then its stderr line was a
    traceback. Every console and progress bar now prints text as it is (``report.output_console``,
    ``report.progress_bars``), the stderr console too."""
    from agl_trainer.cli import app
    from typer.testing import CliRunner

    with Served(fake_upstream(model="a[/]b")) as engine:
        config = _eval_config(tmp_path, redis_url, prefix, engine_url=engine.url, model_name="a[/]b")
        got = subprocess.run([sys.executable, "-m", "agl_trainer", "eval", str(config)], capture_output=True,
                             text=True, timeout=240)
    assert got.returncode == 0 and "Traceback" not in got.stderr, got.stderr[-3000:]

    _stored_call(redis_url, prefix, "m1")
    (tmp_path / "o[/]d").mkdir(parents=True)
    res = CliRunner().invoke(app, ["rollouts", "export", "--redis", redis_url, "--prefix", prefix, "--out",
                                   str(tmp_path / "o[/]d" / "x.jsonl")])
    assert res.exit_code == 0 and f"written to {tmp_path / 'o[/]d' / 'x.jsonl'}" in res.output, res.output


def test_an_export_that_fails_or_is_cut_leaves_the_file_it_would_replace(tmp_path, redis_url, prefix):
    """(The thirteenth prober.) ``rollouts export --out FILE`` truncated FILE first: a write cut by a full disk
    (``ulimit -f``) or SIGTERM left a part of the export where the old file was. The export is written beside it
    and renamed over it whole; on failure the old file stays and no part is left."""
    import asyncio
    import resource

    from agl_common.schemas import CallRecord, Rollout
    from agl_common.store import Store

    async def calls():
        store = Store(redis_url, prefix)
        try:
            await store.create_rollout(Rollout(rollout_id="big", input={}), enqueue=False)
            for seq in range(8):
                await store.record_call(CallRecord(rollout_id="big", attempt_id="0", seq=seq, route="chat",
                                                   request={"x": "y" * 300_000}, response={}))
        finally:
            await store.close()

    asyncio.run(calls())
    keep = tmp_path / "keep.jsonl"
    keep.write_text("OLD PRECIOUS DATA\n")
    keep.chmod(0o640)
    argv = [sys.executable, "-m", "agl_trainer", "rollouts", "export", "--redis", redis_url, "--prefix", prefix,
            "--out", str(keep)]
    small = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # noqa: E731 - 1 MiB per file
    got = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=small)
    assert got.returncode == 1 and "cannot write" in got.stderr, (got.returncode, got.stderr[-2000:])
    assert keep.read_text() == "OLD PRECIOUS DATA\n" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]
    got = subprocess.run(argv, capture_output=True, text=True, timeout=120)  # and without the limit: replaced whole
    assert got.returncode == 0, got.stderr[-2000:]
    assert len(keep.read_text().splitlines()) == 8 and keep.stat().st_mode & 0o777 == 0o640


async def test_an_engines_answer_to_a_swap_is_bounded_and_shown_without_secrets(monkeypatch):
    """(The thirteenth prober.) The policy swaps (adapter load and unload, weight reload) read an engine's answer
    with none of the engine check's guards: its text (ESC and OSC-8 sequences, the engine key it echoed) and the
    engine URL's password were printed as they were, a gzip body was decoded whole (1.9 GB), a body dripped a byte
    at a time held ``eval`` for ever. Every request the trainer makes to an engine now goes through one bounded
    request (``cycle._engine_request``: time in all, bytes as sent), and what a message shows of an answer is
    printable, with the key masked."""
    import asyncio
    import gzip

    from agl_trainer import cycle
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    key = "sk-TopSecretEngineKey12345"
    monkeypatch.setenv("AGL_UPSTREAM_KEY", key)

    async def load(request):
        where = request.path_params["where"]
        if where == "echo":
            return PlainTextResponse("\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\ \x1b[31mRED "
                                     + request.headers["authorization"], status_code=500)
        if where == "bomb":
            return Response(gzip.compress(b"\0" * (64 << 20)), status_code=500, headers={"Content-Encoding": "gzip"})

        async def drip():
            while True:
                yield b" "
                await asyncio.sleep(0.5)
        return StreamingResponse(drip())

    with Served(Starlette(routes=[Route("/{where}/v1/load_lora_adapter", load, methods=["POST"])])) as server:
        base = server.url.replace("http://", "http://user:s3cretpw@")
        with pytest.raises(cycle.EngineError) as got:
            await cycle.load_adapter(f"{base}/echo", "a1", Path("/nowhere"))
        said = str(got.value)
        assert "\x1b" not in said and key[:16] not in said and "s3cretpw" not in said and "RED" in said, said
        assert "dXNlcjpz" not in said, said  # (httpx sends the URL's user:password as Basic: echoed, in base64)
        with pytest.raises(cycle.EngineError) as got:
            await cycle.load_adapter(f"{server.url}/bomb", "a1", Path("/nowhere"))
        assert len(str(got.value)) < 600, str(got.value)[:600]
        with pytest.raises(cycle.EngineError, match="did not answer POST"):
            async with __import__("httpx").AsyncClient() as http:
                await cycle._engine_request(http, "POST", f"{server.url}/drip", "/v1/load_lora_adapter", json={},
                                            timeout_s=2)


def _fake_redis(reply: bytes):
    """A TCP server on a free loopback port that answers every command with ``reply`` (a RESP error line), CLIENT
    SETINFO with an error redis-py ignores, PING and HELLO as a server would; returns ``(port, stop)``."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    done = threading.Event()

    def serve(conn):
        buf = b""
        with conn:
            while not done.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                while buf.startswith(b"*") and b"\r\n" in buf:  # one command: *N, then N bulk strings
                    lines = buf.split(b"\r\n")
                    n = int(lines[0][1:])
                    if len(lines) < 1 + 2 * n + 1:
                        break
                    words = lines[2:2 + 2 * n:2]
                    buf = b"\r\n".join(lines[1 + 2 * n:])
                    verb = words[0].upper()
                    conn.sendall({b"CLIENT": b"-ERR unknown\r\n", b"PING": b"+PONG\r\n",
                                  b"HELLO": b"%1\r\n+proto\r\n:3\r\n"}.get(verb, reply))

    def accept():
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
        srv.close()

    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1], done.set


def test_a_redis_that_refuses_a_command_is_one_printable_line():
    """(The thirteenth prober.) A Redis that refuses a command (out of memory, a user without the permission, a
    read-only replica) was a ``ResponseError`` traceback in every CLI, and a server's error text reached the terminal
    with its escape sequences. Now one line, exit 1, its control characters escaped, in the trainer's and the
    controller's CLIs."""
    evil = b"-NOPERM \x1b[31mEVIL\x1b]8;;http://evil.example\x07click\x1b]8;;\x07 [/] [bold]x\r\n"
    port, stop = _fake_redis(evil)
    try:
        for argv in (["agl_trainer", "rollouts", "list"], ["agl_trainer", "gateway", "status"],
                     ["agl_trainer", "rollouts", "create", "--input", "{}"],
                     ["agl_controller", "run", "--mode", "local", "--command", "true"]):
            got = subprocess.run([sys.executable, "-m", *argv, "--redis", f"redis://127.0.0.1:{port}/0"],
                                 capture_output=True, text=True, timeout=60)
            assert got.returncode == 1 and "Traceback" not in got.stderr and "\x1b" not in got.stderr, \
                (argv, got.returncode, got.stderr[-2000:])
            assert "Redis refused a command" in got.stderr and "[/]" in got.stderr, got.stderr
            assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    finally:
        stop()


def test_a_missing_redis_server_is_named_without_the_password(monkeypatch, tmp_path):
    """(The thirteenth prober.) With no Redis answering and no ``redis-server`` installed, the run's error printed
    the Redis URL with its password."""
    import shutil

    from agl_trainer.services import ServiceError, Services

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with Services(tmp_path / "logs") as svc, pytest.raises(ServiceError) as got:
        svc.ensure_redis("redis://:topsecretpw@127.0.0.1:1/0")
    assert "topsecretpw" not in str(got.value) and "redis-server is not installed" in str(got.value), got.value


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_rollouts_create_interrupted_stops_between_two_rollouts_and_says_which(sig, redis_url, prefix):
    """(The thirteenth prober.) ``rollouts create --n 100000`` stopped by SIGTERM could cut a rollout between its
    record and its queue entry (stored ``queuing``, in no queue and no index: never run, never listed, its id
    taken), and printed none of the ids it had created. It now stops between two rollouts, prints each one created
    and says how many, exit 130. (The seventeenth prober: SIGHUP, a terminal closing, ended it with no id printed.)"""
    import signal
    import time

    import redis as sync_redis

    proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "rollouts", "create", "--redis", redis_url,
                             "--prefix", prefix, "--input", "{}", "--n", "100000", "--id", "k"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    r = sync_redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while not list(r.scan_iter(f"{prefix}rollout:*", count=1000)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(getattr(signal, sig))
    out, errs = proc.communicate(timeout=60)
    records = sum(1 for _ in r.scan_iter(f"{prefix}rollout:*", count=1000))
    ids = out.split()
    assert proc.returncode == 130 and f"interrupted: {len(ids)} of 100000" in errs, (proc.returncode, errs[-2000:])
    assert 0 < len(ids) == records < 100000, (len(ids), records)
    index = [k for k in r.scan_iter(f"{prefix}*rollouts", count=1000)]
    queue = [k for k in r.scan_iter(f"{prefix}*queue", count=1000)]
    assert len(index) == len(queue) == 1 and r.zcard(index[0]) == r.llen(queue[0]) == records


def test_the_dashboard_on_a_port_in_use_says_so_before_announcing_anything(tmp_path):
    """(The thirteenth prober.) ``ui --port P`` with P in use announced ``AGL dashboard: http://...:P/``, then
    printed uvicorn's error and exited 3. The port is bound first: one line, exit 1, nothing announced."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with taken:
        got = subprocess.run([sys.executable, "-m", "agl_trainer", "ui", "--port", str(taken.getsockname()[1]),
                              "--tokenizer", "none", "--runs-dir", str(tmp_path)], capture_output=True, text=True,
                             timeout=60)
    assert got.returncode == 1 and "cannot listen on 127.0.0.1 port" in got.stderr, (got.returncode, got.stderr)
    assert "AGL dashboard" not in got.stdout and "Traceback" not in got.stderr, (got.stdout, got.stderr)


def test_an_export_to_a_pipe_or_a_hard_link_is_written_in_place(tmp_path, redis_url, prefix):
    """(The fifteenth prober.) The whole-file export broke what writing in place did: ``--out /dev/stdout`` into a
    pipe failed ("No such file or directory": the link resolved to ``pipe:[N]``), and a file with another hard link
    was split from it. Neither is a regular file to replace: written in place, as before."""
    _stored_call(redis_url, prefix, "p1")
    argv = [sys.executable, "-m", "agl_trainer", "rollouts", "export", "--redis", redis_url, "--prefix", prefix]
    got = subprocess.run([*argv, "--out", "/dev/stdout"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and json.loads(got.stdout)["rollout_id"] == "p1", (got.stdout, got.stderr)
    (tmp_path / "a.jsonl").write_text("old\n")
    (tmp_path / "b.jsonl").hardlink_to(tmp_path / "a.jsonl")
    got = subprocess.run([*argv, "--out", str(tmp_path / "a.jsonl")], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text() != "old\n"


def test_what_an_engine_echoes_of_the_credentials_it_was_sent_is_masked(monkeypatch):
    """(The fifteenth prober.) Round 22's excerpt of a swap's answer masked the key as is and a token after
    ``Basic``/``Bearer`` and one space: the key JSON-escaped (``\\/``), the URL's ``user:password`` base64 alone, after
    a tab or ``%20``, and the password itself still showed. Every credential sent is masked in each form; letters of
    any script are kept, control characters escaped."""
    import base64

    from agl_trainer.cycle import _answer_excerpt

    key = "sk_live/ABCDEFGHijklmnop+QRSTUV=="
    monkeypatch.setenv("AGL_UPSTREAM_KEY", key)
    url = "http://alice:S3cretPw@127.0.0.1:6397"
    b64 = base64.b64encode(b"alice:S3cretPw").decode()
    for echoed in (json.dumps({"e": f"denied for Bearer {key}"}).replace("/", "\\/"), f"invalid key {b64}",
                   f"Authorization:\tBearer\t{b64}", f"authorization=Basic%20{b64}", "bad credentials alice:S3cretPw",
                   "x sk_live%2FABCDEFGHijklmnop%2BQRSTUV%3D%3D y", key[:20]):
        shown = _answer_excerpt(echoed.encode(), url)
        assert "S3cretPw" not in shown and b64[:12] not in shown and "ABCDEFGH" not in shown, (echoed, shown)
    assert _answer_excerpt("データ\u3000エラー \x1b[31m".encode(), url) == "データ\u3000エラー \\x1b[31m"


def test_a_second_signal_ends_a_create_that_waits_on_a_silent_redis():
    """(The fifteenth prober.) With round 22's loop that stops between two rollouts, Ctrl-C (or SIGTERM) was only
    noted while a create waited on a Redis that does not answer: the command went on for the socket timeout (up to
    an hour). A second signal now cuts it short: exit 130 at once, saying the last rollout may be stored in part."""
    import signal
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(50)
    with silent:
        proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "rollouts", "create", "--input", "{}", "--n", "3",
                                 "--redis", f"redis://127.0.0.1:{silent.getsockname()[1]}/0?socket_timeout=120"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
        time.sleep(4)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, errs = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 30, (proc.returncode, errs[-2000:])
    assert "interrupted: 0 of 3" in errs and "Traceback" not in errs and out == "", (out, errs)


def test_round_22s_fixes_as_the_sixteenth_prober_found_them(monkeypatch, tmp_path, redis_url, prefix):
    """(The sixteenth prober, on round 22's fixes.) An empty ``AGL_UPSTREAM_KEY`` passed the trainer's engine check
    (no key) and stopped the gateway it started (a key of 0 characters): "" is no key in both now. A swap's excerpt
    showed a cut of the key other than its first 16 characters, and a URL's user part alone (a token) with its
    base64. ``?max_connections=1`` passed the URL check and left a gateway none for its calls (its control channel
    holds one). A ``--redis`` port that is no Redis read as "Redis refused a command"."""
    import base64

    from agl_common.settings import engine_headers
    from agl_common.store import check_redis_url
    from agl_gateway.settings import GatewaySettings
    from agl_trainer.cycle import _answer_excerpt

    monkeypatch.setenv("AGL_UPSTREAM_KEY", "")
    assert engine_headers() == {} and GatewaySettings(upstream="http://127.0.0.1:1").upstream_key is None
    key = "sk-ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcd"
    monkeypatch.setenv("AGL_UPSTREAM_KEY", key)
    shown = _answer_excerpt(f"invalid api key ...{key[3:]}; last 20: {key[-20:]}".encode(), "http://127.0.0.1:1")
    assert "GHIJKLMNOP" not in shown and "0123456789" not in shown, shown
    monkeypatch.delenv("AGL_UPSTREAM_KEY")
    token = "TOKENabcdefghij0123456789"
    shown = _answer_excerpt(f"unknown user {token!r}; got {base64.b64encode(f'{token}:'.encode()).decode()}".encode(),
                            f"http://{token}@127.0.0.1:1")
    assert "TOKENabc" not in shown and "VE9LRU5h" not in shown, shown
    with pytest.raises(ValueError, match="max_connections"):
        check_redis_url("redis://h/0?max_connections=1")
    assert check_redis_url("redis://h/0?max_connections=2")
    with Served(fake_upstream()) as web:
        got = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "list", "--redis",
                              f"redis://127.0.0.1:{web.port}/0"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 1 and "not a Redis server" in got.stderr, got.stderr[-1000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a file of another user's")
def test_an_export_over_another_users_file_keeps_its_owner(tmp_path, redis_url, prefix):
    """(The sixteenth prober.) Run as root, the whole-file export replaced a user's file with root's (the user could
    no longer write their own file; an ACL was dropped). Another user's file, or one with extended attributes, is
    written in place as before."""
    _stored_call(redis_url, prefix, "o1")
    out = tmp_path / "data.jsonl"
    out.write_text("old\n")
    os.chown(out, 1234, 1234)
    got = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "export", "--redis", redis_url, "--prefix",
                          prefix, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert (out.stat().st_uid, out.stat().st_gid) == (1234, 1234) and out.read_text() != "old\n", out.read_text()


def test_round_22s_fixes_as_the_seventeenth_prober_found_them(monkeypatch, tmp_path, redis_url, prefix):
    """(The seventeenth prober.) The gateway's and the controller's own messages and log lines printed a Redis
    server's error text and a typed URL with their terminal escapes (the trainer's were escaped); a Redis password
    holding ``/`` or ``?`` unescaped was printed whole and left readable in ``/proc`` (``urlsplit`` reads it as the
    path); a password the engine echoed JSON-escaped beyond ``\\/`` (``\\u00e4``, ``\\"``) was shown; ``?protocol=3``
    passed the URL check, and the Store's stream reads broke on RESP3's shapes."""
    import logging

    from agl_common.proc_secrets import argv_secrets
    from agl_common.settings import printable_log_records, redacted_url
    from agl_common.store import check_redis_url
    from agl_trainer.cycle import _answer_excerpt

    evil = b"-ERR \x1b]8;;http://evil/\x07CLICK\x1b]8;;\x07 \x1b[2J\x1b[31mRED\r\n"
    port, stop = _fake_redis(evil)
    proc = subprocess.Popen([sys.executable, "-m", "agl_gateway", "serve", "--upstream", "http://127.0.0.1:9/v1",
                             "--open", "--port", "0", "--redis", f"redis://127.0.0.1:{port}/0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # (it goes on, logging each refusal: its log lines are read for 15 s)
        out, errs = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, errs = proc.communicate(timeout=60)
    finally:
        stop()
    assert "\x1b" not in out + errs and "\\x1b]8;;http://evil/" in errs, errs[-1500:]
    typed = "redis://127.0.0.1:1/0?client_name=\x1b]8;;http://evil/\x07CLICK&socket_timeout=inf"
    got = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--command", "true", "--redis", typed],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and "\x1b" not in got.stderr and "bad Redis URL" in got.stderr, got.stderr
    printable_log_records()
    record = logging.getLogger("agl.test").makeRecord("agl.test", logging.WARNING, __file__, 1, "lost (%s)",
                                                      ("\x1b[2Jx",), None)
    assert record.getMessage() == "lost (\\x1b[2Jx)"
    for url in ("redis://:Zk8q/Pw+Xy3vR9sT@127.0.0.1:6398/0", "http://u:pa/ss@e:8000", "redis://:ab?cd@h:6379/0"):
        assert "Pw+Xy3" not in redacted_url(url) and "pa/ss" not in redacted_url(url) and "ab?cd" not in redacted_url(url)
        assert argv_secrets(["--redis", url]) == [url]
    assert redacted_url("http://u:pw@h/x") == "http://u:***@h/x" and redacted_url("redis://h:1/0") == "redis://h:1/0"
    for password in ("p%C3%A4ssw%C3%B6rd-s%C3%ABcret-9281", "correct%22horse%22battery%22staple"):
        from urllib.parse import unquote

        echoed = json.dumps({"detail": f"refused credentials operator:{unquote(password)}"}).encode()
        assert _answer_excerpt(echoed, f"http://operator:{password}@127.0.0.1:1") == \
            '{"detail": "refused credentials ***"}'
    for url in ("redis://h/0?protocol=3", "redis://h/0?protocol=2&protocol=3"):
        with pytest.raises(ValueError, match="protocol takes 2"):
            check_redis_url(url)
    assert check_redis_url("redis://h/0?protocol=2")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a group this process is not in")
def test_an_export_keeps_the_group_of_the_file_it_replaces(tmp_path, redis_url, prefix):
    """(The seventeenth prober.) The whole-file export gave the new file this process's group: a file shared by a
    group (``root:staff``, 664) lost the group's write access. The new file gets the old one's owner and group."""
    _stored_call(redis_url, prefix, "g1")
    out = tmp_path / "data.jsonl"
    out.write_text("old\n")
    os.chown(out, 0, 50)
    out.chmod(0o664)
    got = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "export", "--redis", redis_url, "--prefix",
                          prefix, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert (out.stat().st_uid, out.stat().st_gid, out.stat().st_mode & 0o777) == (0, 50, 0o664)


def test_a_late_empty_field_keeps_the_message_the_agent_was_sent():
    """(The seventeenth prober.) After round 22's rule (a non-empty field after a stream's finish is an error), a
    late empty one (``function_call: {}``, ``annotations: []``) passed and replaced the recorded value: the record
    read ``function_call: {}`` while the agent had the whole call. An empty object or list merges as nothing."""
    from agl_gateway.capture import StreamCapture

    cap = StreamCapture({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "m")
    cap.cap.prompt_token_ids = [1, 2]
    call = {"name": "lookup", "arguments": "{}"}
    cap.feed(_chunk({"role": "assistant", "content": "", "function_call": call, "annotations": [{"a": 1}]}, [5, 6],
                   "function_call"))
    cap.feed(_chunk({"function_call": {}, "annotations": []}, []))
    message = cap.result()[1]["choices"][0]["message"]
    assert message["function_call"] == call and message["annotations"] == [{"a": 1}], message


def test_round_22s_fixes_as_the_eighteenth_prober_found_them(monkeypatch, tmp_path):
    """(The eighteenth prober.) Round 22's rule for a password holding ``/`` hid what lay before the *last* ``@`` of
    any URL: the host of ``redis://h/0?client_name=a@b&password=pw`` and the masking of its query (the password
    shown), and URLs with no user part at all (``git+https://host/agent.git@v1.2``: a run's own config.json then
    read as hiding a secret); the URL checks still echoed the password's tail as the path or an option. A swap's
    excerpt missed JSON escapes other encoders write (Go's ``\\u0026``, upper-case hex) and masked every ``e`` of a
    one-letter password. A log record's traceback kept its terminal escapes. A late empty string replaced a recorded
    object; a ``function_call`` streamed in pieces kept the last piece only. An export whose ``chown`` failed
    otherwise than EPERM left its ``.part`` and failed."""
    import logging

    from agl_common.settings import check_http_url, printable_log_records, redacted_url
    from agl_common.store import check_redis_url
    from agl_gateway.capture import StreamCapture
    from agl_trainer import export
    from agl_trainer.cycle import _answer_excerpt

    assert redacted_url("redis://10.0.0.5:6379/0?client_name=a@b&password=hunter2") == \
        "redis://10.0.0.5:6379/0?client_name=a%40b&password=***"
    for url in ("https://github.com/org/agent.git@v1.2", "https://example.com/@user/repo", "http://[::1]:8000/x@y"):
        assert redacted_url(url) == url
    assert redacted_url("rediss://:ab/cd@127.0.0.1:1/0?ssl_password=keypass9") == \
        "rediss://***@127.0.0.1:1/0?ssl_password=***"
    for url in ("redis://:Zk8q/Pw+Xy3vR9sT@127.0.0.1:6399/0", "redis://:Zk8q?Pw+Xy3vR9sT@h:1/0",
                "redis://:Zk8q#Pw+Xy3vR9sT@h:1/0", "redis+cluster://:Zk8q/Pw+Xy3vR9sT@h:6399"):
        with pytest.raises(ValueError, match="percent-encode") as got:
            check_redis_url(url)
        assert "Pw" not in str(got.value) and "Zk8q" not in str(got.value), got.value
    with pytest.raises(ValueError, match="percent-encode") as got:
        check_http_url("http://user:Zk8q/Pw+Xy3vR9sT@127.0.0.1:9", "engine URL")
    assert "Pw" not in str(got.value), got.value

    go = json.dumps({"error": "bad credentials operator:Tr0ub4dor&3<x>"}).replace("&", "\\u0026").replace(
        "<", "\\u003c").replace(">", "\\u003e")
    assert "Tr0ub4dor" not in _answer_excerpt(go.encode(), "http://operator:Tr0ub4dor%263%3Cx%3E@127.0.0.1:1")
    assert "ss-w" not in _answer_excerpt(b'{"e": "p\\u00E4ss-w\\u00F6rd"}', "http://o:p%C3%A4ss-w%C3%B6rd@h:1")
    body = b'{"object":"error","message":"The model `policy` does not exist."}'
    assert _answer_excerpt(body, "http://admin:e@127.0.0.1:8000") == body.decode()

    printable_log_records()
    try:
        raise RuntimeError("\x1b[2Jboom")
    except RuntimeError:
        import sys as _sys
        record = logging.getLogger("agl.test").makeRecord("agl.test", logging.ERROR, __file__, 1, "failed", (),
                                                          _sys.exc_info())
    assert "\x1b" not in logging.Formatter().format(record) and "\\x1b[2Jboom" in record.exc_text

    cap = StreamCapture({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "m")
    cap.cap.prompt_token_ids = [1, 2]
    cap.feed(_chunk({"role": "assistant", "content": "", "function_call": {"name": "lookup", "arguments": ""}}, [5]))
    cap.feed(_chunk({"function_call": {"arguments": '{"q": 1}'}}, [6], "function_call"))
    cap.feed(_chunk({"function_call": ""}, []))  # (a late empty string)
    assert cap.result()[1]["choices"][0]["message"]["function_call"] == {"name": "lookup", "arguments": '{"q": 1}'}

    out = tmp_path / "x.jsonl"
    out.write_text("old\n")

    def no_chown(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(export.os, "chown", no_chown)
    export.write([{"a": 1}], "calls", "jsonl", out)
    assert out.read_text() == '{"a":1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]


def test_rollouts_create_under_nohup_goes_on_after_sighup(redis_url, prefix):
    """(The eighteenth prober.) With SIGHUP among the signals that stop ``rollouts create``, ``nohup agl-trainer
    rollouts create`` stopped on a hang-up: the handler replaced the ignored disposition nohup had set. A signal the
    command was started ignoring stays ignored."""
    import signal
    import time

    import redis as sync_redis

    proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "rollouts", "create", "--redis", redis_url,
                             "--prefix", prefix, "--input", "{}", "--n", "1500", "--id", "h"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: (_default_signals(), signal.signal(signal.SIGHUP, signal.SIG_IGN)))
    r = sync_redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while not list(r.scan_iter(f"{prefix}rollout:*", count=1000)) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    out, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0 and len(out.split()) == 1500, (proc.returncode, errs[-1000:])


def test_round_22s_fixes_as_the_nineteenth_prober_found_them():
    """(The nineteenth prober.) A password of digits then ``/`` (``:12/Sec+ret==@``: base64) passed the unparsed-
    password test (its "port" was a number) and showed whole; ``http://host:/a@b`` (an empty port, an ``@`` in the
    path) was refused; ``:ab/c@d:e@h`` showed a piece of the password; a token as the user with an empty password
    (``key:@``) was shown. The excerpt's per-character JSON pattern backtracked exponentially on a password of
    backslashes and missed surrogate pairs and ``\\\\t``: JSON escapes are now read in one pass before matching. The
    stream's own merge differed from the OpenAI SDK's (``type`` joined, numbers replaced, lists of scalars
    replaced): the record now merges with the SDK's function itself."""
    import time

    from agl_common.settings import check_http_url, redacted_url
    from agl_common.store import check_redis_url
    from agl_gateway.capture import StreamCapture
    from agl_trainer.cycle import _answer_excerpt

    for url, shown in (("redis://:12/ab@h:6379/0", "redis://***@h:6379/0"),
                       ("http://user:12/Sec+ret==@engine:8000", "http://***@engine:8000"),
                       ("redis://:ab/c@d:e@h:6379/0", "redis://***@h:6379/0"),
                       ("http://sk_live_ab12:@h:1", "http://***@h:1"),
                       ("redis://10.0.0.5:6379/0?client_name=a@b&password=pw", "redis://10.0.0.5:6379/0?client_name=a%40b&password=***"),
                       ("http://host:/a@b", "http://host:/a@b"), ("http://host:8000/x@v1.2", "http://host:8000/x@v1.2")):
        assert redacted_url(url) == shown, (url, redacted_url(url))
    with pytest.raises(ValueError, match="percent-encode"):
        check_redis_url("redis://default:12/Sec+ret==@127.0.0.1:6391/0")
    with pytest.raises(ValueError, match="percent-encode"):
        check_http_url("http://user:12/Sec+ret==@engine:8000")
    assert check_http_url("http://host:/a@b") == "http://host:/a@b"

    assert _answer_excerpt(b'{"error":"unknown key sk_live_ab12"}', "http://sk_live_ab12:@h:1") == \
        '{"error":"unknown key ***"}'
    for echoed, password in ((json.dumps({"e": "bad h\U0001F600unter"}), "h%F0%9F%98%80unter"),
                             (json.dumps({"e": "bad hun\tter2"}), "hun%09ter2")):
        assert _answer_excerpt(echoed.encode(), f"http://u:{password}@h:1") == '{"e": "bad ***"}'
    t0 = time.perf_counter()
    _answer_excerpt(b"\\" * 1200 + b"x", "http://u:" + "%5C" * 22 + "Z@h:1")
    assert time.perf_counter() - t0 < 1.0

    cap = StreamCapture({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "m")
    cap.cap.prompt_token_ids = [1, 2]
    cap.feed(_chunk({"role": "assistant", "content": "", "annotations": ["a"],
                    "audio": {"id": "a", "type": "x", "expires_at": 10}}, [5]))
    cap.feed(_chunk({"annotations": ["b"], "audio": {"type": "y", "expires_at": 5}}, [6], "stop"))
    message = cap.result()[1]["choices"][0]["message"]
    assert message["annotations"] == ["a", "b"] and message["audio"] == {"id": "a", "type": "y", "expires_at": 15}
