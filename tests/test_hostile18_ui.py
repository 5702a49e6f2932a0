"""Round 18 of hostile input, the dashboard (docs/operations.md, "An eighteenth round"): each test failed before
its fix."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from agl_common.schemas import CallRecord, GroupInfo, Rollout, RolloutStatus
from agl_common.store import Store
from agl_trainer.ui.server import create_app

from fakes import Served

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ------------------------------------------------------------------------------------------ odd run settings
async def _seed_group(redis_url: str, prefix: str, gid: str, rewards: list[float]) -> list[str]:
    """A finished group of one-call rollouts with ``rewards``: their ids."""
    store = Store(redis_url, prefix)
    rids = []
    try:
        for i, reward in enumerate(rewards):
            rid = f"{gid}-{i}"
            await store.create_rollout(Rollout(rollout_id=rid, input={"q": 1}, group_id=gid), enqueue=False)
            await store.record_call(CallRecord(
                rollout_id=rid, attempt_id="0", seq=0, route="chat",
                request={"messages": [{"role": "user", "content": "hi"}]},
                response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "7"},
                                       "finish_reason": "stop"}]},
                prompt_token_ids=[1, 2, 3], response_token_ids=[7, 2], response_logprobs=[-0.1, -0.2],
                finish_reason="stop"))

            def done(r, reward=reward):
                r.status, r.reward, r.ended_at = RolloutStatus.succeeded, reward, time.time()

            await store.update_rollout(rid, lambda r: setattr(r, "status", RolloutStatus.running))
            await store.update_rollout(rid, done)
            rids.append(rid)
        await store.register_group(GroupInfo(group_id=gid, rollout_ids=rids))  # (as the scheduler does)
    finally:
        await store.close()
    return rids


#: config.json settings the trainer's TrainConfig refuses (hand-edited, or written by another AGL version).
BAD_SETTINGS = {
    "mgs-word": {"min_group_size": "two"},
    "mgs-null": {"min_group_size": None},
    "mgs-bool": {"min_group_size": True},
    "adv-banana": {"advantage": "banana"},
    "adv-newer": {"advantage": "gspo"},  # an estimator of a later version
    "agg-banana": {"aggregation": "banana"},
    "mpt-zero": {"max_prompt_tokens": 0},
    "lvl-five": {"advantage_level": 5},
    "norm-list": {"norm_by_std": [1]},
    "many": {"advantage": "banana", "aggregation": {"a": 1}, "max_response_tokens": -3, "lr": 0.1},
}


def test_a_config_with_settings_out_of_range_gets_the_defaults_and_says_so(redis_url, prefix, tmp_path):
    """The prober: a run whose ``config.json`` held ``min_group_size: "two"`` (or null), ``advantage: "banana"``,
    ``aggregation: "banana"``, ``max_prompt_tokens: 0``, ``advantage_level: 5`` (or a newer version's estimator)
    made the step, group, rollout and row pages answer 500: ``run_settings`` took each value unchecked and
    ``group_view`` / ``build_rows`` / ``advantages_of`` failed on it. Now each setting is checked against
    TrainConfig's field: a value it refuses is replaced by the default, and every page that uses the settings
    says which were replaced; valid settings (``advantage: rloo``) are still the run's."""
    gid = "g18"
    rids = asyncio.run(_seed_group(redis_url, prefix, gid, [1.0, 0.0]))
    configs = {**BAD_SETTINGS, "good": {"advantage": "rloo", "min_group_size": 2, "aggregation": "transition"}}
    for name, cfg in configs.items():
        d = tmp_path / "demo" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "groups": [gid]}) + "\n")
    grpo = [1 / math.sqrt(2), -1 / math.sqrt(2)]  # the default estimator on rewards 1, 0 (std 1/sqrt(2))
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        for name, cfg in configs.items():
            group = f"/runs/{name}/steps/1/groups/{gid}"
            rollout = f"{group}/rollouts/{rids[0]}"
            pages = {p: httpx.get(ui.url + p, timeout=60) for p in (
                f"/runs/{name}", f"/runs/{name}/steps/1", group, rollout, f"{rollout}/rows/0",
                f"{rollout}/calls/0/0")}
            for path, resp in pages.items():
                assert resp.status_code == 200 and "Internal error" not in resp.text, (path, resp.text[:800])
            for path, resp in pages.items():
                note = re.search(r'<p class="note" id="settings-replaced">(.*?)</p>', resp.text, re.S)
                if name == "good":
                    assert note is None, (path, note.group(1))
                    continue
                assert note is not None, (path, resp.text[:800])
                refused = [k for k in cfg if k != "lr"]  # (lr: a setting the pages do not use)
                for key in refused:
                    assert f"<code>{key}</code>" in note.group(1), (path, key, note.group(1))
                assert "<code>lr</code>" not in note.group(1)
            html = pages[group].text
            expected = [1.0, -1.0] if name == "good" else grpo
            for rid, adv in zip(rids, expected):
                row = re.search(rf'<tr data-rollout="{rid}">(.*?)</tr>', html, re.S).group(1)
                assert f'class="num adv">{adv:.4f}<' in row, (name, row)


# ------------------------------------------------------------------------------------------ a long run
STEPS = 100_000


def _long_run(runs_dir: Path, name: str = "big1", summary: bool = False) -> Path:
    """A run of :data:`STEPS` metrics lines (~24 MB), as the prober's."""
    d = runs_dir / "demo" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    with open(d / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, "reward_mean": (s % 7) / 7, "accuracy": 0.5, "rows": 32,
                                 "groups": [f"g{s}-{k}" for k in range(8)], "policy_version": s}) + "\n"
                     for s in range(1, STEPS + 1))
    if summary:
        (d / "summary.json").write_text(json.dumps({"heldout_before": 0.1, "heldout_after": 0.2}))
    return d


def test_a_long_run_neither_blocks_the_dashboard_nor_sends_all_its_steps(redis_url, prefix, tmp_path, monkeypatch):
    """The prober: a 100k-step ``metrics.jsonl`` (24 MB) made ``/runs/<run>`` take 14 s (182 MB of HTML) and
    ``/api/runs/<run>`` 10 s (82 MB of JSON), parsed anew on every poll on the event loop, so ``/healthz`` (and
    every other page) waited for it. Now the run is read in a worker thread and kept until one of its files
    changes (mtime, size): ``/healthz`` answers while the first read is under way, a poll of an unchanged run reads
    nothing, and the page and the API send the last ``STEPS_SHOWN`` steps and at most ``MAX_POINTS`` points a
    curve (every step keeps its page)."""
    from agl_trainer.ui import runs as runs_module

    d = _long_run(tmp_path)
    loads = []
    real_load = runs_module.load_run
    monkeypatch.setattr(runs_module, "load_run", lambda path: loads.append(path) or real_load(path))
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        big: dict = {}

        def fetch_big():
            with httpx.stream("GET", f"{ui.url}/api/runs/big1", timeout=120) as resp:
                big["answered"] = time.monotonic()  # its headers: the server has built the answer
                resp.read()
            big["resp"] = resp

        t = threading.Thread(target=fetch_big)
        t.start()
        time.sleep(0.3)  # the big request is being answered
        health = httpx.get(f"{ui.url}/healthz", timeout=120)
        health_done = time.monotonic()
        t.join()
        assert health.status_code == 200 and big["resp"].status_code == 200
        assert health_done < big["answered"], "/healthz waited for the long run's answer"

        data = big["resp"].json()
        assert len(big["resp"].content) < 5 * 2**20
        assert data["steps"] == STEPS and data["table_hidden"] == STEPS - runs_module.STEPS_SHOWN
        assert [int(c[0]) for c in data["table"]] == list(range(STEPS - runs_module.STEPS_SHOWN + 1, STEPS + 1))
        for chart in data["charts"]:
            assert len(chart["x"]) <= runs_module.MAX_POINTS and chart["x"][-1] == STEPS
            assert all(len(s["values"]) == len(chart["x"]) for s in chart["series"])
        reward = next(c for c in data["charts"] if c["title"].startswith("reward"))["series"][0]["values"]
        assert 0.3 < min(reward) and max(reward) < 0.6  # means of consecutive steps (the steps cycle 0 to 6/7)

        page = httpx.get(f"{ui.url}/runs/big1", timeout=120)
        assert page.status_code == 200 and len(page.content) < 5 * 2**20
        assert page.text.count("<tr data-step=") == runs_module.STEPS_SHOWN
        assert f"{STEPS - runs_module.STEPS_SHOWN:,}" in page.text  # the note of the hidden steps
        assert httpx.get(f"{ui.url}/runs/big1/steps/1", timeout=120).status_code == 200  # a hidden step's page

        # unchanged: read once; a poll naming the version it has gets a few bytes
        assert httpx.get(f"{ui.url}/api/runs/big1", timeout=120).json() == data
        assert len(loads) == 1, loads
        small = httpx.get(f"{ui.url}/api/runs/big1", params={"since": data["version"]}, timeout=120)
        assert small.json()["unchanged"] is True and len(small.content) < 500
        with open(d / "metrics.jsonl", "a") as f:  # a new step: read again, shown
            f.write(json.dumps({"step": STEPS + 1, "reward_mean": 1.0}) + "\n")
        after = httpx.get(f"{ui.url}/api/runs/big1", params={"since": data["version"]}, timeout=120).json()
        assert after["steps"] == STEPS + 1 and after["table"][-1][0] == str(STEPS + 1) and len(loads) == 2


# ------------------------------------------------------------------------------------------ the run page's polls
@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright, both installed by scripts/setup-browser.sh."""
    setup = subprocess.run(["bash", str(ROOT / "scripts" / "setup-browser.sh")], capture_output=True, text=True)
    if setup.returncode != 0:
        pytest.fail(f"scripts/setup-browser.sh failed:\n{setup.stdout}\n{setup.stderr}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


#: Wraps the page's fetch: each answer comes 5 s late; counts the polls and the most in flight at once.
SLOW_FETCH = """
window.__polls = 0; window.__inflight = 0; window.__most = 0;
const realFetch = window.fetch.bind(window);
window.fetch = async (...args) => {
  window.__polls++; window.__inflight++; window.__most = Math.max(window.__most, window.__inflight);
  try { await new Promise(r => setTimeout(r, 5000)); return await realFetch(...args); }
  finally { window.__inflight--; }
};
"""


@pytest.mark.browser
def test_the_run_page_polls_one_at_a_time_and_not_a_finished_run(browser, redis_url, prefix, tmp_path):
    """The prober: the run page polled ``/api/runs/{run}`` every 2 s with ``setInterval``, even for a finished run,
    and did not wait for the previous answer: on a slow server the requests piled up. Now the next poll starts only
    after the previous one answered, and a finished run (its ``summary.json`` written) is not polled at all."""
    for name, summary in (("live", False), ("done", True)):
        d = tmp_path / "demo" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
        if summary:
            (d / "summary.json").write_text(json.dumps({"heldout_before": 0.1, "heldout_after": 0.2}))
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        context = browser.new_context()
        try:
            context.add_init_script(SLOW_FETCH)
            page = context.new_page()
            page.goto(f"{ui.url}/runs/live")
            assert page.inner_text("#run-status") == "running"
            page.wait_for_timeout(9000)  # 4 intervals of 2 s, under 2 slow answers
            assert page.evaluate("window.__polls") >= 1 and page.evaluate("window.__most") == 1
            page.goto(f"{ui.url}/runs/done")
            assert page.inner_text("#run-status") == "finished"
            page.wait_for_timeout(5000)
            assert page.evaluate("window.__polls") == 0
        finally:
            context.close()


def test_the_run_cache_is_bounded_in_bytes(tmp_path):
    """The fifth prober: the run cache counted runs (32) and metrics lines (500,000), not bytes: four runs of a
    17 MiB ``metrics.jsonl`` of a few long lines each stayed cached, ~550 MiB of memory (at the 64 MiB read bound,
    32 runs: ~16 GiB). It now also keeps their files under ``max_bytes`` together (the newest run always)."""
    import json

    from agl_trainer.ui.runs import RunCache

    line = json.dumps({"step": 1, "blob": "x" * (2 * 2**20)}) + "\n"
    runs = []
    for i in range(4):
        run = tmp_path / f"r{i}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(line)
        runs.append(run)
    cache = RunCache(max_bytes=5 * 2**20)
    for run in runs:
        assert cache.get(run).steps
    assert [p.name for p in cache._items] == ["r2", "r3"]
    big = RunCache(max_bytes=5 * 2**20)
    (runs[0] / "metrics.jsonl").write_text(line * 3)  # one run past the bound alone: still kept (the newest)
    assert big.get(runs[0]).steps and list(big._items) == [runs[0]]
