"""Hostile input, round 12 (docs/operations.md "Hostile input"): what round 11 left open, and the round's probers."""

from __future__ import annotations

import asyncio

import httpx
import orjson

import pytest
from agl_common.schemas import RolloutStatus

from test_controller import gateway_url  # noqa: F401 (fixture)
from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)
from test_hostile6 import _last, _one


async def test_translated_options_the_translation_would_drop_or_bend_are_refused(store, redis_url, prefix, upstream):
    """Round 11 left open: a Responses ``input_image`` without ``image_url`` was sent as ``{"url": ""}``;
    ``tool_choice: 5``, ``text: 5`` and ``text.verbosity`` were dropped; ``function_call_output.output: [5]``
    became the text ``"[5]"``; an Anthropic ``tool_choice: {"type": "tool"}`` without a name reached the engine as an
    empty function name. Each is a 400 naming the field, before the engine; their well-formed forms still pass."""
    await make_rollout(store, "r1")
    call = [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}]
    fn = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    bad = [({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "image_url"),
           ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": ""}]}]}, "image_url"),
           ({"input": call + [{"type": "function_call_output", "call_id": "c1", "output": [5]}]}, "output"),
           ({"input": "hi", "tools": fn, "tool_choice": 5}, "tool_choice"),
           ({"input": "hi", "tools": fn, "tool_choice": {"type": "function"}}, "tool_choice"),
           ({"input": "hi", "text": 5}, "'text'"),
           ({"input": "hi", "text": {"verbosity": "low"}}, "'text'"),
           ({"input": "hi", "text": {"format": {"type": "banana"}}}, "'text'")]
    good = [{"input": call + [{"type": "function_call_output", "call_id": "c1",
                               "output": [{"type": "input_text", "text": "7"}]}]},
            {"input": "hi", "tools": fn, "tool_choice": {"type": "function", "name": "add"}},
            {"input": "hi", "tools": fn, "tool_choice": "required"},
            {"input": "hi", "text": {"format": {"type": "text"}, "verbosity": "medium"}}]
    anthropic_tools = [{"name": "add", "input_schema": {"type": "object"}}]
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for body, word in bad:
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/responses", json={"model": "m", **body})
                assert r.status_code == 400 and word in r.text, (body, r.status_code, r.text[:300])
            for choice in ({"type": "tool"}, {"type": "tool", "name": ""}, "auto", {"type": "banana"}):
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages", json={
                    "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"}],
                    "tools": anthropic_tools, "tool_choice": choice})
                assert r.status_code == 400 and "tool_choice" in r.text, (choice, r.status_code, r.text[:300])
            assert await store.read_calls("r1") == []  # refused before the engine: nothing recorded
            for body in good:
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/responses", json={"model": "m", **body})
                assert r.status_code == 200, (body, r.status_code, r.text[:300])
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages", json={
                "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"}],
                "tools": anthropic_tools, "tool_choice": {"type": "tool", "name": "add"}})
            assert r.status_code == 200, r.text[:300]


async def test_odd_message_fields_are_an_upstream_error_on_every_route(store, redis_url, prefix, upstream):
    """Round 10 left open: ``reasoning_content: 5``, a ``refusal`` object or a ``role: "user"`` answer were ``ok`` on
    chat and a 502 (or ``ok``) on the translated routes. One definition now (``capture.check_choice``): a 502 and an
    error record on every route; a string ``reasoning_content`` still passes."""
    from fakes import chat_answer, chat_chunks

    await make_rollout(store, "r1")
    bodies = {"chat/completions": {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]},
              "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "3+4?"}]},
              "responses": {"model": "m", "input": "3+4?"}}
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for field, value, status in (("reasoning_content", 5, 502), ("refusal", {"x": 1}, 502),
                                         ("reasoning", ["a"], 502), ("role", "user", 502),
                                         ("reasoning_content", "thinking", 200)):
                answer = chat_answer("up", [1, 2, 3], [5, 6, 2])
                answer["choices"][0]["message"][field] = value
                upstream.app.state.plan = ("body", 200, orjson.dumps(answer))
                for path, body in bodies.items():
                    r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{path}", json=body)
                    assert r.status_code == status, (field, path, r.status_code, r.text[:300])
                    assert (await _last(store)).status == ("ok" if status == 200 else "error"), (field, path)
            chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
            upstream.app.state.plan = ("stream", [chunks[0].replace(b'"role":"assistant"', b'"role":"user"')]
                                       + chunks[1:], "done")
            r = await _one(c, gw, {"stream": True})
            assert "upstream_error" in r.text and "[DONE]" not in r.text, r.text[-300:]
            assert (await _last(store)).status == "error"
    upstream.app.state.plan = None


async def test_two_gateways_claiming_one_replica_id_at_once_get_it_once(store):
    """Round 11 left open: two gateways started within the same quarter second under one replica id could both
    pass the check (it read, then heartbeated). The id is now taken with ``SET NX``: of two claims at once,
    exactly one gets it, the other is refused while the owner heartbeats; a heartbeat of a process that does not
    own the id writes nothing."""
    import pytest
    from agl_common.schemas import ReplicaStatus
    from agl_gateway.app import ReplicaIdLive, claim_replica_id

    got = await asyncio.gather(*(store.claim_replica("gw", f"p{i}") for i in range(8)))
    assert sum(got) == 1
    owner = f"p{got.index(True)}"
    other = "p0" if owner != "p0" else "p1"
    assert not await store.heartbeat(ReplicaStatus(replica_id="gw", in_flight=7), other)
    assert await store.replica("gw") is None  # the intruder wrote nothing

    async def beat() -> None:  # the owner, alive
        for _ in range(12):
            assert await store.heartbeat(ReplicaStatus(replica_id="gw"), owner)
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(beat())
    with pytest.raises(ReplicaIdLive):
        await claim_replica_id(store, "gw", other, wait_s=3.0)
    beating.cancel()
    await store.drop_replica("gw", other)  # not its id: nothing is dropped
    assert (await store.replica("gw")) is not None
    await store.drop_replica("gw", owner)
    assert await store.claim_replica("gw", other)


def test_a_run_does_not_start_on_a_prefix_a_controller_alone_runs(redis_url, prefix):
    """Round 11 left open: a prefix used by a controller alone (its gateway elsewhere, or not started yet) was
    taken as free: the run's own controller would share its queue. A live controller lease now counts as a user of
    the prefix (watched a while first); one that lapses meanwhile does not."""
    import time

    import pytest
    from agl_common.store import Store
    from agl_trainer.config import TrainConfig
    from agl_trainer.stack import PrefixInUse, check_prefix_free

    async def lease(ttl_s: float) -> None:
        store = Store(redis_url, prefix)
        try:
            await store.renew_lease("ctl-other", ttl_s)
        finally:
            await store.close()

    cfg = TrainConfig(redis_url=redis_url, prefix=prefix)
    asyncio.run(lease(30.0))  # a live controller (it renews within its lease)
    t0 = time.monotonic()
    with pytest.raises(PrefixInUse, match="controller.*ctl-other"):
        check_prefix_free(cfg, wait_s=1.0)
    assert time.monotonic() - t0 >= 1.0
    asyncio.run(lease(1.0))  # a controller killed after its last renewal: its lease lapses while watched
    check_prefix_free(cfg, wait_s=5.0)


def test_every_reader_takes_the_recorded_choice_of_index_0():
    """The second prober: with ``n: 2`` and an engine listing choice 1 first, the record held choice 0's token ids
    but the reward function (``final_output``), the dashboard (``message_text``) and the SFT export read choice 1:
    a judge scored one sample while PPO trained another. Every reader now takes the choice of index 0."""
    from agl_common.schemas import CallRecord, answer_text, first_choice
    from agl_controller.base import final_output
    from agl_trainer.export import ExportStats, conversations
    from agl_trainer.ui.traces import message_text

    def msg(index: int, text: str) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}

    rec = CallRecord(rollout_id="r1", attempt_id="0", seq=0, route="chat",
                     request={"model": "m", "n": 2, "messages": [{"role": "user", "content": "3+4?"}]},
                     response={"choices": [msg(1, "ONE"), msg(0, "ZERO")]}, prompt_token_ids=[1, 2, 3],
                     response_token_ids=[5, 6, 2], response_logprobs=[-0.1] * 3, finish_reason="stop")
    assert first_choice(rec)["message"]["content"] == "ZERO"
    assert answer_text(rec) == final_output([rec]) == message_text(rec) == "ZERO"
    [(conv, _, _, _)] = conversations([rec], ExportStats())
    assert conv[-1]["content"] == "ZERO"
    odd = rec.model_copy(update={"response": {"choices": [{"index": True, "text": "x"}, {"index": "0", "text": "y"}]},
                                 "route": "completions"})
    assert first_choice(odd) == {} and answer_text(odd) == ""


def test_a_gateway_url_s_secrets_are_shown_nowhere(tmp_path):
    """The second prober: a ``gateway_url`` with a password was written as is to ``config.json`` and the trackers
    (``TrainConfig.shown``), printed at start and put on the controller's public command line; an engine URL's
    ``?api_key=`` was shown (only ``password=`` was hidden). Now the three URLs are shown redacted, secret query
    parameters too, and the gateway URL reaches the controller in its environment."""
    from agl_common.settings import redacted_url
    from agl_trainer.config import TrainConfig
    from agl_trainer.services import Services

    cfg = TrainConfig(gateway_url="http://u:s3cret@127.0.0.1:8080", engine_url="http://127.0.0.1:8000?api_key=k3y")
    shown = orjson.dumps(cfg.shown()).decode()
    assert "s3cret" not in shown and "k3y" not in shown and "127.0.0.1:8080" in shown
    assert redacted_url("http://h:1/v1?token=t0k&model=m&X-Auth=a1") == "http://h:1/v1?token=***&model=m&X-Auth=***"

    seen = {}

    class Recording(Services):
        def start(self, name, argv, env=None, **kw):
            seen[name] = (argv, env)

        def expect_running(self, name):
            pass

    Recording(tmp_path).start_controller("true", "http://u:s3cret@127.0.0.1:8080", "redis://127.0.0.1:6379/0", "p:",
                                         "m", 1, 10.0, tmp_path)
    argv, env = seen["controller"]
    assert "s3cret" not in " ".join(argv) and env["AGL_GATEWAY_URL"] == "http://u:s3cret@127.0.0.1:8080"


def test_config_files_that_expand_repeat_or_never_end_are_one_line(tmp_path):
    """The second prober: a 500-byte YAML of nested aliases took 22 s and 390 MB at 7 levels (9x a level more:
    the error message built the whole ``repr`` to show 40 characters of it); ``steps: 5`` then ``steps: 7`` loaded as
    7 without a word; ``train /dev/zero`` read until memory ran out. Each is now one line and exit 2, at once."""
    import subprocess
    import sys
    import time

    levels = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]'] + [
        f"a{k}: &a{k} [{','.join([f'*a{k - 1}'] * 9)}]" for k in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(levels[:1] + levels[1:]) + "\npreload: *a9\n")
    (tmp_path / "dup.yaml").write_text("steps: 5\nsteps: 7\n")
    for path, word in ((tmp_path / "bomb.yaml", "preload"), (tmp_path / "dup.yaml", "'steps' given twice"),
                       ("/dev/zero", "not a regular file")):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(path)], capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert out.returncode == 2 and word in out.stderr and len(out.stderr.strip().splitlines()) == 1, \
            (path, out.returncode, out.stderr[-1500:])
        assert time.monotonic() - t0 < 30, path


def test_a_run_folder_whose_name_is_not_text_leaves_the_others_readable(redis_url, prefix, tmp_path):
    """The second prober: one run folder named with a byte that is not UTF-8 made ``/``, ``/api/runs`` and every
    unknown run's page a 500 (every run gone from the index). Such a folder is left out; the others are shown."""
    import os

    from agl_trainer.ui.server import create_app

    from fakes import Served

    root = tmp_path / "runs" / "demo"
    (root / "good").mkdir(parents=True)
    (root / "good" / "metrics.jsonl").write_text('{"step": 1}\n')
    bad = os.path.join(os.fsencode(root), b"bad\xff")
    os.mkdir(bad)
    with open(os.path.join(bad, b"metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    with Served(create_app(redis_url, prefix, tmp_path / "runs")) as ui:
        with httpx.Client(timeout=20) as c:
            for path in ("/", "/api/runs", "/runs/nothere", "/runs/good"):
                r = c.get(ui.url + path)
                assert r.status_code in (200, 404) and (r.status_code == 404) == (path == "/runs/nothere"), \
                    (path, r.status_code, r.text[:300])
            assert "good" in c.get(ui.url + "/").text


async def test_a_short_drain_timeout_does_not_take_an_empty_registry_at_its_word(store):
    """The second prober: ``gateway pause --timeout 0.01`` (or a trainer's ``drain_timeout_s: 1``) said "paused and
    drained: 0 replica(s)" as soon as its timeout passed: the guard that waits a heartbeat before believing an
    empty registry (Redis back empty) was cut to the timeout. A timeout shorter than that guard now fails."""
    import pytest
    from agl_common.control import DrainTimeout, pause_and_drain

    with pytest.raises(DrainTimeout, match="no gateway replica seen"):
        await pause_and_drain(store, timeout_s=0.3)
    assert await pause_and_drain(store, timeout_s=10) == []  # past the guard: nothing can be in flight


def test_policy_versions_and_groups_in_flight_are_read_as_written(tmp_path):
    """The second prober: ``eval --policy v<5000 digits>`` ended in a traceback, ``v٣`` (an Arabic-Indic digit)
    was taken as ``policy-v3``; ``active_groups: 1`` with ``groups_per_step: 8`` was raised to 8 without a word."""
    import pytest
    from agl_trainer.config import TrainConfig, describe_error
    from agl_trainer.evaluation import PolicyNotFound, resolve_policy

    cfg = TrainConfig(out_dir=str(tmp_path))
    for spec in ("v" + "9" * 5000, "v٣"):
        with pytest.raises(PolicyNotFound, match="is not base, vN"):
            resolve_policy(spec, cfg, None)
    with pytest.raises(ValueError) as exc:
        TrainConfig(active_groups=1, groups_per_step=8)
    assert "active_groups (1) is below groups_per_step (8)" in describe_error(exc.value)
    assert TrainConfig(active_groups=8, groups_per_step=8).active_groups == 8


@pytest.mark.parametrize("preload", [[], ["json"]], ids=["exec", "preload"])
async def test_a_run_s_log_and_interrupt_are_the_same_whichever_way_it_starts(store, gateway_url, tmp_path,
                                                                            preload):
    """The second prober: a harness that unlinked its log and then printed 200 MB passed ``--max-log-bytes`` (the
    controller measured the path, not the file); an uncaught ``KeyboardInterrupt`` ended ``signal:2`` (retried, an
    infrastructure failure) when exec'd but ``exit_code:1`` (the agent's failure) when forked from ``--preload``.
    The controller now watches the file it created for the run, and a forked run ends as CPython does."""
    from test_controller import run

    if preload:  # a forkserver started by an earlier test holds that test's environment: start a fresh one
        from multiprocessing import forkserver
        forkserver._forkserver._stop()
    out = await run(store, gateway_url, tmp_path, {"hidden": {"calls": 1, "spew": True, "unlink_log": True},
                                                   "ctrl_c": {"calls": 1, "reward": 1.0, "interrupt": True}},
                    timeout_s=60, max_log_bytes=256 * 1024, max_attempts=1, preload=preload)
    assert (out["hidden"].status, out["hidden"].failure) == (RolloutStatus.failed, "log_limit")
    assert out["ctrl_c"].failure == "signal:2", out["ctrl_c"].failure


def test_a_job_s_resource_quantities_are_checked_as_the_api_server_checks_them():
    """The second prober: ``cpu: {{ input.get("cpus", 1) }}`` rendered ``[1, 2]``, ``None``, ``True`` or ``{'a': 1}``
    as a quantity and the dry-run said yes; a real run got the API's 422 at every attempt (``spawn_error``, retried
    for nothing). Such a quantity is a template error naming the field; numbers and quantity strings pass."""
    from agl_common.schemas import Rollout
    from agl_controller.k8s import JobRenderer

    template = ("apiVersion: batch/v1\nkind: Job\nspec:\n  template:\n    spec:\n      containers:\n"
                "        - name: h\n          image: busybox\n          resources:\n"
                "            limits: {cpu: {{ input.cpus }}, memory: 1Gi}\n")
    for cpus in ([1, 2], None, True, {"a": 1}, "lots", -1, "NaN", "inf", float("nan"), "1_000", " 1", "１", "1e3Gi"):
        with pytest.raises(ValueError, match="resources.limits.cpu"):
            JobRenderer(template, "http://gw", "m").render(Rollout(rollout_id="r", input={"cpus": cpus}))
    for cpus, shown in ((2, "2"), (0.5, "0.5"), ("500m", "500m"), ("1.5Gi", "1.5Gi"), ("1e3", "1e3"), (".5", ".5")):
        m = JobRenderer(template, "http://gw", "m").render(Rollout(rollout_id="r", input={"cpus": cpus}))
        limits = m["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"cpu": shown, "memory": "1Gi"}, limits


async def test_a_live_stream_whose_agent_left_before_its_first_event_is_abandoned(store, redis_url, prefix,
                                                                                 upstream):
    """The first prober: an agent that gave up on a live stream before its first event (an SDK timeout during a
    queue or prefill wait, then a retry) was recorded ``ok`` when the engine's answer then came at once: two ``ok``
    records for one turn, as round 7 fixed for complete answers. Such a call is now ``abandoned``."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            try:
                await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", timeout=0.7,
                             json={"model": "m", "messages": [{"role": "user", "content": "3+4?"}], "stream": True,
                                   "x_stall": 2.0})
            except httpx.TimeoutException:
                pass
            for _ in range(50):
                await asyncio.sleep(0.1)
                if (rec := await _last(store)) is not None:
                    break
            assert rec is not None and rec.status == "error" and "abandoned" in rec.error, rec
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions",
                             json={"model": "m", "messages": [{"role": "user", "content": "3+4?"}], "stream": True})
            assert r.status_code == 200 and (await _last(store)).status == "ok"


async def test_what_the_first_prober_found_in_answers_and_turns(store, redis_url, prefix, upstream):
    """The first prober: (1) an answer without ``usage`` (or a stream without its usage chunk) switched the check of
    token ids against the engine's own counts off: partial ids recorded ``ok``; (2) an empty Anthropic user turn was
    dropped by the translation (the engine then continued the assistant's turn as a prefill), and
    ``count_tokens`` counted the conversation without it; (3) a streamed call with tools (a stream made from a
    complete answer) lost ``reasoning_content`` on its way to the agent, which the record kept; (4) a live stream's
    tool call of ``type: "banana"`` or an object in ``delta.reasoning`` reached the agent, recorded ``ok``; (5) a
    completions ``prompt`` of two strings was forwarded (two choices for n=1, then a 502)."""
    from fakes import chat_answer, chat_chunks, completion_answer

    await make_rollout(store, "r1")
    user = [{"role": "user", "content": "3+4?"}]
    with gateway(redis_url, prefix, upstream.url) as gw:
        base = f"{gw.url}/rollouts/r1/attempts/0/v1"
        async with httpx.AsyncClient(timeout=30) as c:
            answer = chat_answer("up", [1, 2, 3], [7, 8], "a long answer of many tokens")  # (1)
            answer.pop("usage")
            done = completion_answer("up", [1, 2, 3], [5], " 7 and many more words")
            done.pop("usage")
            for path, body, plan in (("chat/completions", {}, ("body", 200, orjson.dumps(answer))),
                                     ("completions", {"prompt": "3+4?"}, ("body", 200, orjson.dumps(done))),
                                     ("chat/completions", {"stream": True},
                                      ("stream", chat_chunks("up", [1, 2, 3], [7, 8, 9, 2], drop_ids=2)[:-1], "done"))):
                upstream.app.state.plan = plan
                r = await c.post(f"{base}/{path}", json={"model": "m", "messages": user, **body})
                rec = await _last(store)
                assert rec.status == "error" and "usage" in rec.error, (path, body, r.status_code, rec.error)
            upstream.app.state.plan = None
            n_calls = len(await store.read_calls("r1"))
            for turns in ([*user, {"role": "assistant", "content": "x"}, {"role": "user", "content": ""}],  # (2)
                          [*user, {"role": "assistant", "content": "x"}, {"role": "user", "content": []}],
                          [{"role": "user", "content": ""}], []):
                for path in ("messages", "messages/count_tokens"):
                    r = await c.post(f"{base}/{path}", json={"model": "m", "max_tokens": 9, "messages": turns})
                    assert r.status_code == 400 and ("empty" in r.text or "at least one" in r.text), \
                        (turns, path, r.status_code, r.text[:300])
            assert len(await store.read_calls("r1")) == n_calls
            message = {"role": "assistant", "content": "hi", "reasoning_content": "REASONING"}  # (3)
            upstream.app.state.plan = ("body", 200, orjson.dumps(chat_answer("up", [1, 2, 3], [7, 8, 9, 2], message)))
            r = await c.post(f"{base}/chat/completions", json={"model": "m", "messages": user, "stream": True, "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
            assert r.status_code == 200 and "REASONING" in r.text, r.text[:500]
            for old, new in ((b'"role":"assistant","content":""', b'"role":"assistant","content":"","reasoning":{"a":1}'),
                             (b'"delta":{"content":', b'"delta":{"tool_calls":[{"index":0,"id":"c","type":"banana",'
                                                      b'"function":{"name":"f","arguments":"{}"}}],"content":')):  # (4)
                chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
                chunks = [chunks[0].replace(old, new), chunks[1].replace(old, new), *chunks[2:]]
                assert chunks[0] != chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])[0] or chunks[1] != \
                    chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])[1]
                upstream.app.state.plan = ("stream", chunks, "done")
                r = await c.post(f"{base}/chat/completions", json={"model": "m", "messages": user, "stream": True})
                assert "upstream_error" in r.text and (await _last(store)).status == "error", (new, r.text[-400:])
            upstream.app.state.plan = None
            n_engine = len(upstream.app.state.calls)
            for prompt in (["a", "b"], [[1, 2], [3]], [], 5):  # (5)
                r = await c.post(f"{base}/completions", json={"model": "m", "prompt": prompt})
                assert r.status_code == 400 and "one prompt" in r.text, (prompt, r.status_code, r.text[:300])
            assert len(upstream.app.state.calls) == n_engine
            for prompt in ("3+4?", ["3+4?"], [1, 2, 3], [[1, 2, 3]]):
                r = await c.post(f"{base}/completions", json={"model": "m", "prompt": prompt})
                assert r.status_code == 200, (prompt, r.status_code, r.text[:300])


async def test_a_replica_whose_id_was_taken_forwards_nothing(store, redis_url, prefix, upstream):
    """The third prober: a replica stopped for 5.5 s (a starved event loop: drains wait 30 s for such a late one)
    found its id taken by a new gateway when it woke, kept forwarding calls, and a drain (which saw the new one's
    status under that id) said "drained" while its call ran. The id's ownership now lasts as long as a drain waits
    for a late replica, and a replica that finds its id owned by another answers 503 to every model call and is not
    ready."""
    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url, replica_id="gw-x") as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await _one(c, gw)).status_code == 200
            assert await store.r.pttl(store.key("replica-owner", "gw-x")) > 20_000  # REPLICA_LATE_S, not 5 s
            await store.r.set(store.key("replica-owner", "gw-x"), "another-process")  # its id taken meanwhile
            for _ in range(50):
                await asyncio.sleep(0.2)
                r = await _one(c, gw)
                if r.status_code != 200:
                    break
            assert r.status_code == 503 and "replica_displaced" in r.text, (r.status_code, r.text[:300])
            assert (await c.get(f"{gw.url}/readyz")).status_code == 503
            status = await store.replica("gw-x")
            assert status is None or status.replica_id == "gw-x"  # nothing of the other's overwritten by it


async def test_what_the_third_prober_found_in_answers_and_sampling(store, redis_url, prefix, upstream):
    """The third prober: (1) reasoning or refusal text with no token ids (usage 0) was recorded ``ok`` on every route,
    and reasoning sent after a live stream's finish reason too; (2) a live stream's tool call whose ``arguments``
    chunk was ``{}``, ``0`` or ``false`` reached the agent as such while the record held ``""``; (3) a second finish
    reason replaced the first; (4) ``{"type": "auto", "disable_parallel_tool_use": false}`` and a Responses ``text``
    at its defaults were taken for constrained sampling (never trained)."""
    from agl_common.schemas import sampling_not_plain

    from fakes import chat_answer, chat_chunks

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for message in ({"role": "assistant", "content": "", "reasoning_content": "I reasoned a lot"},  # (1)
                            {"role": "assistant", "content": None, "refusal": "I refuse"}):
                answer = chat_answer("up", [1, 2, 3], [], message)
                answer["usage"]["completion_tokens"] = 0
                answer["choices"][0]["logprobs"] = None
                upstream.app.state.plan = ("body", 200, orjson.dumps(answer))
                r = await _one(c, gw)
                rec = await _last(store)
                assert rec.status == "error" and "token ids missing" in rec.error, (message, r.status_code, rec.error)
            chunks = chat_chunks("up", [1, 2, 3], [7, 8, 9, 2])
            base = orjson.loads(chunks[1][6:])
            extra = {**base, "choices": [{"index": 0, "delta": {"reasoning_content": "INJECTED"}, "logprobs": None,
                                          "finish_reason": None, "token_ids": []}]}
            second = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                           "token_ids": []}]}
            def call(fn: dict) -> dict:
                return {**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **fn}]},
                                             "logprobs": None, "finish_reason": None, "token_ids": []}]}

            good_call = call({"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}})
            for added, at in (([extra], -1), ([second], -1),  # (1) after the finish, (3)
                              ([good_call, call({"function": {"arguments": {}}})], 2),  # (2)
                              ([good_call, call({"function": {"arguments": 0}})], 2)):
                events = [*chunks]
                at = len(events) + at if at < 0 else at
                events[at:at] = [b"data: " + orjson.dumps(e) + b"\n\n" for e in added]
                upstream.app.state.plan = ("stream", events, "done")
                r = await _one(c, gw, {"stream": True})
                assert "upstream_error" in r.text and (await _last(store)).status == "error", (added, r.text[-300:])
    upstream.app.state.plan = None
    assert sampling_not_plain({"tool_choice": {"type": "auto", "disable_parallel_tool_use": False}}) is None  # (4)
    assert sampling_not_plain({"text": {"format": {"type": "text"}, "verbosity": "medium"}}) is None
    assert sampling_not_plain({"text": {"format": None}}) is None
    assert sampling_not_plain({"tool_choice": {"type": "tool", "name": "f"}}) == "tool_choice.type='tool'"
    assert sampling_not_plain({"text": {"format": {"type": "json_schema"}}}) == "text.format.type='json_schema'"


def test_what_the_fourth_prober_found_in_configs_and_urls(tmp_path):
    """The fourth prober: (1) YAML merge keys (``<<: *base``) were refused by the duplicate-key check; (2) a run's
    ``config.json`` (its ``gateway_url`` password shown as ``***``) loaded for a resume with ``***`` as the password;
    (3) ``redacted_url`` hid ``ssl_keyfile``, ``author``, ``tokenizer`` and showed a fragment's token, a user part
    that is a token and a URL without a scheme."""
    import subprocess
    import sys

    from agl_common.settings import redacted_url
    from agl_trainer.config import TrainConfig

    (tmp_path / "merge.yaml").write_text("policy_serving: adapter\nroles:\n  solver: &base {lr: 0.0001, lora_rank: 8, "
                                         "models: [a]}\n  critic: {<<: *base, lr: 0.0002, models: [b]}\n")
    roles = TrainConfig.from_yaml(tmp_path / "merge.yaml").roles
    assert (roles["critic"].lr, roles["critic"].lora_rank, roles["solver"].lr) == (0.0002, 8, 0.0001)
    shown = TrainConfig(gateway_url="http://u:pw123@127.0.0.1:8080", out_dir=str(tmp_path / "runs")).shown()
    (tmp_path / "config.json").write_text(orjson.dumps(shown).decode())
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(tmp_path / "config.json")],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 2 and "gateway_url has a secret hidden" in out.stderr, out.stderr[-1000:]
    assert redacted_url("rediss://h/0?ssl_keyfile=/k.pem&tokenizer=t&author=a&accessToken=z") == \
        "rediss://h/0?ssl_keyfile=/k.pem&tokenizer=t&author=a&accessToken=***"
    assert redacted_url("http://h/#access_token=S") == "http://h/#***"
    assert redacted_url("http://ghp_T0K@h:8") == "http://***@h:8"
    assert redacted_url("user:SECRET@127.0.0.1:8080") == "***@127.0.0.1:8080"
