"""Hostile input, round 9 (docs/operations.md "Hostile input"): what a fresh probing round found."""

from __future__ import annotations

import httpx
import orjson

from test_export import RUN, recorded  # noqa: F401 (fixture)
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


def _usage_error(argv: list[str], env: dict[str, str], code: int = 2) -> str:
    import subprocess

    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    # one line of ours, or Typer's own usage error (usage, hint, its 3-line box)
    assert out.returncode == code and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 5, \
        (argv, out.returncode, out.stderr[-2000:])
    return out.stderr


def test_round9_options_no_run_could_use_are_one_line_usage_errors(redis_url, tmp_path):
    """A lease so short another controller took a live one's runs (`--lease-ttl 0.05`); commands that name no
    program or one that is not there (every rollout `spawn_error`, retried); `--host ""` (every interface); an
    empty prefix (`{}`: no hash tag, Redis Cluster failed); `--limit -5` (showed all); a `--runs-dir` that is a
    file: each started or printed a traceback."""
    import sys

    env = {"AGL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"}
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    says = {}
    for argv, word in (
            (["-m", "agl_controller", "run", "--command", "true", "--lease-ttl", "0.05"], "--lease-ttl"),
            (["-m", "agl_controller", "run", "--command", "   "], "no program"),
            (["-m", "agl_controller", "run", "--command", "''"], "no program"),
            (["-m", "agl_controller", "run", "--command", "/nonexistent/bin --x"], "not found"),
            (["-m", "agl_controller", "run", "--command", "true", "--prefix", ":"], "must hold a name"),
            (["-m", "agl_gateway", "serve", "--host", ""], "names no interface"),
            (["-m", "agl_gateway", "serve", "--prefix", ""], "must hold a name"),
            (["-m", "agl_trainer", "ui", "--host", "", "--tokenizer", "none"], "names no interface"),
            (["-m", "agl_trainer", "ui", "--runs-dir", str(a_file), "--tokenizer", "none"], "is a file"),
            (["-m", "agl_trainer", "rollouts", "list", "--limit", "-5"], "--limit"),
            (["-m", "agl_trainer", "rollouts", "list", "--prefix", ""], "must hold a name")):
        says[word] = _usage_error([sys.executable, *argv], env)
        assert word in says[word], (argv, says[word])


def test_train_config_refuses_a_command_with_no_program():
    import pytest

    from agl_trainer.config import TrainConfig

    for command in ("''", "   ", '""'):
        with pytest.raises(ValueError, match="no program"):
            TrainConfig.model_validate({"command": command})


def test_export_to_a_file_it_cannot_write_is_one_line(recorded):  # noqa: F811
    """Something to write (a recorded run), a place that takes no file: one line, exit 1. Round 14 made an
    export that matches nothing write no file, so this test needs records to reach the write."""
    import sys

    env = {"PATH": "/usr/bin:/bin"}
    for out, fmt in (("/proc/x.jsonl", "jsonl"), ("/sys/x.jsonl", "jsonl")):
        stderr = _usage_error([sys.executable, "-m", "agl_trainer", "rollouts", "export", *recorded,
                               "--run", RUN, "--out", out, "--format", fmt], env, code=1)
        assert "cannot write" in stderr, stderr


def test_the_dashboard_on_loopback_answers_only_loopback_names_and_bad_parameters_get_its_page(redis_url, tmp_path):
    """DNS rebinding: any ``Host`` was answered (a web page could read rollouts through a name it controls); a
    parameter of the wrong type was FastAPI's raw JSON 422, not the dashboard's page."""
    import subprocess
    import sys
    import time

    from fakes import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "ui", "--host", "127.0.0.1", "--port", str(port),
                             "--runs-dir", str(tmp_path), "--tokenizer", "none", "--redis", redis_url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(url + "/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert httpx.get(url + "/", timeout=10).status_code == 200
        assert httpx.get(url + "/", headers={"Host": f"localhost:{port}"}, timeout=10).status_code == 200
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            resp = httpx.get(url + "/api/gateway", headers={"Host": host, "Origin": "http://evil.example"},
                             timeout=10)
            assert resp.status_code == 400, (host, resp.status_code, resp.text[:200])
        resp = httpx.get(url + "/rollouts/some-id?page=abc", timeout=10)
        assert resp.status_code == 400 and "text/html" in resp.headers["content-type"], resp.text[:300]
        assert "page" in resp.text
        api = httpx.get(url + "/api/runs/x?page=abc", timeout=10)
        assert api.status_code in (404, 422) and "application/json" in api.headers["content-type"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_train_config_refuses_values_no_useful_run_uses():
    """``clip_low: 5`` (the low side never clipped), ``lr: 1e300`` (also per role), ``tis_cap: 1e-300`` (every
    token's weight ~0), ``lora_alpha: 10**12``, ``group_size: 1`` (every GRPO advantage 0): a run started with each."""
    import pytest

    from agl_trainer.config import TrainConfig

    for data, field in (({"clip_low": 5}, "clip_low"), ({"clip_low": 1}, "clip_low"), ({"lr": 1e300}, "lr"),
                        ({"tis_cap": 1e-300}, "tis_cap"), ({"lora_alpha": 10**12}, "lora_alpha"),
                        ({"group_size": 1, "min_group_size": 1}, "group_size"),
                        ({"roles": {"solver": {"models": ["a"], "lr": 1e300}}, "policy_serving": "adapter"}, "lr")):
        with pytest.raises(ValueError, match=field):
            TrainConfig.model_validate(data)
    TrainConfig.model_validate({"clip_low": 0.28, "tis_cap": 2.0, "lr": 1e-3, "group_size": 2})
    TrainConfig.model_validate({"roles": {"solver": {"models": ["a"], "lr": 1e-3}}, "policy_serving": "adapter"})
