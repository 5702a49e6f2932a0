"""The dashboard (``agl-trainer ui``): pages against records written through the real gateway.

Browser tests (``-m browser``) drive Debian's chromium with Playwright (set up by scripts/setup-browser.sh,
which the first of them runs) and save a screenshot of every page they open under ``test-artifacts/ui/``
(printed; ``AGL_UI_ARTIFACTS`` moves it). The others read the pages over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from agl_common.schemas import CallRecord, Policy, Rollout, RolloutStatus
from agl_common.store import Store
from agl_gateway import GatewaySettings, create_app as gateway_app
from agl_trainer.ui.runs import load_run
from agl_trainer.ui.server import CALLS_PER_PAGE, ROWS_PER_PAGE, create_app
from agl_trainer.algorithm.aggregate import Vocabulary

from fakes import Served, free_port
from ui_records import EOS, char_upstream, decode, record_run, step_line

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("AGL_UI_ARTIFACTS", ROOT / "test-artifacts" / "ui"))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ------------------------------------------------------------------------------------------ recorded data
@pytest.fixture(scope="module")
def recorded(redis_url, tmp_path_factory):
    """One step of two groups recorded through the real gateway, a run directory, and the dashboard serving them."""
    prefix = f"test-ui-{uuid.uuid4().hex[:8]}:"
    runs_dir = tmp_path_factory.mktemp("runs")
    run_id = f"0101-000000-{uuid.uuid4().hex[:4]}"

    async def record():
        store = Store(redis_url, prefix)
        try:
            with Served(char_upstream()) as up, Served(gateway_app(GatewaySettings(
                    upstream=up.url + "/v1", redis_url=redis_url, prefix=prefix, model="agent", heartbeat_s=0.2))) as gw:
                return await record_run(store, gw.url, runs_dir, run_id)
        finally:
            await store.close()

    data = asyncio.run(record())
    old = time.time() - 3600  # a run that stopped an hour ago (the live test appends a step: running again)
    for f in data["run_dir"].iterdir():
        os.utime(f, (old, old))
    with Served(create_app(redis_url, prefix, runs_dir, Vocabulary(decode, frozenset({EOS})))) as ui:
        yield {"url": ui.url, "prefix": prefix, "redis_url": redis_url, "run_id": run_id, "runs_dir": runs_dir, **data}
    r = redis_sync.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)


def redis_view(recorded) -> dict:
    """What Redis holds for the recorded run: rollouts and calls, read through the Store."""

    async def read():
        store = Store(recorded["redis_url"], recorded["prefix"])
        try:
            out = {}
            for gid, rids in recorded["groups"].items():
                for rid in rids:
                    out[rid] = (await store.get_rollout(rid), await store.read_calls(rid))
            return out
        finally:
            await store.close()

    return run_async(read())


def run_async(coro):
    """Run ``coro`` to completion in a thread of its own (Playwright's sync API keeps a loop in this one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def grpo(rewards: list[float]) -> list[float]:
    """GRPO advantages by hand: (r - mean) / (unbiased std + 1e-6)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-6) if std > 0 else 0.0 for r in rewards]


def c_said(call) -> str:
    return call.response["choices"][0]["message"]["content"]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------------------ over HTTP
def test_bad_input_gets_clear_pages(recorded, redis_url):
    base, run_id = recorded["url"], recorded["run_id"]
    gid = next(iter(recorded["groups"]))
    rid = recorded["groups"][gid][0]
    cases = [
        ("/runs/no-such-run", 404, "Unknown run"),
        (f"/runs/{run_id}/steps/99", 404, "Unknown step"),
        (f"/runs/{run_id}/steps/1/groups/nope", 404, "Unknown group"),
        (f"/runs/{run_id}/steps/1/groups/{gid}/rollouts/nope", 404, "Unknown rollout"),
        ("/rollouts/no-such-rollout", 404, "Unknown rollout"),
        (f"/rollouts/{rid}/rows/7", 404, "Unknown row"),
        (f"/rollouts/{rid}?page=9", 404, "No such page"),
        (f"/runs/{run_id}/steps/x", 422, None),
        ("/search?q=nope", 404, "Unknown rollout"),
        ("/nothing/here", 404, "Page not found"),
        ("/api/runs/no-such-run", 404, "Unknown run"),
    ]
    for path, status, title in cases:
        r = httpx.get(base + path, timeout=60)
        if status == 422:  # FastAPI's own validation of a path parameter: still JSON, never a traceback
            assert r.status_code in (400, 422) and "Traceback" not in r.text, r.text
            continue
        assert r.status_code == status, (path, r.text[:500])
        assert title in r.text and "Traceback" not in r.text, (path, r.text[:500])
    # Redis down: a page that says so (the run list, which needs no Redis, still works)
    with Served(create_app(f"redis://127.0.0.1:{free_port()}/0", "x:", recorded["runs_dir"])) as down:
        r = httpx.get(f"{down.url}/rollouts/{rid}", timeout=60)
        assert r.status_code == 503 and "Redis is not reachable" in r.text and "Traceback" not in r.text
        assert httpx.get(f"{down.url}/runs/{run_id}", timeout=60).status_code == 200
        assert httpx.get(f"{down.url}/api/gateway", timeout=60).json()["error"]["title"] == "Redis is not reachable"


def test_the_redis_password_is_never_shown(tmp_path):
    """The footer of every page, the error pages and the start-up line used to print the Redis URL whole."""
    url = f"redis://agl:hunter2@127.0.0.1:{free_port()}/0"
    with Served(create_app(url, "x:", tmp_path)) as ui:
        pages = [httpx.get(ui.url + path, timeout=60) for path in ("/", "/rollouts/r1", "/nothing/here")]
    assert [p.status_code for p in pages] == [200, 503, 404]
    for page in pages:
        assert "hunter2" not in page.text and "agl:***@127.0.0.1" in page.text, page.text[-600:]
    proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "ui", "--port", str(free_port()), "--runs-dir",
                             str(tmp_path), "--redis", url, "--tokenizer", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "AGL dashboard" in line and "hunter2" not in line and "agl:***@" in line, line


def test_redacted_url():
    from agl_common.settings import redacted_url

    assert redacted_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted_url("redis://u:p%40w@h/1") == "redis://u:***@h/1"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_url("redis+cluster://:pw@a:1,b:2") == "redis+cluster://:***@a:1,b:2"


def test_group_and_rollout_pages_show_what_redis_holds(recorded):
    """The numbers of the group page against the Store (the browser test clicks through the same pages)."""
    view = redis_view(recorded)
    gid = next(iter(recorded["groups"]))
    html = httpx.get(f"{recorded['url']}/runs/{recorded['run_id']}/steps/1/groups/{gid}", timeout=60).text
    rids = recorded["groups"][gid]
    expected = grpo([view[r][0].reward for r in rids])
    for rid, adv in zip(rids, expected):
        row = re.search(rf'<tr data-rollout="{rid}">(.*?)</tr>', html, re.S).group(1)
        assert f">{view[rid][0].reward:.4f}<" in row and f">{adv:.4f}<" in row
        assert f'class="num calls">{len(view[rid][1])}<' in row


def test_a_running_rollout_page_shows_new_calls(redis_url, prefix, tmp_path):
    """The trace cache is keyed by the number of recorded calls; ``Store.call_entries`` read a key nothing
    writes (always 0), so a running rollout's page never showed a call recorded after its first view."""
    def call(k: int) -> CallRecord:
        return CallRecord(rollout_id="live", attempt_id="0", seq=0, route="chat", request={}, response=None,
                          prompt_token_ids=[1, 100 + k], response_token_ids=[5, 2], response_logprobs=[-0.1, -0.2],
                          finish_reason="stop")

    async def write(k: int) -> int:
        store = Store(redis_url, prefix)
        if k == 0:
            await store.create_rollout(Rollout(rollout_id="live", status=RolloutStatus.running), enqueue=False)
        await store.record_call(call(k))
        n = await store.call_entries("live")
        await store.close()
        return n

    assert asyncio.run(write(0)) == 1
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        first = httpx.get(f"{ui.url}/rollouts/live", timeout=60).text
        assert asyncio.run(write(1)) == 2
        second = httpx.get(f"{ui.url}/rollouts/live", timeout=60).text
    assert first.count("<tr data-seq=") == 1 and second.count("<tr data-seq=") == 2, second[-2000:]


def test_calls_are_paged(redis_url, prefix, tmp_path):
    """A rollout with more calls than a page: the calls table shows one page and links the next."""
    n = ROWS_PER_PAGE + 30  # every call its own row (no prompt extends another): rows are paged too

    async def write():
        store = Store(redis_url, prefix)
        await store.create_rollout(Rollout(rollout_id="big", status=RolloutStatus.running), enqueue=False)
        for k in range(n):
            await store.record_call(CallRecord(rollout_id="big", attempt_id="0", seq=0, route="chat", request={},
                                               response=None, prompt_token_ids=[1, k], response_token_ids=[5, 2],
                                               response_logprobs=[-0.1, -0.2], finish_reason="stop"))
        await store.close()

    asyncio.run(write())
    with Served(create_app(redis_url, prefix, tmp_path)) as ui:
        p1 = httpx.get(f"{ui.url}/rollouts/big", timeout=60).text
        last = httpx.get(f"{ui.url}/rollouts/big?page=3&rpage=2", timeout=60).text
    assert p1.count("<tr data-seq=") == CALLS_PER_PAGE and 'href="?page=2&rpage=1"' in p1
    assert p1.count("<tr data-row=") == ROWS_PER_PAGE and 'href="?page=1&rpage=2"' in p1
    assert last.count("<tr data-seq=") == n - 2 * CALLS_PER_PAGE and f'data-seq="{n - 1}"' in last
    assert f'data-seq="{n}"' not in last and 'data-seq="199"' not in last
    assert last.count("<tr data-row=") == n - ROWS_PER_PAGE and f'data-row="{n - 1}"' in last


def test_run_directories_are_read_defensively(tmp_path):
    """Older field names, a half-written last line and a missing summary do not break a run."""
    d = tmp_path / "demo" / "r1"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"eval": "before", "accuracy": 0.1, "n": 4}) + "\n"
                                     + json.dumps({"step": 1, "reward_mean": 0.5, "rollout_s": 2.0, "drain_s": 0.3})
                                     + "\n" + '{"step": 2, "rew')
    (d / "summary.json").write_text(json.dumps({"accuracy_before": 0.1, "accuracy_after": 0.3}))
    run = load_run(d)
    assert [m["step"] for m in run.steps] == [1] and run.status == "finished"
    assert run.eval_accuracy("before") == 0.1 and run.eval_accuracy("after") == 0.3
    times = next(c for c in run.series() if c["title"].startswith("step time"))
    assert {s["label"]: s["values"] for s in times["series"]}["generation"] == [2.0]
    assert {s["label"]: s["values"] for s in times["series"]}["pause-drain"] == [0.3]


def test_tokenizer_option():
    """A tokenizer directory decodes ids (the trainer's tiny test tokenizer here); a missing one is a clear error."""
    from agl_trainer.ui.traces import load_decoder

    tiny = ROOT / "packages" / "trainer" / "src" / "agl_trainer" / "assets" / "tiny-tokenizer"
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny).encode("hello world")
    dec = load_decoder(str(tiny))
    assert dec.text(ids) == AutoTokenizer.from_pretrained(tiny).decode(ids) and dec.eos_ids is not None
    assert load_decoder("none").decode is None
    with pytest.raises(FileNotFoundError):
        load_decoder(str(ROOT / "no-such-dir"))
    r = subprocess.run([sys.executable, "-m", "agl_trainer", "ui", "--tokenizer", str(ROOT / "no-such-dir")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no tokenizer in" in r.stderr and "Traceback" not in r.stderr


def test_cli_prints_the_url_and_serves(tmp_path, redis_url, prefix):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "agl_trainer", "ui", "--port", str(port), "--runs-dir",
                             str(tmp_path), "--redis", redis_url, "--prefix", prefix, "--tokenizer", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line, line
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "dashboard did not start"
                time.sleep(0.3)
        assert r.status_code == 200 and "No run directories" in r.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------------ in a browser
@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright, both installed by scripts/setup-browser.sh."""
    setup = subprocess.run(["bash", str(ROOT / "scripts" / "setup-browser.sh")], capture_output=True, text=True)
    if setup.returncode != 0:
        pytest.fail(f"scripts/setup-browser.sh failed:\n{setup.stdout}\n{setup.stderr}")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the dashboard pages: {ARTIFACTS}")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    p = context.new_page()
    p.set_default_timeout(30_000)
    yield p
    context.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def cells(page, selector: str) -> list[str]:
    return [t.strip() for t in page.locator(selector).all_inner_texts()]


@pytest.mark.browser
def test_click_from_run_to_token_row(recorded, page):
    """run → step → group → rollout → row, each page's numbers against what Redis holds."""
    view = redis_view(recorded)
    run_id = recorded["run_id"]
    gid, quiet = list(recorded["groups"])
    page.goto(recorded["url"] + "/")
    shot(page, "01-runs")
    page.click(f"a:text-is('{run_id}')")
    page.wait_for_selector("#charts .chart canvas")
    shot(page, "02-run")
    assert page.inner_text("#before") == "0.250" and page.inner_text("#run-status") == "stopped"
    assert page.locator("#charts .chart").count() == 5  # reward, loss, KL/ratio, rows/breaks/failed, time split
    assert cells(page, "#steps tbody tr td:first-child") == ["1"]

    page.click("#steps tbody a:text-is('1')")
    page.wait_for_selector("#groups")
    shot(page, "03-step")
    assert page.url.endswith(f"/runs/{run_id}/steps/1")
    assert cells(page, "#groups tbody td.verdict") == ["signal", "equal rewards"]
    rewards = [view[r][0].reward for r in recorded["groups"][gid]]
    assert page.inner_text(f"tr[data-group='{gid}'] td.rewards").split() == [f"{r:.2f}" for r in rewards]
    assert page.inner_text(f"tr[data-group='{gid}'] td.advs").split() == [f"{a:.2f}" for a in grpo(rewards)]
    # the quiet group: equal rewards of the three that succeeded, every advantage 0, the failed one named
    assert page.inner_text(f"tr[data-group='{quiet}'] td.advs").split() == ["0.00", "0.00", "0.00", "-"]
    assert "timeout" in page.inner_text(f"tr[data-group='{quiet}']")

    page.click(f"a:text-is('{gid}')")
    page.wait_for_selector("#rollouts")
    shot(page, "04-group")
    assert page.inner_text("#verdict") == "signal"
    for rid, adv in zip(recorded["groups"][gid], grpo(rewards)):
        rollout, calls = view[rid]
        row = page.locator(f"tr[data-rollout='{rid}']")
        assert row.locator("td.reward").inner_text() == f"{rollout.reward:.4f}"
        assert row.locator("td.adv").inner_text() == f"{adv:.4f}"
        assert row.locator("td.calls").inner_text() == str(len(calls))
        assert row.locator("td.status").inner_text() == rollout.status.value

    rid = recorded["groups"][gid][1]  # the rollout that re-rendered its history: two rows, one break
    rollout, calls = view[rid]
    page.click(f"a:text-is('{rid}')")
    page.wait_for_selector("#rows")
    shot(page, "05-rollout")
    assert page.url.endswith(f"/runs/{run_id}/steps/1/groups/{gid}/rollouts/{rid}")
    assert page.locator("#calls tbody tr").count() == len(calls) == 3
    assert page.inner_text("#calls tbody tr:first-child td.said") == c_said(calls[0])  # what the agent said
    c0, c1, c2 = calls
    seq0 = c1.prompt_token_ids + c1.response_token_ids  # row 0 = calls 0 and 1 merged
    offset = first_difference(seq0, c2.prompt_token_ids)
    assert cells(page, "#rows td.prompt-tokens") == [str(len(c0.prompt_token_ids)), str(len(c2.prompt_token_ids))]
    assert cells(page, "#rows td.response-tokens") == [str(len(seq0) - len(c0.prompt_token_ids)),
                                                       str(len(c2.response_token_ids))]
    assert cells(page, "#rows td.trainable") == [str(len(c0.response_token_ids) + len(c1.response_token_ids)),
                                                 str(len(c2.response_token_ids))]
    assert page.inner_text("tr[data-row='1'] .break-class") == "template_rerender"
    assert page.inner_text("tr[data-row='1'] .break-offset") == str(offset)

    page.click("#calls tbody tr:nth-child(3) a.call-link")  # one call in full: what was sent and answered
    page.wait_for_selector("#request")
    shot(page, "05b-call")
    assert page.url.endswith(f"/rollouts/{rid}/calls/0/2")
    assert json.loads(page.inner_text("#request")) == calls[2].request
    assert json.loads(page.inner_text("#response")) == calls[2].response
    page.go_back()
    page.click("a:text-is('row 1')")
    page.wait_for_selector("#merge-break")
    shot(page, "06-row-break")
    assert page.inner_text("#break-class") == "template_rerender" and page.inner_text("#break-offset") == str(offset)
    assert "<assistant>8" in page.inner_text("#break-row-text")
    assert "<assistant> 8" in page.inner_text("#break-prompt-text")
    assert page.locator(f"#tok-{offset}.brk").count() == 1
    sampled = page.locator("#tokens .t.sampled")
    assert sampled.count() == len(c2.response_token_ids)
    assert [float(x) for x in sampled.evaluate_all("els => els.map(e => e.dataset.lp)")] == \
        pytest.approx(c2.response_logprobs, abs=1e-4)
    assert page.locator("#tokens .t.prompt").count() == len(c2.prompt_token_ids)

    page.goto(f"{recorded['url']}/runs/{run_id}/steps/1/groups/{gid}/rollouts/{rid}/rows/0")
    shot(page, "07-row-merged")
    assert page.locator("#tokens .t.context").count() == \
        len(c1.prompt_token_ids) - len(c0.prompt_token_ids) - len(c0.response_token_ids)
    assert page.locator("#tokens .t.sampled").count() == len(c0.response_token_ids) + len(c1.response_token_ids)

    # search by rollout id lands on the shareable nested URL
    page.fill("#search", rid)
    page.click("text=find rollout")
    page.wait_for_selector("#rows")
    assert page.url.endswith(f"/runs/{run_id}/steps/1/groups/{gid}/rollouts/{rid}")


@pytest.mark.browser
def test_live_updates_without_reload(recorded, page):
    """A new step appears on the open run page, and the gateway page follows the policy, without a reload."""
    run_id = recorded["run_id"]
    page.goto(f"{recorded['url']}/runs/{run_id}")
    page.wait_for_selector("#charts .chart canvas")
    page.evaluate("window.__same_page = true")
    metrics = recorded["run_dir"] / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write(json.dumps(step_line(2, [])) + "\n")
    page.wait_for_selector("#steps tr[data-step='2']", timeout=20_000)
    assert page.evaluate("window.__same_page") is True  # the same document: no reload
    assert page.inner_text("#n-steps") == "2" and page.inner_text("#run-status") == "running"
    shot(page, "08-run-live")

    page.goto(f"{recorded['url']}/gateway")
    page.evaluate("window.__same_page = true")

    async def set_policy():
        store = Store(recorded["redis_url"], recorded["prefix"])
        await store.set_policy(Policy(model="policy-v7", version=7))
        await store.close()

    run_async(set_policy())
    page.wait_for_function("document.getElementById('policy').textContent.includes('policy-v7')", timeout=20_000)
    # a gateway replica starts: its heartbeat shows up, then goes once it stops (the heartbeat expires after 5 s)
    with Served(char_upstream()) as up, Served(gateway_app(GatewaySettings(
            upstream=up.url + "/v1", redis_url=recorded["redis_url"], prefix=recorded["prefix"], model="agent",
            heartbeat_s=0.2))):
        page.wait_for_function("document.querySelectorAll('#replicas tbody tr').length === 1", timeout=20_000)
        shot(page, "09-gateway")
        assert page.inner_text("#paused") == "0" and page.inner_text("#in-flight") == "0"
    page.wait_for_function("document.querySelectorAll('#replicas tbody tr').length === 0", timeout=30_000)
    assert page.evaluate("window.__same_page") is True


@pytest.mark.browser
def test_bad_input_pages_in_browser(recorded, page):
    page.goto(f"{recorded['url']}/runs/no-such-run")
    assert page.inner_text("#error h1") == "Unknown run" and "no-such-run" in page.inner_text("#error-message")
    shot(page, "10-unknown-run")
    page.goto(f"{recorded['url']}/rollouts/no-such-rollout")
    assert page.inner_text("#error h1") == "Unknown rollout"
    shot(page, "11-unknown-rollout")
    with Served(create_app(f"redis://127.0.0.1:{free_port()}/0", "x:", recorded["runs_dir"])) as down:
        page.goto(f"{down.url}/rollouts/anything")
        assert page.inner_text("#error h1") == "Redis is not reachable"
        shot(page, "12-redis-down")


def test_a_hand_edited_metrics_file_with_odd_groups_is_no_503(redis_url, tmp_path):
    """``groups`` holding numbers or objects, or a string in place of the list: every page answers, naming no
    group it cannot be (it was a 503 "Redis is not reachable", the error of a type it did not expect)."""
    d = tmp_path / "demo" / "r1"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in (
        {"step": 1, "groups": [1, {"a": 2}, None, "g-odd"], "reward_mean": 0.5}, {"step": 2, "groups": "abc"})) + "\n")
    prefix = f"test-ui-odd-{uuid.uuid4().hex[:8]}:"
    with Served(create_app(redis_url, prefix, tmp_path, Vocabulary(decode, frozenset({EOS})))) as ui:
        for path, status in (("/", 200), ("/runs/r1", 200), ("/runs/r1/steps/1", 200), ("/runs/r1/steps/2", 200),
                             ("/runs/r1/steps/1/groups/1", 404), ("/runs/r1/steps/2/groups/a", 404),
                             ("/runs/r1/steps/1/groups/g-odd", 404)):  # (not registered: round 20)
            resp = httpx.get(ui.url + path, timeout=60)
            assert resp.status_code == status, (path, resp.status_code, resp.text[:300])
        step1 = httpx.get(ui.url + "/runs/r1/steps/1", timeout=60).text
        assert "g-odd" in step1
