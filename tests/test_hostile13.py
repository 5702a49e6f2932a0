"""Hostile input, round 13 (docs/operations.md "Hostile input"): what round 12 left open, and the round's probers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import redis

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def _missing_database(redis_url: str) -> str:
    """``redis_url`` with a database number this server does not have (one past its ``databases``)."""
    count = int(redis.Redis.from_url(redis_url).config_get("databases")["databases"])
    return redis_url.rsplit("/", 1)[0] + f"/{count}"


def test_a_database_the_redis_server_does_not_have_is_one_line_everywhere(redis_url, tmp_path):
    """Round 12 left open: a Redis URL whose database number the server does not have (``/16`` on a Redis of 16)
    was a ``ResponseError`` traceback in the CLIs, a run that tried to start its own Redis on a busy port, and a
    gateway that started and answered 503 for ever. Now one line naming the database, a non-zero exit, and a
    gateway that refuses to start."""
    url = _missing_database(redis_url)
    env = {**os.environ, "AGL_REDIS_URL": url, "AGL_ENGINE_URL": "http://127.0.0.1:9", "AGL_PREFIX": "h13:"}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"command: python -c pass\npreload: []\nout_dir: {tmp_path / 'runs'}\n")
    for argv in (["agl-trainer", "rollouts", "list"], ["agl-trainer", "gateway", "status"],
                 ["agl-trainer", "train", str(cfg)], ["agl-trainer", "eval", str(cfg)],
                 ["agl-gateway", "serve", "--port", "9"], ["agl-controller", "run", "--command", "true"]):
        p = subprocess.run([str(BIN / argv[0]), *argv[1:]], env=env, capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
        out = p.stdout + p.stderr
        assert p.returncode != 0, (argv, out[-500:])
        assert "Traceback" not in out and "refused" in out and "out of range" in out, (argv, out[-800:])
        assert len([line for line in p.stderr.splitlines() if line.strip()]) <= 3, (argv, p.stderr[-800:])


async def test_integers_beyond_64_bits_are_refused_not_bent(store, redis_url, prefix, upstream):
    """Round 12 left open: an event's ``{"n": 2**70}`` was stored as the float ``1.1805916207174113e21`` (orjson
    reads an integer beyond 64 bits as the nearest double), and a model call's ``"seed": 2**70`` was forwarded
    bent. Now a 400 naming the number, nothing stored or forwarded; 64-bit integers and long digit runs inside
    strings pass unchanged."""
    await make_rollout(store, "r1")
    base = "/rollouts/r1/attempts/0"
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for big in ("1180591620717411303424", "-9223372036854775809", "18446744073709551616", "9" * 300):
                raw = ('{"type": "t", "data": {"n": %s}}' % big).encode()
                r = await c.post(gw.url + base + "/events", content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and "64 bits" in r.text, (big[:30], r.status_code, r.text[:300])
                raw = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": %s}' % big).encode()
                r = await c.post(gw.url + base + "/v1/chat/completions", content=raw,
                                 headers={"content-type": "application/json"})
                assert r.status_code == 400 and "64 bits" in r.text, (big[:30], r.status_code, r.text[:300])
            assert await store.read_events("r1") == [] and await store.read_calls("r1") == []
            for n in (2**64 - 1, -(2**63), 12345):
                r = await c.post(gw.url + base + "/events", json={"type": "t", "data": {"n": n, "s": "1" * 40}})
                assert r.status_code == 200, r.text[:300]
            r = await c.post(gw.url + base + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "is 123456789012345678901234567890 prime?"}]})
            assert r.status_code == 200, r.text[:300]
    assert [e["data"]["n"] for e in await store.read_events("r1")] == [2**64 - 1, -(2**63), 12345]


def test_a_url_inside_a_longer_string_has_its_secret_hidden(tmp_path):
    """Round 12 left open: a URL inside a longer string (``command: python agent.py --base http://u:pw@h``) was
    written as is to ``config.json`` and the trackers (``TrainConfig.shown``) and shown on the run's page, and a
    controller that could not start it logged it. Now each such URL is shown redacted, the rest of the string and
    URLs without a secret unchanged; a ``config.json`` read back with such a hidden secret is refused for a run."""
    import orjson
    from agl_common.settings import redacted_text
    from agl_trainer.config import TrainConfig

    cmd = "python agent.py --base http://u:pw123@127.0.0.1:8080/v1 --judge 'https://j.example/?api_key=K3Y&m=1' --n 3"
    cfg = TrainConfig(command=cmd, out_dir=str(tmp_path / "runs"))
    shown = cfg.shown()
    assert shown["command"] == ("python agent.py --base http://u:***@127.0.0.1:8080/v1 --judge "
                                "'https://j.example/?api_key=***&m=1' --n 3"), shown["command"]
    assert "pw123" not in orjson.dumps(shown).decode() and "K3Y" not in orjson.dumps(shown).decode()
    plain = "python agent.py --base http://127.0.0.1:8080/v1 --say *** --n 3"
    assert redacted_text(plain) == plain and TrainConfig(command=plain).shown()["command"] == plain
    (tmp_path / "config.json").write_text(orjson.dumps(shown).decode())
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(tmp_path / "config.json")],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 2 and "command has a secret hidden" in out.stderr, out.stderr[-1000:]


async def test_an_empty_system_prompt_reaches_the_engine_as_one(store, redis_url, prefix, upstream):
    """Round 12 left open: an Anthropic ``system: ""`` and a Responses ``instructions: ""`` were dropped by the
    translation, so the chat template added its own default system prompt (Qwen's "You are Qwen..."), where
    ``[{"type": "text", "text": ""}]`` came through as an empty system message. Now each is an empty system message
    in the request the engine gets (and the record); no system prompt at all still sends none."""
    await make_rollout(store, "r1")
    base = "/rollouts/r1/attempts/0/v1"
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for path, body in (("/messages", {"max_tokens": 8, "system": "", "messages": [{"role": "user",
                                                                                           "content": "3+4?"}]}),
                               ("/responses", {"instructions": "", "input": "3+4?"}),
                               ("/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "3+4?"}]}),
                               ("/responses", {"input": "3+4?"})):
                r = await c.post(gw.url + base + path, json={"model": "m", **body})
                assert r.status_code == 200, r.text[:300]
    import orjson

    sent = [orjson.loads(raw)["messages"][0] for _, raw in upstream.app.state.requests if b"messages" in raw]
    assert sent[0] == sent[1] == {"role": "system", "content": ""}, sent
    assert sent[2]["role"] == sent[3]["role"] == "user", sent


def _kill_forkserver() -> None:
    """Kill this process's multiprocessing forkserver, if it runs, and wait until it is dead (not reaped)."""
    import signal
    import time
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    if pid is None:
        return
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)


async def test_starting_a_preloaded_harness_never_changes_the_controllers_environment(tmp_path, monkeypatch):
    """Prober B: every preloaded start swapped ``os.environ`` for the harness's while the forkserver was (re)started,
    so a reward function scoring in another thread read the harness's environment (a judge's key was missing: 10 of
    40 rewards failed). Now ``os.environ`` never changes, and the forkserver, started again after it died, still
    holds only the allow-listed environment."""
    import threading

    from agl_controller.spawn import Launcher, create_log

    monkeypatch.setenv("AGL_H13_JUDGE_KEY", "judge")
    (tmp_path / "h.py").write_text("import os, sys\n"
                                   "sys.stdout.write(open(f'/proc/{os.getppid()}/environ').read())\n")
    allowed = {"PATH": os.environ["PATH"], "AGL_H13_ALLOWED": "1"}
    _kill_forkserver()  # another test's forkserver may run: this one starts its own
    launcher = Launcher([sys.executable, "h.py"], ["json"], env=allowed)
    wrong: list[str | None] = []
    stop = threading.Event()

    def judge() -> None:  # what a reward function in the controller's thread pool does
        while not stop.is_set():
            if os.environ.get("AGL_H13_JUDGE_KEY") != "judge" or "AGL_H13_ALLOWED" in os.environ:
                wrong.append(os.environ.get("AGL_H13_JUDGE_KEY"))

    watcher = threading.Thread(target=judge)
    watcher.start()
    try:
        for i in range(6):
            if i % 2:
                _kill_forkserver()  # started again, with the allow-listed environment, by the next start
            proc = await launcher.start(dict(allowed), str(tmp_path), create_log(tmp_path / f"{i}.log"))
            assert await proc.wait() == 0
            server_env = (tmp_path / f"{i}.log").read_text()
            assert "AGL_H13_ALLOWED=1" in server_env and "AGL_H13_JUDGE_KEY" not in server_env, i
    finally:
        stop.set()
        watcher.join()
    assert not wrong, f"the controller's environment changed {len(wrong)} times while harnesses started"
    assert os.environ["AGL_H13_JUDGE_KEY"] == "judge" and "AGL_H13_ALLOWED" not in os.environ


async def test_count_tokens_keeps_a_model_calls_rules(store, redis_url, prefix, upstream):
    """Prober A: ``/v1/messages/count_tokens`` reached the engine while the gateway was paused for a weight update
    (no drain counted it), took ``"model": 5``, and an Anthropic ``output_config`` other than its ``format`` (the
    ``effort``) was dropped without a word by the translation of every Messages call. Now a count waits in the pause
    gate like a model call, a non-string model is a 400, and such an ``output_config`` is a 400 naming it."""
    import asyncio

    from agl_common.control import pause_and_drain, resume

    await make_rollout(store, "r1")
    base = "/rollouts/r1/attempts/0/v1"
    count = {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + base + "/messages/count_tokens", json={**count, "model": 5})
            assert r.status_code == 400 and "model" in r.text, r.text[:300]
            for path in ("/messages", "/messages/count_tokens"):
                r = await c.post(gw.url + base + path, json={**count, "max_tokens": 8,
                                                             "output_config": {"effort": "low"}})
                assert r.status_code == 400 and "output_config" in r.text, (path, r.text[:300])
            schema = {"type": "object", "properties": {"a": {"type": "string"}}}
            r = await c.post(gw.url + base + "/messages", json={
                **count, "max_tokens": 8, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
            assert r.status_code == 200, r.text[:300]
            assert (await store.read_calls("r1"))[-1].status == "ok"
            await pause_and_drain(store, timeout_s=15)
            try:
                held = asyncio.create_task(c.post(gw.url + base + "/messages/count_tokens", json=count))
                await asyncio.sleep(0.8)
                assert not held.done(), "a count reached the engine while the gateway was paused"
            finally:
                await resume(store, release_all=True)
            r = await asyncio.wait_for(held, 10)
            assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text[:300]


def test_vllm_options_that_change_sampling_are_not_plain():
    """Prober A: a ``thinking_token_budget`` (forced end-of-thinking tokens), ``vllm_xargs`` (custom logits
    processors) or ``watermarking`` call was trained as if its logprobs were those of the plain distribution."""
    from agl_common.schemas import sampling_not_plain

    for odd in ({"thinking_token_budget": 16}, {"vllm_xargs": {"p": 1}}, {"watermarking": True},
                {"length_penalty": 0.5}):
        assert sampling_not_plain(odd), odd
    for plain in ({"vllm_xargs": {}}, {"watermarking": False}, {"thinking_token_budget": None}):
        assert sampling_not_plain(plain) is None, plain


def test_a_redis_cluster_url_s_password_is_never_printed():
    """Prober A: a Redis Cluster URL with a database number, or with no node, was quoted whole in the error."""
    import pytest
    from agl_common.store import connect

    for url in ("redis+cluster://u:s3cret@h:1/5", "redis+cluster://u:s3cret@/"):
        with pytest.raises(ValueError) as err:
            connect(url)
        assert "s3cret" not in str(err.value) and "***" in str(err.value), err.value


def test_a_task_reward_or_preload_module_that_exits_or_gives_broken_inputs_is_one_line(tmp_path):
    """Prober B: a task file (or reward, or preload module) calling ``sys.exit()`` at import ended ``train`` and the
    controller with status 0 and not a word; task functions were first called once vLLM had started, so inputs that
    are not dicts, or none at all, or a function that raised, were found minutes in. Now each is one line, exit 2,
    before anything starts."""
    task = "def train_problems():\n    return {body}\n\ndef heldout_problems():\n    return [{{'q': 2}}]\n"
    cases = {"import sys; sys.exit()\n": "SystemExit",
             task.format(body="[{'q': 1}, 5]"): "item 1 is not a JSON object",
             task.format(body="[]"): "returned no inputs",
             task.format(body="[{'q': 10**30}]"): "item 0 is not a JSON object",
             task.format(body="1 / 0"): "train_problems() failed: ZeroDivisionError"}
    for k, (text, says) in enumerate(cases.items()):
        (tmp_path / f"task{k}.py").write_text(text)
        cfg = tmp_path / f"cfg{k}.yaml"
        cfg.write_text(f"task_file: task{k}.py\nout_dir: {tmp_path / 'runs'}\n")
        res = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], capture_output=True,
                             text=True, cwd=tmp_path, timeout=120)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, (says, res.stderr)
    assert not (tmp_path / "runs").exists()
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "x.py").write_text("")  # a harness script that exists (round 16 checks it)
    for opt in ("--reward-fn", "--preload"):
        value = "exits:f" if opt == "--reward-fn" else "exits"
        res = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--redis", "redis://127.0.0.1:9/0",
                              "--command", f"{sys.executable} x.py", "--gateway", "http://127.0.0.1:9", opt, value],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert res.returncode == 2 and "SystemExit" in res.stderr and "Traceback" not in res.stderr, \
            (opt, res.returncode, res.stderr[-600:])


def test_a_controller_with_the_wrong_key_does_not_start(redis_url, prefix, upstream, tmp_path):
    """Prober B: a controller given a ``--key`` that is not the gateway's started, and every rollout it ran failed
    ``no_model_calls`` (the agent's own failure, never retried). Now one line and exit 2, as without a key."""
    with gateway(redis_url, prefix, upstream.url, key="the-right-key") as gw:
        for key in ("the-wrong-key", "bad key\u00e9"):
            res = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--redis", redis_url, "--prefix",
                                  prefix, "--command", "true", "--gateway", gw.url, "--key", key],
                                 capture_output=True, text=True, cwd=tmp_path, timeout=60)
            assert res.returncode == 2 and "Traceback" not in res.stderr, (key, res.stderr[-600:])
            assert "key" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


async def test_a_missing_rollout_record_leaves_the_listings_working(store, redis_url, prefix, tmp_path):
    """Prober B: one rollout record deleted (or evicted) while the index still lists its id made ``rollouts list``
    a traceback, ``rollouts export`` fail, and the dashboard's group page a 500. Now the others are listed."""
    from agl_common.schemas import Rollout

    for rid in ("gone-0", "gone-1", "gone-2"):
        await store.create_rollout(Rollout(rollout_id=rid, group_id="gone"), enqueue=False)
    redis.Redis.from_url(redis_url).delete(store.rollout_key("rollout", "gone-1"))
    env = {**os.environ, "AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix}
    listed = []
    for args in (["rollouts", "list", "--json"], ["rollouts", "export", "--out", str(tmp_path / "x.jsonl")]):
        res = subprocess.run([sys.executable, "-m", "agl_trainer", *args], capture_output=True, text=True, env=env,
                             timeout=120, cwd=tmp_path)
        assert res.returncode == 0 and "Traceback" not in res.stderr, (args, res.stderr[-800:])
        listed.append(res.stdout)
    assert "gone-0" in listed[0] and "gone-2" in listed[0] and "gone-1" not in listed[0], listed[0]
    assert [r.rollout_id for r in await store.get_rollouts(["gone-0", "gone-1"], skip_missing=True)] == ["gone-0"]


def test_a_run_folder_the_dashboard_may_not_read_is_left_out(tmp_path):
    """Prober B: one run folder the dashboard's user may not enter (mode 000) made the run list a 500 (its
    ``stat`` raised ``PermissionError``). Now it is left out and the others are listed. Root reads any folder, so
    as root the dashboard's code runs without capabilities (``setpriv``), where mode 000 holds for root too."""
    import shutil

    import pytest

    for name in ("good", "locked"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.json").write_text('{"seed": 1}')
        (tmp_path / "runs" / name / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (tmp_path / "runs" / "locked").chmod(0)
    try:
        code = ("import sys; from agl_trainer.ui.runs import find_runs, load_run; "
                "print([load_run(p).run_id for p in find_runs(sys.argv[1])])")
        argv = [sys.executable, "-c", code, str(tmp_path / "runs")]
        if os.getuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv (util-linux): root reads a folder of mode 000")
            argv = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *argv]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout.strip() == "['good']", res.stdout + res.stderr[-800:]
    finally:
        (tmp_path / "runs" / "locked").chmod(0o755)


def test_odd_ids_and_prefixes_on_the_command_line_are_usage_errors(redis_url, prefix):
    """Prober B: bytes that are not UTF-8 (``rollouts show $'\\xff'``, ``--prefix $'\\xff:'``) were a
    ``UnicodeEncodeError`` traceback; ``rollouts create --id ''`` and ``--group ''`` silently became random ids; a
    ``--controller-id`` ending in ``.restart`` shared the list its namesake's restart rotates claims through (and
    that restart adopted its running rollouts). Each is now refused: exit 2, no traceback, nothing created."""
    odd = os.fsdecode(b"\xff")
    env = {**os.environ, "AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix}
    before = redis.Redis.from_url(redis_url).keys(prefix + "*")
    for argv in (["agl_trainer", "rollouts", "show", odd], ["agl_trainer", "rollouts", "export", "--rollout", odd],
                 ["agl_trainer", "rollouts", "list", "--prefix", odd + ":"],
                 ["agl_trainer", "rollouts", "create", "--input", "{}", "--id", ""],
                 ["agl_trainer", "rollouts", "create", "--input", "{}", "--group", ""],
                 ["agl_trainer", "rollouts", "create", "--input", "{}", "--n", "2", "--id", ""],
                 ["agl_controller", "run", "--command", "true", "--controller-id", "ctl.restart"],
                 ["agl_controller", "run", "--command", "true", "--controller-id", ""]):
        res = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (argv, res.returncode, res.stderr[-600:])
    assert redis.Redis.from_url(redis_url).keys(prefix + "*") == before


async def test_a_replica_that_starts_during_a_held_pause_holds_its_first_call(store, redis_url, prefix, upstream):
    """Prober A: a replica started while a pause was held (its drain acknowledged before this replica registered)
    opened its gate at once and read the stored pauses only later, in its control loop: calls reached the engine
    mid-update and were recorded as the old policy's. Now it holds before it serves its first call."""
    from agl_common.control import pause_and_drain, resume
    from agl_gateway.app import create_app
    from agl_gateway.settings import GatewaySettings

    await pause_and_drain(store, timeout_s=30)  # no replica: believed empty after REPLICA_TTL_S
    try:
        app = create_app(GatewaySettings(upstream=upstream.url, redis_url=redis_url, prefix=prefix, model="m",
                                         replica_id="h13-late"))
        async with app.router.lifespan_context(app):  # start-up done: the server would now answer calls
            assert app.state.agl.gate.paused, "a replica started during a held pause serves with its gate open"
    finally:
        await resume(store, release_all=True)


async def test_what_the_second_gateway_prober_found_in_translations(store, redis_url, prefix, upstream):
    """Prober A (second wave): a synthesized Responses stream of an answer cut at ``max_output_tokens`` ended with
    ``response.completed``; an Anthropic answer stopped by one of the agent's ``stop_sequences`` said ``end_turn``;
    Responses ``include: ["message.output_text.logprobs"]`` and ``stream_options`` other than ``include_usage``
    were dropped without a word; a Redis URL whose path is not a database number was read as database 0."""
    import orjson
    import pytest
    from agl_common.store import connect
    from agl_gateway import translate

    await translate.ready()
    answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "4 "}, "finish_reason": "stop",
                           "stop_reason": "END"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    body = {"model": "m", "max_tokens": 8, "stop_sequences": ["END"], "messages": [{"role": "user", "content": "x"}]}
    message = translate.chat_to_anthropic(answer, body)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert b'"stop_sequence":"END"' in b"".join(translate.anthropic_sse(message, body)).replace(b" ", b"")
    assert translate.chat_to_anthropic(answer, {**body, "stop_sequences": ["X"]})["stop_reason"] == "end_turn"
    cut = {**answer, "choices": [{**answer["choices"][0], "finish_reason": "length", "stop_reason": None}]}
    response = translate.chat_to_responses(cut, {"model": "m", "input": "x"})
    assert response["status"] == "incomplete"
    last = [line for line in b"".join(translate.responses_sse(response)).split(b"\n") if line.startswith(b"event:")]
    assert last[-1] == b"event: response.incomplete", last[-3:]
    done = translate.chat_to_responses(answer, {"model": "m", "input": "x"})
    last = [line for line in b"".join(translate.responses_sse(done)).split(b"\n") if line.startswith(b"event:")]
    assert last[-1] == b"event: response.completed"

    await make_rollout(store, "r1")
    base = "/rollouts/r1/attempts/0/v1"
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + base + "/responses", json={
                "model": "m", "input": "x", "include": ["message.output_text.logprobs"]})
            assert r.status_code == 400 and "include" in r.text, r.text[:300]
            r = await c.post(gw.url + base + "/responses", json={
                "model": "m", "input": "x", "include": ["reasoning.encrypted_content"]})
            assert r.status_code == 200, r.text[:300]
            chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
            r = await c.post(gw.url + base + "/chat/completions", json={
                **chat, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            assert r.status_code == 400 and "continuous_usage_stats" in r.text, r.text[:300]
            r = await c.post(gw.url + base + "/chat/completions", json={
                **chat, "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
            assert r.status_code == 200 and b"[DONE]" in r.content
    assert not any(b"continuous_usage_stats" in raw and orjson.loads(raw)["stream_options"].get(
        "continuous_usage_stats") for _, raw in upstream.app.state.requests if b"stream_options" in raw)
    for url in ("redis://u:pw@127.0.0.1:6379/abc", "redis://127.0.0.1:6379/1/x"):
        with pytest.raises(ValueError, match="database number"):
            connect(url)


async def test_a_rollout_another_controller_ended_is_not_handed_back_or_retried(store):
    """Prober B (second wave): a controller frozen past its lease, whose running rollout another controller then
    ended ``controller_lost``, handed it back on its clean stop (``failed → queuing``, run again); its retry path
    read ``running`` and retried in a second step. Now the status is checked in the transaction that changes it."""
    from agl_common.schemas import Rollout, RolloutStatus
    from agl_controller.base import Runner

    runner = Runner(store, controller_id="h13-a", max_attempts=3)
    for rid, how in (("lost-1", "hand_back"), ("lost-2", "finish")):
        await store.create_rollout(Rollout(rollout_id=rid, status=RolloutStatus.running), enqueue=False)

        def lost(r: Rollout) -> None:
            r.status, r.failure = RolloutStatus.failed, "controller_lost"

        await store.update_rollout(rid, lost)
        if how == "hand_back":
            assert await runner.hand_back(rid, "0", "shutdown") is None
        else:  # the retry step itself, as _finish reaches it after its own (earlier) check
            import pytest

            with pytest.raises(ValueError, match="only running"):
                await store.retry_attempt(rid, "0", running_only=True)
        r = await store.get_rollout(rid)
        assert (r.status, r.attempt_id, r.failure) == (RolloutStatus.failed, "0", "controller_lost"), (rid, r)
    # a manual retry of a failed rollout still works
    assert (await store.retry_attempt("lost-2", "0")).status == RolloutStatus.queuing


async def test_a_run_that_ended_in_time_is_not_a_timeout_when_the_controller_looks_late(store, tmp_path):
    """Prober B (second wave): a harness that exited 0 well within ``--timeout`` while the controller was stopped
    (SIGSTOP, a starved loop) was recorded ``timeout`` (retried: a good run thrown away): the clock was read
    before the exit. Now an exit already there is taken first."""
    import asyncio
    import time

    from agl_controller.local import LocalRunner
    from agl_controller.spawn import RunLog, create_log

    runner = LocalRunner(store, "http://127.0.0.1:9", ["true"], "m", timeout_s=5, log_dir=tmp_path)
    fd = create_log(tmp_path / "x.log")
    log = RunLog(fd, runner.max_log_bytes)
    try:
        proc = await runner.launcher.start(dict(os.environ), str(tmp_path), log.write_fd)
        log.started()
        waiter = asyncio.ensure_future(proc.wait())
        await asyncio.wait_for(asyncio.shield(waiter), 10)
        # the controller looks only now, as if it had been stopped for 7 s after the start
        assert await runner._watch(proc, waiter, log, time.monotonic() - 7) is None
    finally:
        log.close()
        os.close(fd)


def test_what_the_second_cli_prober_found_in_inputs_urls_and_exports(tmp_path):
    """Prober B (second wave): ``rollouts create --input`` stored an integer beyond 64 bits bent and kept the last
    of a key given twice; in a comma-separated list of URLs only the first password was hidden; the dashboard
    showed a command holding a redacted URL as ``***@h:1/v1`` (the command lost); ``export --min-reward`` kept a
    rollout that posted the reward and then failed."""
    import pytest
    from agl_common.schemas import Rollout, RolloutStatus, parse_input
    from agl_common.settings import redacted_text
    from agl_trainer.export import ExportFilter
    from agl_trainer.ui.runs import shown_config

    for text, says in (('{"seed": 18446744073709551617}', "beyond 64 bits"), ('{"a": 1, "a": 2}', "twice"),
                       ('{"x": {"b": 1, "b": 1}}', "twice")):
        with pytest.raises(ValueError, match=says):
            parse_input(text)
    assert parse_input('{"seed": 18446744073709551615, "s": "123456789012345678901234"}')["seed"] == 2**64 - 1
    shown = redacted_text("run --engines http://a:pw1@h1,http://b:SECRET2@h2 --x 1")
    assert "pw1" not in shown and "SECRET2" not in shown and shown.endswith("@h2 --x 1"), shown
    command = "python examples/arithmetic/agent.py --base http://u:***@h:1/v1"
    assert shown_config({"command": command}) == {"command": command}
    assert shown_config({"command": "a --base http://u:pw@h:1/v1"}) == {"command": "a --base http://u:***@h:1/v1"}
    keep = ExportFilter(min_reward=1.0).keep
    assert not keep(Rollout(rollout_id="f", status=RolloutStatus.failed, reward=1.0, failure="exit_code:3"))
    assert keep(Rollout(rollout_id="s", status=RolloutStatus.succeeded, reward=1.0))


async def test_a_controller_waiting_for_an_old_lease_stops_on_a_signal(store):
    """Prober B (second wave): a controller restarted under a crashed one's id waited for that lease (up to its
    whole TTL) silently, deaf to SIGTERM and SIGINT. Now the wait is said and a stop ends it."""
    import asyncio
    import time

    from agl_controller.base import Runner

    await store.renew_lease("h13-crashed", 600)
    stop = asyncio.Event()
    runner = Runner(store, controller_id="h13-crashed")
    task = asyncio.create_task(runner.take_lease(stop))
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    stop.set()
    assert await asyncio.wait_for(task, 5) is False and time.monotonic() - t0 < 2


def test_retry_on_entries_that_can_never_match_are_refused():
    """Prober B (second wave): ``--retry-on signal:SIGTERM``, ``exit_code:01`` and ``timeout:30`` were taken, and
    the failures they were meant to retry ended their rollouts (a ``signal:15`` never retried)."""
    import pytest
    from agl_controller.base import check_retry_on, matches

    for entry in ("signal:SIGTERM", "exit_code:01", "timeout:30", "exit_code:", "signal:1.0"):
        with pytest.raises(ValueError, match="can never match"):
            check_retry_on([entry])
    taken = check_retry_on(["signal:15", "exit_code:75", "timeout", "job_failed:BackoffLimitExceeded"])
    assert matches("signal:15", taken) and matches("timeout", taken) and not matches("signal:9", taken)


def test_a_train_command_the_controller_would_refuse_is_found_before_anything_starts(tmp_path):
    """Prober B (second wave): with the default ``preload: [agents]``, ``bash run.sh``, ``python -u agent.py`` and a
    misspelt ``pyhton agent.py`` passed every check at start; the controller refused them only once vLLM had run
    (minutes), and the trainer printed a traceback. Now one line, exit 2, before anything starts."""
    (tmp_path / "task.py").write_text("def train_problems():\n    return [{'q': 1}]\n\n"
                                      "def heldout_problems():\n    return [{'q': 2}]\n")
    for command, says in (("bash run.sh", "preload"), ("python -u agent.py", "interpreter options"),
                          ("pyhton agent.py", "not found")):
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"task_file: task.py\nout_dir: {tmp_path / 'runs'}\ncommand: {command}\n")
        res = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], capture_output=True,
                             text=True, cwd=tmp_path, timeout=120)
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, (command, res.stderr)
    assert not (tmp_path / "runs").exists()


async def test_what_the_regression_prober_found(store, redis_url, prefix, upstream, tmp_path):
    """Prober C (this round's own changes): a stored policy or pause this version cannot read made every new
    gateway fail its start-up (the pauses are now read before serving; the control loop had logged and retried);
    task inputs pydantic stores as JSON (a ``Decimal``, a ``Path``, a set) were refused by the new start-up check."""
    from agl_gateway.app import create_app
    from agl_gateway.settings import GatewaySettings
    from agl_trainer.tasks import load_tasks

    r = redis.Redis.from_url(redis_url)
    r.hset(store.key("pauses"), "p1", "soon")
    try:
        app = create_app(GatewaySettings(upstream=upstream.url, redis_url=redis_url, prefix=prefix, model="m",
                                         replica_id="h13-odd"))
        async with app.router.lifespan_context(app):
            assert app.state.agl.store is not None
    finally:
        r.delete(store.key("pauses"))
    (tmp_path / "typed.py").write_text("from decimal import Decimal\nfrom pathlib import Path\n"
                                       "def train_problems():\n"
                                       "    return [{'answer': Decimal('2'), 'repo': Path('/srv'), 'tags': {'m'}}]\n")
    assert load_tasks(tmp_path / "typed.py", "train_problems")[0]["answer"] == 2
