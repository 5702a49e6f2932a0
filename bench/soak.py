"""Soak test (issue 6): the CI load test of ``tests/test_reliability.py``, for minutes instead of seconds.

Starts the fake engine (``tests/fakes.py --port``, its own process: logs every arrival, ``GET /x/arrivals``),
``--replicas`` gateway processes (``python -m agl_gateway serve --open``, distinct ``AGL_REPLICA_ID``) and runs
``--agents`` concurrent agents, each making calls back to back (random upstream delay up to ``--delay-max`` s,
random think time) for ``--duration`` seconds, through the replicas in turn, while a control task pauses
(``pause_and_drain``) and resumes every ``--pause-every`` seconds. Then it checks what the CI test checks, on
everything:

* every call answered 200 (others are counted by status and error code);
* no record lost or duplicated: each answered call's marker is recorded exactly once, and every rollout's
  ``seq`` is 0..n-1;
* no upstream call started between a drain acknowledgement and the following resume, and the upstream had
  nothing in flight at the acknowledgement;

and prints calls/s, call latency p50/p95/p99/max (held calls included), drain-ack latency and the gateways'
peak RSS. Exit status 1 if a check failed. Not run in CI.

    .venv/bin/python bench/soak.py                                  # 256 agents, 2 replicas, 5 minutes
    .venv/bin/python bench/soak.py --duration 60 --agents 64        # quicker
    .venv/bin/python bench/soak.py --redis redis://127.0.0.1:6380/0 # a Redis of your own

Only loopback is used; the Redis prefix (``soak-<uuid>:``) is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes.py"  # the fake engine, in a process of its own
sys.path.insert(0, str(FAKES.parent))
from fakes import free_port  # noqa: E402


# ----------------------------------------------------------------------------------- processes
def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.1)


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ----------------------------------------------------------------------------------- the run
async def run(args) -> int:
    import httpx
    import redis
    from agl_common.control import pause_and_drain, resume
    from agl_common.schemas import CallRecord
    from agl_common.store import Store

    prefix = f"soak-{uuid.uuid4().hex[:8]}:"
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    up_port = free_port()
    up_url = f"http://127.0.0.1:{up_port}"
    with open(logs / "upstream.log", "wb") as out:  # noqa: ASYNC230 -- start-up, before any load
        procs.append(subprocess.Popen([sys.executable, str(FAKES), "--port", str(up_port)],  # noqa: ASYNC220
                                      stdout=out, stderr=subprocess.STDOUT))
    wait_http(up_url + "/v1/models", procs[-1])
    gws = []
    for k in range(args.replicas):
        port = free_port()
        env = {**os.environ, "AGL_REPLICA_ID": f"soak-{k}", "AGL_HEARTBEAT_S": "0.2"}
        with open(logs / f"gateway-{k}.log", "wb") as out:  # noqa: ASYNC230
            procs.append(subprocess.Popen(  # noqa: ASYNC220 -- start-up, before any load
                [sys.executable, "-m", "agl_gateway", "serve", "--upstream", up_url, "--model", "agent-model",
                 "--redis", args.redis, "--prefix", prefix, "--port", str(port), "--open"],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        wait_http(f"http://127.0.0.1:{port}/healthz", procs[-1])
        gws.append((f"http://127.0.0.1:{port}", procs[-1].pid))
    store = Store(args.redis, prefix)
    while len(await store.replicas()) < args.replicas:
        await asyncio.sleep(0.1)
    print(f"upstream {up_url}, {args.replicas} gateway replicas, Redis {args.redis} prefix {prefix}, "
          f"{args.agents} agents for {args.duration:g} s, pause every {args.pause_every:g} s", flush=True)

    results: Counter = Counter()
    latencies: list[float] = []
    acked: list[str] = []
    cycles: list[dict] = []
    peak_rss = [0.0] * len(gws)
    stop = asyncio.Event()
    rng = random.Random(args.seed)

    async def agent(c: httpx.AsyncClient, i: int):
        url = f"{gws[i % len(gws)][0]}/rollouts/soak{i}/attempts/0/v1/chat/completions"
        k = 0
        while not stop.is_set():
            marker = f"soak-{i}-{k}"
            k += 1
            t0 = time.perf_counter()
            try:
                r = await c.post(url, json={"model": "agent-model", "x_delay": rng.uniform(0, args.delay_max),
                                            "messages": [{"role": "user", "content": marker}]})
            except httpx.HTTPError as exc:  # a transport error: the call was not answered
                results[type(exc).__name__] += 1
                results["transport_errors"] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            results[r.status_code] += 1
            if r.status_code == 200:
                acked.append(marker)
            else:
                results[r.json().get("error", {}).get("code")] += 1
            await asyncio.sleep(rng.uniform(0, args.think_max))

    async def control(c: httpx.AsyncClient):
        while not stop.is_set():
            await asyncio.sleep(args.pause_every)
            t_pause = time.time()
            try:
                statuses = await pause_and_drain(store, timeout_s=60, poll_s=0.02)
            except Exception as exc:  # noqa: BLE001 -- counted, then resumed: the soak goes on
                results[f"drain:{type(exc).__name__}"] += 1
                statuses = []
            t_ack = time.time()
            active = (await c.get(up_url + "/x/active")).json()
            await asyncio.sleep(args.pause_hold)
            t_resume = time.time()
            await resume(store, release_all=True)
            cycles.append({"pause": t_pause, "ack": t_ack, "resume": t_resume, "active": active,
                           "in_flight": [s.in_flight for s in statuses]})

    async def monitor():
        while not stop.is_set():
            for k, (_, pid) in enumerate(gws):
                peak_rss[k] = max(peak_rss[k], rss_mb(pid))
            await asyncio.sleep(1)

    async def progress():
        start = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(args.report_every)
            el = time.monotonic() - start
            print(f"  {el:6.0f} s  calls {sum(v for k, v in results.items() if isinstance(k, int)):7d}  "
                  f"ok {results[200]:7d}  pauses {len(cycles):4d}  "
                  f"p99 {pct(latencies[-5000:], 0.99) * 1000:7.1f} ms", flush=True)

    limits = httpx.Limits(max_connections=args.agents + 16, max_keepalive_connections=args.agents + 16,
                          keepalive_expiry=1)
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=900, limits=limits) as c:
            helpers = [asyncio.create_task(control(c)), asyncio.create_task(monitor()),
                       asyncio.create_task(progress())]
            agents = [asyncio.create_task(agent(c, i)) for i in range(args.agents)]
            await asyncio.sleep(args.duration)
            stop.set()
            await asyncio.gather(*agents)
            await asyncio.gather(*helpers)
            arrivals = (await c.get(up_url + "/x/arrivals")).json()
        elapsed = time.monotonic() - t0

        # ------------------------------------------------------------------ checks
        r = redis.Redis.from_url(args.redis)
        ok, seqs, n_records, invalid = Counter(), defaultdict(list), 0, 0
        for key in r.scan_iter(match=prefix + "calls:*", count=1000):
            for _, fields in r.xrange(key):
                n_records += 1
                try:
                    rec = CallRecord.model_validate_json(fields[b"d"])
                except ValueError:
                    invalid += 1
                    continue
                seqs[(rec.rollout_id, rec.attempt_id)].append(rec.seq)
                if rec.status == "ok":
                    ok[rec.request["messages"][0]["content"]] += 1
        lost = [m for m in acked if ok[m] == 0]
        dup = [m for m, n in ok.items() if n > 1]
        bad_seq = [k for k, s in seqs.items() if sorted(s) != list(range(len(s)))]
        late = sum(1 for cy in cycles for t in arrivals if cy["ack"] < t < cy["resume"])
        busy_at_ack = [cy for cy in cycles if cy["active"] or any(cy["in_flight"])]
        acks = [cy["ack"] - cy["pause"] for cy in cycles]
        n_calls = sum(v for k, v in results.items() if isinstance(k, int))

        print(f"\n{n_calls} calls in {elapsed:.1f} s ({n_calls / elapsed:.1f}/s), {len(arrivals)} upstream arrivals, "
              f"{n_records} records")
        print("answers:", dict(results))
        print(f"latency ms: p50 {pct(latencies, .5) * 1000:.1f}  p95 {pct(latencies, .95) * 1000:.1f}  "
              f"p99 {pct(latencies, .99) * 1000:.1f}  max {max(latencies, default=0) * 1000:.1f}")
        if acks:
            print(f"pause cycles {len(cycles)}: drain ack p50 {statistics.median(acks) * 1000:.0f} ms, "
                  f"max {max(acks) * 1000:.0f} ms")
        print("gateway peak RSS MB:", [round(x) for x in peak_rss])
        checks = {
            "every call answered 200": n_calls == results[200] and n_calls > 0 and not results["transport_errors"],
            "no acknowledged call lost": not lost,
            "no record duplicated": not dup,
            "seq 0..n-1 per attempt": not bad_seq,
            "every record validates": invalid == 0,
            "no upstream call after a drain ack": late == 0,
            "nothing in flight at a drain ack": not busy_at_ack,
        }
        for name, passed in checks.items():
            print(f"  [{'ok' if passed else 'FAIL'}] {name}")
        if lost or dup or bad_seq:
            print(f"  lost {lost[:5]} dup {dup[:5]} bad seq {bad_seq[:5]}")
        return 0 if all(checks.values()) else 1
    finally:
        await store.close()
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if not args.keep:
            import redis

            r = redis.Redis.from_url(args.redis)
            keys = list(r.scan_iter(match=prefix + "*", count=1000))
            for i in range(0, len(keys), 1000):
                r.delete(*keys[i:i + 1000])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--pause-every", type=float, default=1.0, help="seconds between pause cycles")
    ap.add_argument("--pause-hold", type=float, default=0.3, help="seconds paused after the drain ack")
    ap.add_argument("--delay-max", type=float, default=0.15, help="upstream latency, uniform 0..this (s)")
    ap.add_argument("--think-max", type=float, default=0.3, help="agent pause between calls, uniform 0..this (s)")
    ap.add_argument("--redis", default=os.environ.get("AGL_REDIS_URL", "redis://127.0.0.1:6379/15"))
    ap.add_argument("--logs", default="runs/soak", help="folder for the processes' logs")
    ap.add_argument("--report-every", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the Redis keys")
    args = ap.parse_args()
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
