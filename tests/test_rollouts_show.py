"""``agl-trainer rollouts show``: a multi-row rollout made readable, which calls merged into which row and the
merge break that started each later row (the dashboard's own analysis, :func:`agl_trainer.ui.traces.analyse`)."""

from __future__ import annotations

import asyncio
import json

import pytest
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from agl_common.store import Store
from agl_trainer.cli import app
from typer.testing import CliRunner


def call(seq: int, prompt: list[int], response: list[int], attempt: str = "0") -> CallRecord:
    return CallRecord(rollout_id="team-0", attempt_id=attempt, seq=seq, route="chat", request={"model": "m"},
                      response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                             "finish_reason": "stop"}]},
                      prompt_token_ids=prompt, response_token_ids=response,
                      response_logprobs=[-0.5] * len(response), finish_reason="stop")


async def seed(redis_url: str, prefix: str) -> None:
    """A solver call, a retry that extends it exactly (one row), then a checker with its own instructions (its
    prompt diverges at token 0: a second row); plus a call of an earlier attempt, never trained."""
    store = Store(redis_url, prefix)
    try:
        await store.create_rollout(Rollout(rollout_id="team-0", input={"q": 1}), enqueue=False)
        await store.set_status("team-0", RolloutStatus.running)
        await store.record_call(call(0, [1, 2, 3], [8], attempt="0"))
        await store.update_rollout("team-0", lambda r: setattr(r, "attempt_id", "1"))
        for c in (call(0, [1, 2, 3], [4, 2], "1"), call(1, [1, 2, 3, 4, 2, 5], [6, 2], "1"),
                  call(2, [9, 9], [7, 2], "1")):
            await store.record_call(c)
    finally:
        await store.close()


@pytest.fixture
def opts(redis_url, prefix):
    asyncio.run(seed(redis_url, prefix))
    return ["--redis", redis_url, "--prefix", prefix, "--tokenizer", "none"]


def test_show_says_which_calls_made_which_row_and_why_a_row_broke(opts):
    res = CliRunner().invoke(app, ["rollouts", "show", "team-0", *opts])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "call 1/0 chat ok prompt=3 response=2 tokens, v0, 0 ms → row 0" in out
    assert "call 1/1 chat ok prompt=6 response=2 tokens, v0, 0 ms → row 0" in out
    assert "call 1/2 chat ok prompt=2 response=2 tokens, v0, 0 ms → row 1" in out
    assert "call 0/0 chat ok prompt=3 response=1 tokens, v0, 0 ms (not trained: an earlier attempt)" in out
    assert "row 0: calls 0, 1 (2 merged), prompt 3 tokens, response 5 (4 sampled); first call" in out
    assert ("row 1: calls 2 (1 merged), prompt 2 tokens, response 2 (2 sampled); merge break before it: other at "
            "token 0 (call 2's prompt of 2 tokens does not extend row 0's 8)") in out

    res = CliRunner().invoke(app, ["rollouts", "show", "team-0", "--json", *opts])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    assert [r["seqs"] for r in shown["rows"]] == [[0, 1], [2]] and len(shown["calls"]) == 4
    assert shown["rows"][0]["merge_break"] is None
    assert shown["rows"][1]["merge_break"] == {"class": "other", "seq": 2, "position": 0, "row_tokens": 8,
                                               "prompt_tokens": 2}


def test_show_with_the_runs_settings_and_bad_input(opts, tmp_path):
    (tmp_path / "c.yaml").write_text("aggregation: transition\n")
    res = CliRunner().invoke(app, ["rollouts", "show", "team-0", "--json", "--config", str(tmp_path / "c.yaml"), *opts])
    assert res.exit_code == 0, res.output
    assert [r["seqs"] for r in json.loads(res.stdout)["rows"]] == [[0], [1], [2]]  # one row per call
    res = CliRunner().invoke(app, ["rollouts", "show", "team-0", *opts[:4], "--tokenizer", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no tokenizer in" in res.output
    res = CliRunner().invoke(app, ["rollouts", "show", "nobody", *opts])
    assert res.exit_code == 1 and "unknown rollout 'nobody'" in res.output


def test_show_and_the_dashboard_list_the_harness_events(opts, redis_url, prefix, tmp_path):
    """Round 11 left open: harness events (``POST .../events``) were stored but no CLI or page showed them.
    ``rollouts show`` lists the last 50 (``--json``: all) with control characters escaped; the rollout's page lists
    the same, markup escaped."""
    from fastapi.testclient import TestClient
    from agl_trainer.ui.server import create_app

    async def post() -> None:
        store = Store(redis_url, prefix)
        try:
            await store.add_event("team-0", "1", "tool\x1b[31m", {"name": "<script>x</script>", "ok": True})
            for k in range(60):
                await store.add_event("team-0", "1", "step", {"k": k})
        finally:
            await store.close()

    asyncio.run(post())
    res = CliRunner().invoke(app, ["rollouts", "show", "team-0", *opts])
    assert res.exit_code == 0, res.output
    assert "61 event(s) posted by the harness and the controller, the last 50:" in res.stdout
    assert 'step {"k":59}' in res.stdout and 'step {"k":9}' not in res.stdout and "\x1b" not in res.stdout
    shown = json.loads(CliRunner().invoke(app, ["rollouts", "show", "team-0", "--json", *opts]).stdout)
    assert len(shown["events"]) == 61 and shown["events"][0]["data"]["name"] == "<script>x</script>"
    with TestClient(create_app(redis_url, prefix, tmp_path), base_url="http://127.0.0.1") as c:
        page = c.get("/rollouts/team-0").text
    assert "61 posted by the harness and the controller, the last 50 shown" in page and "{&#34;k&#34;:59}" in page
    assert "<script>x" not in page
