"""Round 16 of hostile input (docs/operations.md, "A sixteenth round"): each test failed before its fix."""

from __future__ import annotations

import asyncio
import json

import pytest
from agl_common.schemas import GroupInfo, Rollout, RolloutStatus
from agl_common.store import Store
from typer.testing import CliRunner

from agl_trainer.cli import app

from test_controller import gateway_url  # noqa: F401 (fixture)
from test_gateway import upstream  # noqa: F401 (fixture)

RUN = "1206-000000-abcd"


async def _seed(redis_url: str, prefix: str) -> None:
    """Run RUN: a trained group and an evaluation group (owner None) named after the run; and a group of another
    run whose ids start with RUN (a hand-made id), which ``--run RUN`` counted before (it selected by id prefix)."""
    store = Store(redis_url, prefix)
    try:
        for gid, owner, run in ((f"{RUN}-q0-g0", RUN, RUN), (f"{RUN}-eval-before-ab12-g0", None, RUN),
                                (f"{RUN}-intruder-g0", "someone", "someone")):
            ids = [f"{gid}-{i}" for i in range(2)]
            await store.register_group(GroupInfo(group_id=gid, rollout_ids=ids, owner=owner, run=run))
            for rid in ids:
                await store.create_rollout(Rollout(rollout_id=rid, group_id=gid, status=RolloutStatus.succeeded,
                                                   reward=1.0), enqueue=False)
    finally:
        await store.close()


def test_a_run_is_its_registered_groups_not_an_id_prefix(redis_url, prefix):
    """Round 15 left open: ``rollouts list/export --run`` selected every rollout whose id started with the run id, so
    another run's rollout named ``{run}-...`` was listed and exported as this run's. Now a run is the groups
    registered with it (evaluations included)."""
    asyncio.run(_seed(redis_url, prefix))
    opts = ["--redis", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(app, ["rollouts", "list", "--run", RUN, "--json", "--limit", "0", *opts])
    assert res.exit_code == 0, res.output
    listed = [json.loads(line)["rollout_id"] for line in res.stdout.splitlines()]
    assert listed == [f"{RUN}-q0-g0-0", f"{RUN}-q0-g0-1", f"{RUN}-eval-before-ab12-g0-0",
                      f"{RUN}-eval-before-ab12-g0-1"]  # creation order
    res = CliRunner().invoke(app, ["rollouts", "list", "--run", "someone", "--json", *opts])
    assert [json.loads(line)["rollout_id"] for line in res.stdout.splitlines()] == [f"{RUN}-intruder-g0-0",
                                                                                  f"{RUN}-intruder-g0-1"]
    res = CliRunner().invoke(app, ["rollouts", "export", "--run", RUN, "--rollout", f"{RUN}-intruder-g0-0", *opts])
    assert res.stdout == "" and "no rollout matched --rollout" in res.stderr  # not a member of RUN
    res = CliRunner().invoke(app, ["rollouts", "list", "--run", "no-such-run", "--json", *opts])
    assert res.exit_code == 0 and res.stdout == ""


async def test_a_group_is_registered_with_its_run_once(store):
    """The run's set is written by the script that registers the group: a group registered again (refused) adds
    nothing to a second run, and a group with no run is in none."""
    await store.register_group(GroupInfo(group_id="g1", rollout_ids=["g1-0"], run="r1"))
    with pytest.raises(ValueError, match="already exists"):
        await store.register_group(GroupInfo(group_id="g1", rollout_ids=["g1-0"], run="r2"))
    await store.register_group(GroupInfo(group_id="g2", rollout_ids=["g2-0"]))
    for rid, gid in (("g1-0", "g1"), ("g2-0", "g2")):
        await store.create_rollout(Rollout(rollout_id=rid, group_id=gid), enqueue=False)
    assert (await store.run_rollout_ids("r1"), await store.run_rollout_ids("r2")) == (["g1-0"], [])
    with pytest.raises(ValueError, match="run id may hold only"):
        GroupInfo(group_id="g3", rollout_ids=[], run="a}b")  # a run id is part of a key: a rollout id's rules


def test_eval_starts_its_controller_with_preload(monkeypatch, tmp_path):
    """Round 15 left open: nothing checked that ``agl-trainer eval`` starts its controller with the config's
    ``preload`` (train does, through the shared ``start_agents``)."""
    from agl_trainer import stack
    from agl_trainer.config import TrainConfig
    from agl_trainer.evaluation import EvalPolicy, run_eval
    from agl_trainer.services import Services

    seen = {}

    class Started(Exception):
        pass

    def start_controller(self, *args, **kwargs):
        seen["preload"] = args[9] if len(args) > 9 else kwargs.get("preload")
        raise Started

    monkeypatch.setattr(Services, "ensure_redis",
                        lambda self, url, harness_user=None: url or "redis://127.0.0.1:6379/0")
    monkeypatch.setattr(Services, "start_gateway", lambda self, *a, **k: "http://127.0.0.1:9")
    monkeypatch.setattr(Services, "start_controller", start_controller)
    monkeypatch.setattr(stack, "start_engine", lambda *a, **k: ("http://127.0.0.1:9/v1", None))
    cfg = TrainConfig(preload=["agents", "json"], out_dir=str(tmp_path), eval_size=1)
    with pytest.raises(Started):
        run_eval(cfg, EvalPolicy("base", 0))
    assert seen["preload"] == ["agents", "json"]


# ------------------------------------------------------------------ the gateway: one verdict on every route
ROUTES = (("chat/completions", {}), ("messages", {"max_tokens": 50}), ("responses", "input"))


def _answer(change) -> bytes:
    import orjson
    from fakes import chat_answer

    a = chat_answer("up", [1, 3], [7, 8, 9, 2])
    change(a, a["choices"][0]["message"], a["choices"][0])
    return orjson.dumps(a)


def _tool_calls(msg, choice, calls):
    msg.update(content=None, tool_calls=calls)
    choice["finish_reason"] = "tool_calls"


def _call(i: str, name: str) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": "{}"}}


BAD_ANSWERS = {
    # chat passed these on (200, ok); Anthropic and Responses refused them at translation (502)
    "id a number": lambda a, m, c: a.__setitem__("id", 5),
    "created a string": lambda a, m, c: a.__setitem__("created", "yesterday"),
    "system_fingerprint an object": lambda a, m, c: a.__setitem__("system_fingerprint", {}),
    "annotations a number": lambda a, m, c: m.__setitem__("annotations", 5),
    "audio a number": lambda a, m, c: m.__setitem__("audio", 5),
    "function_call a number": lambda a, m, c: m.__setitem__("function_call", 5),
    # two tool calls the agent cannot answer apart
    "two tool calls of one id": lambda a, m, c: _tool_calls(m, c, [_call("c1", "f"), _call("c1", "g")]),
    # a logprob entry the agent's SDK cannot read (it asked for logprobs)
    "logprob token a number": lambda a, m, c: c["logprobs"]["content"][0].__setitem__("token", 5),
    "top_logprobs a number": lambda a, m, c: c["logprobs"]["content"][0].__setitem__("top_logprobs", 5),
    "bytes a string": lambda a, m, c: c["logprobs"]["content"][0].__setitem__("bytes", "x"),
}
GOOD_ANSWERS = {
    "reasoning only": lambda a, m, c: m.update(content=None, reasoning_content="thinking"),
    "refusal only": lambda a, m, c: m.update(content=None, refusal="no"),
    "one tool call, finish stop (a named tool_choice)": lambda a, m, c: m.update(content=None,
                                                                                 tool_calls=[_call("c1", "f")]),
    "empty content": lambda a, m, c: m.__setitem__("content", ""),
    # vLLM's reasoning parsers give a null content (and reasoning) for an empty visible output (a lone </think>)
    "null content": lambda a, m, c: m.__setitem__("content", None),
    "legacy function_call": lambda a, m, c: (m.update(content=None, function_call={"name": "f", "arguments": "{}"}),
                                             c.__setitem__("finish_reason", "function_call")),
}


async def test_an_answer_gets_one_verdict_on_every_route(store, redis_url, prefix, upstream):  # noqa: F811
    """Round 16: each bad answer is a 502 and an ``error`` record on chat, Anthropic and Responses alike; before,
    chat answered 200 (``ok``) where the translated routes refused. The good ones pass everywhere. A chat stream's
    chunks get the same envelope and logprob-entry checks."""
    import httpx
    from test_gateway import gateway, make_rollout
    from test_hostile6 import _last

    n = 0
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for cases, want in ((BAD_ANSWERS, (502, "error")), (GOOD_ANSWERS, (200, "ok"))):
                for name, change in cases.items():
                    upstream.app.state.plan = ("body", 200, _answer(change))
                    for path, extra in ROUTES:
                        n += 1
                        await make_rollout(store, f"r{n}")
                        body = {"model": "agent-model", "logprobs": True}
                        body |= {"input": "hi"} if extra == "input" else {
                            "messages": [{"role": "user", "content": "hi"}], **extra}
                        r = await c.post(f"{gw.url}/rollouts/r{n}/attempts/0/v1/{path}", json=body)
                        rec = await _last(store, f"r{n}")
                        assert (r.status_code, rec.status) == want, (name, path, extra, r.status_code, r.text[:200])
            for field, value, want in (("id", 5, "error"), ("created", "yesterday", "error"),
                                       ("system_fingerprint", {}, "error"), ("id", "chatcmpl-1", "ok"),
                                       ("token", 5, "error"), ("bytes", "x", "error"), ("bytes", [55], "ok")):
                n += 1
                await make_rollout(store, f"r{n}")
                upstream.app.state.plan = ("stream", _chunks_with(field, value), "done")
                await c.post(f"{gw.url}/rollouts/r{n}/attempts/0/v1/chat/completions",
                             json={"model": "agent-model", "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]})
                assert (await _last(store, f"r{n}")).status == want, (field, value)
    upstream.app.state.plan = None


def _chunks_with(field: str, value) -> list[bytes]:
    """A chat stream whose second chunk has ``field`` set to ``value``."""
    import orjson
    from fakes import chat_chunks

    chunks = chat_chunks("up", [1, 2, 3], [7, 8, 2])
    ev = orjson.loads(chunks[1][len(b"data: "):])
    if field in ("token", "bytes"):  # a field of the chunk's logprob entry
        ev["choices"][0]["logprobs"]["content"][0][field] = value
    else:
        ev[field] = value
    return [chunks[0], b"data: " + orjson.dumps(ev) + b"\n\n", *chunks[2:]]


async def test_a_streamed_tool_call_that_changes_its_id_is_refused(store, redis_url, prefix, upstream):  # noqa: F811
    """Round 16: a tool call whose id changed between chunks (``call_A`` then ``call_B``) was recorded ``ok`` with
    ``call_B``, while the OpenAI SDK's accumulator joins the two (``call_Acall_B``): the agent answers a call the
    record never made."""
    import httpx
    import orjson
    from fakes import chat_chunks
    from test_gateway import gateway, make_rollout
    from test_hostile6 import _last

    chunks = chat_chunks("up", [1, 2, 3], [7, 8, 2])

    def with_ids(*ids: str) -> list[bytes]:
        out = [chunks[0]]
        for k, raw in enumerate(chunks[1:4]):
            ev = orjson.loads(raw[len(b"data: "):])
            ch = ev["choices"][0]
            ch["delta"] = {"tool_calls": [{"index": 0, **({"id": ids[k]} if k < len(ids) else {}),
                                           "function": {"name": "f" if k == 0 else None, "arguments": "{}"[k:k + 1]}}]}
            ch["finish_reason"] = "tool_calls" if k == 2 else None
            out.append(b"data: " + orjson.dumps(ev) + b"\n\n")
        return out + chunks[4:]

    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for n, (ids, want) in enumerate(((("call_A", "call_B"), "error"), (("call_A",), "ok"))):
                await make_rollout(store, f"s{n}")
                upstream.app.state.plan = ("stream", with_ids(*ids), "done")
                await c.post(f"{gw.url}/rollouts/s{n}/attempts/0/v1/chat/completions",
                             json={"model": "agent-model", "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]})
                rec = await _last(store, f"s{n}")
                assert rec.status == want, (ids, rec.error)
    upstream.app.state.plan = None


# ------------------------------------------------------------------ the controller and the store
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_harness_killed_under_a_shell_fails_as_one_killed_directly(sig):
    """Round 16: ``bash run.sh`` (the usual wrapper) reports a killed child as exit 128 + N, so a SIGKILLed harness
    was ``exit_code:137`` (not retried by the default ``retry_on``) where the same harness started directly was
    ``oom_killed`` (retried)."""
    import subprocess
    import sys

    from agl_controller.local import _outcome

    kill = f"import os, signal; os.kill(os.getpid(), signal.{sig})"
    direct = subprocess.run([sys.executable, "-c", kill]).returncode
    shell = subprocess.run(["bash", "-c", f"{sys.executable} -c '{kill}'; exit $?"]).returncode
    assert shell > 128 and direct < 0
    assert _outcome(shell) == _outcome(direct) == ("oom_killed" if sig == "SIGKILL" else "signal:15")
    assert (_outcome(1), _outcome(128), _outcome(255)) == ("exit_code:1", "exit_code:128", "exit_code:255")


async def test_a_record_with_a_nan_is_refused_not_written_unreadable(store):
    """Round 16: a NaN (or infinity) in a call record was written as JSON ``null``, and every ``read_calls`` of that
    rollout then raised. The record is refused before anything is written."""
    from agl_common.schemas import CallRecord

    await store.create_rollout(Rollout(rollout_id="r1", status=RolloutStatus.running), enqueue=False)
    for bad in ({"latency_ms": float("nan")}, {"started_at": float("inf")},
                {"response_token_ids": [5], "response_logprobs": [float("nan")]}):
        with pytest.raises(ValueError, match="finite"):
            await store.record_call(CallRecord(rollout_id="r1", attempt_id="0", seq=-1, route="chat", request={},
                                               response={}, **bad))
    await store.record_call(CallRecord(rollout_id="r1", attempt_id="0", seq=-1, route="chat", request={},
                                       response={}))
    assert [c.seq for c in await store.read_calls("r1")] == [0]


async def test_what_a_run_leaves_behind_cannot_overrule_the_judge(store, gateway_url, tmp_path, monkeypatch):
    """Round 16: a process the harness left behind (setsid, a double fork: a model's shell tool can) kept the
    attempt's key until the attempt ended. (1) The judge's reward was written in one step and the attempt ended in
    a later one: its reward posted between the two stood, under ``--reward-fn-always`` (3 of 8 in a probe).
    (2) Its model calls recorded while the judge ran were trained with the judge's reward, on an answer it never
    saw. Now the judge's reward is written in the step that ends the attempt, and that step requires the calls
    the judge saw to be all there are (else ``calls_after_exit``)."""
    from pathlib import Path

    from test_controller import run

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    inputs = {f"spam{i}": {"calls": 1, "left_behind": "reward", "judge_s": 0.3} for i in range(4)}
    inputs["late"] = {"calls": 1, "reward": 1.0, "left_behind": "calls", "judge_s": 1.5}
    out = await run(store, gateway_url, tmp_path, inputs, reward_fn="rewards:slow", reward_fn_always=True)
    for i in range(4):
        r = out[f"spam{i}"]
        assert (r.status, r.reward, r.reward_message) == (RolloutStatus.succeeded, 1.0, None), r
    assert (out["late"].status, out["late"].failure) == (RolloutStatus.failed, "calls_after_exit")
    assert len(await store.read_calls("late")) > 1


async def test_the_store_refuses_what_the_gateway_never_writes(store, tmp_path):
    """Round 16: ``Store.record_call`` (in-process writers) took ``ok`` records with 4 response ids and 2 logprobs,
    a logprob of 5.0, ids of 2**64 (an export then ended in an ``OverflowError``); a ``Rollout`` with
    ``created_at=inf`` was written as ``null`` and every listing of the prefix failed from then on; a task input
    holding NaN was stored as ``null``. Each is refused before anything is written."""
    from agl_common.schemas import CallRecord
    from agl_trainer.tasks import TaskError, load_tasks

    await store.create_rollout(Rollout(rollout_id="r1", status=RolloutStatus.running), enqueue=False)
    base = {"rollout_id": "r1", "attempt_id": "0", "seq": -1, "route": "chat", "request": {}, "response": {},
            "prompt_token_ids": [1, 2]}
    for bad, says in (({"response_token_ids": [5, 6, 7, 8], "response_logprobs": [-0.1, -0.2]}, "2 logprobs for 4"),
                      ({"response_token_ids": [5], "response_logprobs": [5.0]}, "not a log-probability"),
                      ({"response_token_ids": [2**64 + 5], "status": "error"}, "out of range"),
                      ({"response_token_ids": [-5]}, "out of range")):
        with pytest.raises(ValueError, match=says):
            await store.record_call(CallRecord(**base, **bad))
    assert await store.read_calls("r1") == []
    # an error record may say why its logprobs are odd; an ok one without logprobs is the gateway's "no logprobs"
    await store.record_call(CallRecord(**base, response_token_ids=[5], response_logprobs=[-0.1, 0.0],
                                       status="error", error="x"))
    for bad in ({"created_at": float("inf")}, {"reward": float("nan")}, {"ended_at": float("-inf")}):
        with pytest.raises(ValueError, match="finite"):
            Rollout(rollout_id="r2", **bad)
    with pytest.raises(ValueError, match="finite"):
        GroupInfo(group_id="g", rollout_ids=[], created_at=float("nan"))
    (tmp_path / "nan_task.py").write_text("def train_problems():\n    return [{'answer': float('nan')}]\n")
    with pytest.raises(TaskError, match="item 0 .*NaN or infinity"):
        load_tasks(tmp_path / "nan_task.py", "train_problems")


async def test_a_harness_cannot_post_the_controllers_events(store, redis_url, prefix, upstream):  # noqa: F811
    """Round 16: a harness posted ``reward_replaced {"reward_fn": 1.0}`` and ``attempt_failed {"failure":
    "oom_killed"}`` beside the controller's own, which nothing told apart. Those types are the controller's: 400."""
    import httpx
    from agl_common.schemas import CONTROLLER_EVENTS
    from test_gateway import gateway, make_rollout

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for kind in sorted(CONTROLLER_EVENTS):
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/events", json={"type": kind, "data": {}})
                assert r.status_code == 400 and "controller's" in r.text, (kind, r.status_code, r.text)
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/events", json={"type": "tool_result", "data": {}})
            assert r.status_code == 200, r.text
    assert [e["type"] for e in await store.read_events("r1")] == ["tool_result"]


def test_a_misspelt_harness_script_or_module_is_one_line_before_anything_starts(tmp_path, monkeypatch, redis_url):
    """Round 16: ``python examples/arithmetic/agnet.py`` (and ``python -m not_a_module``, a directory) passed every
    start-up check: each run then failed ``spawn_error`` (retried) or ``exit_code:1``, a train run only after vLLM
    had started. Now the trainer's check and ``agl-controller run`` refuse it at once."""
    import sys

    from agl_controller.cli import app as controller_app
    from agl_trainer.config import TrainConfig
    from agl_trainer.tasks import TaskError, check_controller_imports

    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text("print('hi')\n")
    (tmp_path / "agents").mkdir()
    for command, says in (("python agnet.py", "agnet.py' is not a file"), ("python agents", "agents' is not a file"),
                          ("python -m not_a_module_xyz", "not_a_module_xyz' is not found")):
        with pytest.raises(TaskError, match=says):
            check_controller_imports(TrainConfig(command=command, preload=[]))
        argv = f"{sys.executable} " + command.partition(" ")[2]
        res = CliRunner().invoke(controller_app, ["run", "--mode", "local", "--command", argv, "--redis", redis_url,
                                                  "--gateway", "http://127.0.0.1:9"])
        assert res.exit_code == 2 and says in res.output, res.output
    (tmp_path / "agents" / "__main__.py").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text("#!/bin/sh\n")  # another Python: its modules are its own
    (tmp_path / "bin" / "python3").chmod(0o755)
    for fine in ("python agent.py", "python agents", "python -m json", "python -m json.tool",
                 f"{tmp_path}/bin/python3 -m only_there"):
        check_controller_imports(TrainConfig(command=fine, preload=[]))


def test_an_out_dir_that_takes_no_run_directory_is_one_line(tmp_path):
    """Round 16: ``out_dir: /proc`` exists, so the start-up check passed, and making the run's directory in it was
    a ``FileNotFoundError`` traceback. The check now makes (and removes) a directory there first."""
    import subprocess
    import sys
    from pathlib import Path

    cfg = tmp_path / "proc.yaml"
    cfg.write_text("out_dir: /proc\n")
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "out_dir /proc" in out.stderr, out.stderr[-800:]
    assert not list(Path(tmp_path).glob(".agl-check-*"))


async def test_a_reward_or_event_body_giving_a_key_twice_is_refused(store, redis_url, prefix, upstream):  # noqa: F811
    """Round 16: ``{"value": 1, "value": 2}`` was a reward of 2 (the last key won), where ``rollouts create --input``
    refuses a key given twice. The reward and event routes now refuse it too (400), nothing written."""
    import httpx
    from test_gateway import gateway, make_rollout

    await make_rollout(store, "r1")
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            for path, raw in (("reward", b'{"value": 1, "value": 2}'),
                              ("events", b'{"type": "t", "data": {"a": 1, "a": 2}}')):
                r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/{path}", content=raw,
                                 headers={"content-type": "application/json"})
                assert r.status_code == 400 and "given twice" in r.text, (path, r.status_code, r.text)
    assert (await store.get_rollout("r1")).reward is None and await store.read_events("r1") == []


async def test_a_late_error_record_fails_no_run_and_calls_after_exit_can_be_retried(store, gateway_url, tmp_path,
                                                                                    monkeypatch):
    """Review of round 16: an abandoned call's ``error`` record (the agent went away; the gateway records it when
    the engine answers) landing after the harness exited made a good run ``calls_after_exit``; error records train
    nothing, so the run succeeds. ``calls_after_exit`` is a reason ``--retry-on`` takes, and is retried."""
    from pathlib import Path

    from agl_common.schemas import CallRecord
    from agl_controller.base import check_retry_on
    from test_controller import run

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))

    async def late_error_record():
        while await store.count_calls("abandon", "0") < 1:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.8)  # the harness has exited; the judge (1.5 s) runs
        await store.record_call(CallRecord(rollout_id="abandon", attempt_id="0", seq=-1, route="chat", request={},
                                           response=None, status="error", error="abandoned"))

    writer = asyncio.ensure_future(late_error_record())
    out = await run(store, gateway_url, tmp_path, {"abandon": {"calls": 1, "judge_s": 1.5}}, reward_fn="rewards:slow")
    await writer
    assert (out["abandon"].status, out["abandon"].reward) == (RolloutStatus.succeeded, 1.0), out["abandon"]
    assert len(await store.read_calls("abandon")) == 2
    retry = check_retry_on(["calls_after_exit"])
    out = await run(store, gateway_url, tmp_path, {"late": {"calls": 1, "reward": 1.0, "left_behind": "calls",
                                                            "judge_s": 1.0}},
                    reward_fn="rewards:slow", reward_fn_always=True, retry_on=retry, max_attempts=2)
    assert (out["late"].status, out["late"].attempt_id) == (RolloutStatus.queuing, "1")  # retried (queued again)
    assert [(e["type"], e["data"]) for e in await store.read_events("late")] == [
        ("attempt_failed", {"failure": "calls_after_exit"})]
