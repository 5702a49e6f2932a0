"""``agl-trainer rollouts export`` (issue 17): three shapes, two formats, filters; Parquet read back with
``datasets.load_dataset``."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from agl_common.schemas import CallRecord, GroupInfo, Rollout, RolloutStatus
from agl_common.store import Store
from agl_trainer.cli import app

pytestmark = pytest.mark.integrations

RUN = "1201-000000-abcd"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def chat(rid: str, seq: int, messages: list, reply: dict, prompt: list[int], response: list[int], tools=None,
         route: str = "chat") -> CallRecord:
    request = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    return CallRecord(rollout_id=rid, attempt_id="0", seq=seq, route=route, request=request,
                      response={"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]},
                      prompt_token_ids=prompt, response_token_ids=response,
                      response_logprobs=[-0.5] * len(response), finish_reason="stop")


async def seed(redis_url: str, prefix: str) -> None:
    """Run RUN: group g0 = r0 (reward 1, two chained calls with a tool call) and r1 (reward 0, one call);
    group g1 = r2 (failed). Another run's rollout (reward 1) must never show up with ``--run RUN``."""
    store = Store(redis_url, prefix)
    q = {"role": "user", "content": "What is 3 + 4?"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "7"}
    final = {"role": "assistant", "content": "7"}
    plan = {
        f"{RUN}-g0-0": (RolloutStatus.succeeded, 1.0, [
            chat(f"{RUN}-g0-0", 0, [q], call, [1, 2, 3], [10, 11, 2], TOOLS),
            chat(f"{RUN}-g0-0", 1, [q, call, tool], final, [1, 2, 3, 10, 11, 2, 5, 6], [7, 2], TOOLS)]),
        f"{RUN}-g0-1": (RolloutStatus.succeeded, 0.0, [
            chat(f"{RUN}-g0-1", 0, [{"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?"}]}],
                 {"role": "assistant", "content": "8"}, [1, 2, 3], [8, 2])]),
        f"{RUN}-g1-0": (RolloutStatus.failed, None, [
            chat(f"{RUN}-g1-0", 0, [q], {"role": "assistant", "content": "?"}, [1, 2, 4], [9])]),
        "other-run-g0-0": (RolloutStatus.succeeded, 1.0, [
            chat("other-run-g0-0", 0, [q], final, [1], [7, 2])]),
    }
    try:
        for rid, (status, reward, calls) in plan.items():
            group = rid.rsplit("-", 1)[0]
            await store.create_rollout(Rollout(rollout_id=rid, input={"q": 1}, group_id=group), enqueue=False)
            await store.set_status(rid, RolloutStatus.running)
            for c in calls:
                await store.record_call(c)

            def change(r, reward=reward):
                r.reward = reward
            await store.update_rollout(rid, change)
            await store.set_status(rid, status, None if status == RolloutStatus.succeeded else "exit_code:1")
        groups: dict[str, list[str]] = {}
        for rid in plan:  # registered as the trainer's scheduler registers its groups
            groups.setdefault(rid.rsplit("-", 1)[0], []).append(rid)
        for gid, ids in groups.items():
            await store.register_group(GroupInfo(group_id=gid, rollout_ids=ids, run=gid.rsplit("-g", 1)[0]))
    finally:
        await store.close()


@pytest.fixture
def recorded(redis_url, prefix):
    asyncio.run(seed(redis_url, prefix))
    return ["--redis", redis_url, "--prefix", prefix]


def export(opts: list[str], *args: str):
    res = CliRunner().invoke(app, ["rollouts", "export", *args, *opts])
    return res


def jsonl(res) -> list[dict]:
    assert res.exit_code == 0, res.output
    return [json.loads(x) for x in res.stdout.splitlines() if x.strip()]


def test_calls_shape_is_todays_records_with_filters(recorded):
    calls = jsonl(export(recorded, "--run", RUN))
    assert [(c["rollout_id"], c["seq"]) for c in calls] == [(f"{RUN}-g0-0", 0), (f"{RUN}-g0-0", 1),
                                                            (f"{RUN}-g0-1", 0), (f"{RUN}-g1-0", 0)]
    assert calls[1]["prompt_token_ids"] == [1, 2, 3, 10, 11, 2, 5, 6] and calls[1]["response_logprobs"] == [-0.5] * 2
    assert {c["rollout_id"] for c in jsonl(export(recorded, "--run", RUN, "--status", "failed"))} == {f"{RUN}-g1-0"}
    rich = {c["rollout_id"] for c in jsonl(export(recorded, "--min-reward", "0.5"))}
    assert rich == {f"{RUN}-g0-0", "other-run-g0-0"}
    assert {c["rollout_id"] for c in jsonl(export(recorded, "--rollout", f"{RUN}-g0-1"))} == {f"{RUN}-g0-1"}


def test_rows_shape_is_what_trains(recorded):
    rows = jsonl(export(recorded, "--run", RUN, "--shape", "rows"))
    # the failed rollout never trains; r0's two calls merge into one row (its 2nd prompt extends the 1st call)
    assert [(r["rollout_id"], r["row"]) for r in rows] == [(f"{RUN}-g0-0", 0), (f"{RUN}-g0-1", 0)]
    r0, r1 = rows
    assert r0["prompt_ids"] == [1, 2, 3] and r0["response_ids"] == [10, 11, 2, 5, 6, 7, 2]
    assert r0["response_mask"] == [1, 1, 1, 0, 0, 1, 1] and r0["logprobs"] == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2
    assert r0["n_calls"] == 2 and r0["group_id"] == f"{RUN}-g0"
    # GRPO, std-normalized, within group g0 (rewards 1 and 0): +/- 1/std(unbiased) = +/- 0.7071
    assert r0["advantage"] == pytest.approx(0.7071, abs=1e-3) and r1["advantage"] == pytest.approx(-0.7071, abs=1e-3)


def test_rows_of_one_rollout_get_the_advantage_its_group_gave_it(recorded, tmp_path):
    """The rows shape is built by training's own code over the rollout's whole group: one rollout exported
    alone keeps its group's advantage (it was 0: a group of one), and the run's settings apply."""
    (row,) = jsonl(export(recorded, "--rollout", f"{RUN}-g0-1", "--shape", "rows"))
    assert row["rollout_id"] == f"{RUN}-g0-1" and row["advantage"] == pytest.approx(-0.7071, abs=1e-3)
    strict = tmp_path / "config.json"  # a run's config.json: a group needs 3 succeeded rollouts to train
    strict.write_text(json.dumps({"min_group_size": 3, "group_size": 8}))
    assert jsonl(export(recorded, "--run", RUN, "--shape", "rows", "--config", str(strict))) == []
    rows = jsonl(export(recorded, "--run", RUN, "--shape", "rows", "--config", str(tmp_path / "row.yaml"))
                 if (tmp_path / "row.yaml").write_text("advantage: rloo\n") else None)
    assert [r["advantage"] for r in rows] == pytest.approx([1.0, -1.0])  # RLOO: 1 - 0, 0 - 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("advantage_level: episode\n")
    res = export(recorded, "--run", RUN, "--shape", "rows", "--config", str(bad))
    assert res.exit_code == 2 and "invalid config" in res.output and "advantage_level" in res.output


def test_messages_shape_is_sft_ready(recorded):
    convs = jsonl(export(recorded, "--run", RUN, "--shape", "messages", "--status", "succeeded"))
    assert [c["rollout_id"] for c in convs] == [f"{RUN}-g0-0", f"{RUN}-g0-1"]
    c0 = convs[0]
    assert [m["role"] for m in c0["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert c0["messages"][1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 3, "b": 4}'}
    assert c0["messages"][2]["tool_call_id"] == "c1" and c0["messages"][3]["content"] == "7"
    assert c0["tools"] == TOOLS and c0["n_calls"] == 2 and c0["reward"] == 1.0
    assert convs[1]["messages"][0]["content"] == "What is 3 + 4?"  # list-of-parts content as text


@pytest.mark.parametrize("shape,expected", [("calls", 4), ("rows", 2), ("messages", 3)])
def test_parquet_loads_back_with_datasets(recorded, tmp_path, shape, expected):
    from datasets import load_dataset

    out = tmp_path / f"{shape}.parquet"
    res = export(recorded, "--run", RUN, "--shape", shape, "--format", "parquet", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert f"{expected} {shape} record(s)" in res.stderr
    ds = load_dataset("parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == expected
    want = jsonl(export(recorded, "--run", RUN, "--shape", shape))
    if shape == "calls":
        assert ds["seq"] == [w["seq"] for w in want]
        assert ds["response_token_ids"] == [w["response_token_ids"] for w in want]
        assert json.loads(ds[0]["request"]) == want[0]["request"]  # free-form JSON travels as text
    elif shape == "rows":
        assert set(ds.column_names) >= {"prompt_ids", "response_ids", "response_mask", "logprobs", "advantage",
                                        "rollout_id", "group_id"}
        assert ds["response_mask"] == [w["response_mask"] for w in want]
        assert ds["advantage"] == pytest.approx([w["advantage"] for w in want])
    else:
        assert ds[0]["messages"] == want[0]["messages"] and json.loads(ds[0]["tools"]) == TOOLS


def test_bad_export_options_are_clear(recorded, tmp_path):
    res = export(recorded, "--format", "parquet")
    assert res.exit_code == 2 and "give --out FILE.parquet" in res.output
    res = export(recorded, "--status", "done")
    assert res.exit_code == 2 and "invalid --status 'done'" in res.output
    res = export(recorded, "--shape", "trajectories")
    assert res.exit_code == 2 and "invalid --shape" in res.output
    res = export(recorded, "--run", "nothing-", "--format", "parquet", "--out", str(tmp_path / "x.parquet"))
    assert res.exit_code == 1 and "no record matched" in res.output and not (tmp_path / "x.parquet").exists()
    res = export(recorded, "--rollout", "nope")
    assert res.exit_code == 1 and "unknown rollout 'nope'" in res.output
    for fmt in ("jsonl", "parquet"):  # a FileNotFoundError traceback before
        res = export(recorded, "--format", fmt, "--out", str(tmp_path / "no" / "such" / f"x.{fmt}"))
        assert res.exit_code == 2 and "does not exist" in res.output and not (tmp_path / "no").exists()


def test_parquet_without_datasets_says_what_to_install(monkeypatch, tmp_path):
    import sys

    from agl_trainer.export import ExportError, write

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ExportError, match="pip install datasets"):
        write([{"a": 1}], "calls", "parquet", tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
