"""Round 22 of hostile input (docs/operations.md, "A twenty-second round"): each test failed before its fix."""
from __future__ import annotations

import ast
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


def test_redis_url_values_redis_py_takes_as_given_are_refused_in_one_line():
    """(The twelfth prober.) ``rediss://...?ssl_cert_reqs=foo`` was a ``RedisError`` traceback in every CLI and the
    gateway (the URL check caught ``TypeError``/``ValueError`` only); ``?socket_timeout=inf`` (or ``nan``, ``0``)
    passed and turned the timeout off: a silent socket hung every command. Now each is a bad Redis URL."""
    from agl_common.store import check_redis_url

    for url in ("rediss://u:pw@h/0?ssl_cert_reqs=foo", "redis://h/0?socket_timeout=inf", "redis://h/0?socket_timeout=nan",
                "redis://h/0?socket_timeout=0", "redis://h/0?socket_connect_timeout=-1", "redis://h/0?timeout=inf",
                "redis://h/0?max_connections=0", "redis://h/0?socket_read_size=0", "redis://h/0?health_check_interval=-5",
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
    trainer prints on is :func:`agl_trainer.report.output_console` (markup off unless asked for, and then every
    interpolated text escaped): checked here in the source, so that a new ``Console()`` cannot bring it back."""
    from agl_trainer.report import output_console

    made = []
    for path in (ROOT / "packages" / "trainer" / "src" / "agl_trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Console":
                made.append(f"{path.name}:{node.lineno}")
    assert len(made) == 1 and made[0].startswith("report.py:"), made  # output_console's, and no other
    console = output_console()
    with console.capture() as cap:
        console.print("outputs in runs/[/]x and [red]y[/red]")
    assert cap.get().strip() == "outputs in runs/[/]x and [red]y[/red]"


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
