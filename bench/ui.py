"""How the dashboard copes with big traces: a rollout of thousands of calls and a 32k-token row.

Writes two rollouts straight through the Store (real Redis), serves the dashboard in this process and times
its pages over HTTP, cold (first view: the whole call stream read and aggregated) and warm (cached), with
the size of the HTML sent. Pages are bounded by paging (100 calls, 1024 tokens a page), so a page's size does
not grow with the trace; the first view's time does (it reads every call).

    python bench/ui.py [--calls 2000] [--row-tokens 32768] [--groups 16 --group-size 8 --step-calls 10] [--redis URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis as redis_sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes import Served  # noqa: E402

from agl_common.schemas import CallRecord, Rollout, RolloutStatus  # noqa: E402
from agl_common.store import Store  # noqa: E402
from agl_trainer.ui.server import create_app  # noqa: E402


def call(rid: str, prompt: list[int], response: list[int]) -> CallRecord:
    return CallRecord(rollout_id=rid, attempt_id="0", seq=0, route="chat", request={"messages": []},
                      response={"choices": [{"message": {"role": "assistant", "content": "x"}}]},
                      prompt_token_ids=prompt, response_token_ids=response,
                      response_logprobs=[-0.5] * len(response), finish_reason="stop", latency_ms=12.0)


async def write_step(store: Store, run_dir: Path, groups: int, size: int, calls: int) -> None:
    """One training step of ``groups`` GRPO groups of ``size`` rollouts, each ``calls`` merging calls of ~1k
    tokens (a row of ``calls`` k tokens per rollout), and the run directory that lists them."""
    run_id = run_dir.name
    gids = []
    for g in range(groups):
        gid = f"{run_id}-q{g}-g0"
        gids.append(gid)
        for i in range(size):
            rid = f"{gid}-{i}"
            await store.create_rollout(Rollout(rollout_id=rid, group_id=gid, status=RolloutStatus.running),
                                       enqueue=False)
            seq = list(range(300))
            for k in range(calls):
                response = [(13 * k + j) % 30000 for j in range(250)]
                await store.record_call(call(rid, list(seq), response))
                seq += response + [(17 * k + j) % 30000 for j in range(750)]
            await store.update_rollout(rid, lambda r, i=i: setattr(r, "reward", float(i % 2)))
            await store.set_status(rid, RolloutStatus.succeeded)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "groups": gids, "reward_mean": 0.5}) + "\n")


async def write(store: Store, n_calls: int, row_tokens: int) -> None:
    # many calls: each a fresh 400-token prompt and a 100-token answer (one row per call, as a harness that
    # rewrites its context every turn would make)
    await store.create_rollout(Rollout(rollout_id="many", status=RolloutStatus.running), enqueue=False)
    for k in range(n_calls):
        await store.record_call(call("many", [k % 30000] * 400, list(range(100))))
    # one long row: 32 calls, each prompt extending the last (context 3/4, sampled 1/4), merged to row_tokens
    await store.create_rollout(Rollout(rollout_id="long", status=RolloutStatus.running), enqueue=False)
    turns, seq = 32, list(range(256))
    step = (row_tokens - len(seq)) // turns
    for k in range(turns):
        response = [(7 * k + j) % 30000 for j in range(step // 4)]
        await store.record_call(call("long", list(seq), response))
        seq += response + [(11 * k + j) % 30000 for j in range(step - len(response))]


def timed(client: httpx.Client, url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.get(url)
    r.raise_for_status()
    return time.perf_counter() - t0, len(r.content)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--row-tokens", type=int, default=32768)
    ap.add_argument("--groups", type=int, default=16, help="groups in the step page's step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--step-calls", type=int, default=10, help="calls per rollout of that step")
    ap.add_argument("--redis", default=os.environ.get("AGL_REDIS_URL", "redis://127.0.0.1:6379/15"))
    args = ap.parse_args()
    prefix = f"bench-ui-{uuid.uuid4().hex[:6]}:"

    runs = Path(tempfile.mkdtemp())

    async def setup():
        store = Store(args.redis, prefix)
        await write(store, args.calls, args.row_tokens)
        await write_step(store, runs / "bench" / "run1", args.groups, args.group_size, args.step_calls)
        await store.close()

    t0 = time.perf_counter()
    asyncio.run(setup())
    print(f"wrote {args.calls} calls + a {args.row_tokens}-token row + a step of {args.groups}x{args.group_size} "
          f"rollouts x {args.step_calls} calls in {time.perf_counter() - t0:.1f} s")
    try:
        with Served(create_app(args.redis, prefix, runs)) as ui, \
                httpx.Client(base_url=ui.url, timeout=600) as c:
            pages = [("rollout of many calls, page 1 (cold)", "/rollouts/many"),
                     ("rollout of many calls, page 1 (warm)", "/rollouts/many"),
                     (f"same, last page", f"/rollouts/many?page={(args.calls + 99) // 100}"),
                     ("rollout with the long row (cold)", "/rollouts/long"),
                     ("long row, tokens page 1", "/rollouts/long/rows/0"),
                     ("long row, last tokens page", f"/rollouts/long/rows/0?page={(args.row_tokens + 1023) // 1024}"),
                     (f"step of {args.groups} groups x {args.group_size} (cold)", "/runs/run1/steps/1"),
                     (f"same step (warm)", "/runs/run1/steps/1")]
            print(f"{'page':45} {'seconds':>8} {'HTML KB':>8}")
            for name, url in pages:
                s, size = timed(c, url)
                print(f"{name:45} {s:8.3f} {size / 1024:8.0f}")
    finally:
        r = redis_sync.Redis.from_url(args.redis)
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        if keys:
            r.delete(*keys)
        shutil.rmtree(runs, ignore_errors=True)
    print("load average (1, 5, 15 min):", " ".join(f"{x:.2f}" for x in os.getloadavg()), f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
