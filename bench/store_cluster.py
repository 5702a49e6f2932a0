"""One Redis vs Redis Cluster under the gateway (issue 15): calls/s and added latency, side by side in one run.

Starts a fake vLLM (``bench/fake_upstream.py``), a private ``redis-server`` (no persistence) and a local
Redis Cluster (3 masters + 3 replicas, ``scripts/local_redis_cluster.py``), then for each store setting

* ``redis``: one Redis;
* ``cluster``: the cluster, the gateway replying once the master has the record (``AGL_WAIT_REPLICAS=0``);
* ``cluster+wait1``: the cluster, the gateway replying once a replica holds it too (``AGL_WAIT_REPLICAS=1``);

and 1 and 2 gateway processes (``python -m agl_gateway serve --open``, chat route), measures

* added latency: one client alternating a direct upstream call and a gateway call (paired, same noise),
  p50 / p99 of the difference in ms;
* calls/s: ``--clients`` concurrent clients spread over the gateway processes for ``--duration`` s;
* record ms: the mean time a gateway spent writing a record (its ``agl_gateway_record_seconds``), which
  is where waiting for a replica shows;
* one record without a gateway: ``--store-calls`` sequential ``Store.record_call_json`` calls from the
  bench process itself (a 3 KB record), p50 / p99: the store's own cost per call, WAIT included.

Also the CPU each call costs, which other jobs on the machine disturb far less than wall-clock figures:
gateway CPU-ms per call (all gateway processes) and Redis CPU-ms per call (every ``redis-server`` of the
setting: one, or the six cluster nodes, replicas included), over the whole measurement.
Rounds (``--rounds``) repeat every setting in turn, so drift in the machine's load hits all of them alike;
the table shows the median over rounds. The 1-minute load average is printed before and after. At the
end every gateway call answered 200 is checked to be in its rollout's stream.

    .venv/bin/python bench/store_cluster.py                   # ~2 minutes
    .venv/bin/python bench/store_cluster.py --rounds 1 --duration 3 --pairs 100

Loopback only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import psutil
import redis
import redis.cluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gateway import cpu_s, free_port, pct, stop, wait_http  # noqa: E402  (bench/gateway.py helpers)
from local_redis_cluster import LocalCluster  # noqa: E402

BODY = (b'{"model":"bench-model","max_tokens":32,"messages":[{"role":"system","content":"You are a careful '
        b'assistant."},{"role":"user","content":"What is the sum of the first ten positive integers?"}]}')


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            if redis.Redis(port=port).ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start_gateways(n: int, up_url: str, redis_url: str, prefix: str, wait: int) -> list[tuple[subprocess.Popen, str]]:
    out = []
    env = dict(os.environ, AGL_WAIT_REPLICAS=str(wait), AGL_WAIT_TIMEOUT_MS="1000")
    for k in range(n):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "agl_gateway", "serve", "--upstream", up_url, "--port",
                                 str(port), "--open", "--prefix", prefix, "--redis", redis_url, "--log-level",
                                 "warning"], cwd=ROOT, env=dict(env, AGL_REPLICA_ID=f"bench-{k}"))
        out.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in out:
        wait_http(url + "/healthz", proc, 60)
    return out


def record_ms(gw_urls: list[str]) -> float:
    """Mean time the gateways spent writing a record (their ``agl_gateway_record_seconds`` histogram), ms."""
    total = count = 0.0
    for url in gw_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("agl_gateway_record_seconds_sum"):
                    total += float(line.split()[-1])
                elif line.startswith("agl_gateway_record_seconds_count"):
                    count += float(line.split()[-1])
    return total / count * 1000 if count else float("nan")


async def store_latency(url: str, prefix: str, wait: int, n: int) -> dict:
    """``n`` sequential :meth:`Store.record_call_json` calls from this process (no gateway, no HTTP): what one
    record costs in Redis round trips, the WAIT for a replica included. p50 / p99 in ms."""
    from agl_common.schemas import CallRecord
    from agl_common.store import Store

    store = Store(url, prefix, wait_replicas=wait, wait_timeout_ms=1000)
    body = CallRecord(rollout_id="-", attempt_id="0", seq=-1, route="chat", request={"q": "x" * 2000},
                      response={"a": "y" * 500}, prompt_token_ids=list(range(256)),
                      response_token_ids=list(range(32)), response_logprobs=[-0.5] * 32).model_dump_json().encode()
    lat = []
    try:
        for k in range(n + 50):
            t = time.perf_counter()
            await store.record_call_json(f"s{k % 64}", "0", body)
            if k >= 50:  # after the warm-up (connections, script load, slot map)
                lat.append((time.perf_counter() - t) * 1000)
    finally:
        await store.close()
    return {"store_p50": pct(lat, 50), "store_p99": pct(lat, 99)}


def settle(procs: list[psutil.Process], limit_s: float = 30.0) -> None:
    """Until the gateways are idle (< 5% CPU over 0.5 s): their start-up work (LiteLLM's import, in a
    thread after they answer) would otherwise be counted as the calls' CPU."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = [cpu_s(p) for p in procs]
        time.sleep(0.5)
        if all(cpu_s(p) - b < 0.025 for p, b in zip(procs, before)):
            return


async def post(session: aiohttp.ClientSession, url: str) -> int:
    async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as resp:
        await resp.read()
        return resp.status


async def measure(up_url: str, gw_urls: list[str], rids: list[str], pairs: int, clients: int,
                  duration: float) -> dict:
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    errors = 0
    async with aiohttp.ClientSession(connector=conn) as s:
        for k in range(20):  # warm up: connections, script load, slot map
            await post(s, f"{gw_urls[k % len(gw_urls)]}/rollouts/{rids[k % len(rids)]}/attempts/0/v1/chat/completions")
        added = []
        for k in range(pairs):
            rid = rids[k % len(rids)]
            t = time.perf_counter()
            await post(s, up_url + "/v1/chat/completions")
            direct = time.perf_counter() - t
            t = time.perf_counter()
            status = await post(s, f"{gw_urls[k % len(gw_urls)]}/rollouts/{rid}/attempts/0/v1/chat/completions")
            if status == 200:
                added.append((time.perf_counter() - t - direct) * 1000)
            else:
                errors += 1
        done = 0
        deadline = time.perf_counter() + duration

        async def worker(i: int) -> None:
            nonlocal done, errors
            k = 0
            while time.perf_counter() < deadline:
                rid = rids[(i * 7919 + k) % len(rids)]
                k += 1
                status = await post(s, f"{gw_urls[i % len(gw_urls)]}/rollouts/{rid}/attempts/0/v1/chat/completions")
                if status == 200:
                    done += 1
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {"p50": pct(added, 50), "p99": pct(added, 99), "calls_s": done / wall, "errors": errors,
            "calls": 20 + len(added) + done}


def records(url: str, prefix: str) -> int:
    if url.startswith("redis+cluster://"):
        host, port = url.split("//", 1)[1].split(",")[0].rsplit(":", 1)
        r = redis.cluster.RedisCluster(host=host, port=int(port))
    else:
        r = redis.Redis.from_url(url)
    n = sum(r.xlen(k) for k in r.scan_iter(match=prefix + "calls:*", count=1000))
    for k in list(r.scan_iter(match=prefix + "*", count=1000)):
        r.delete(k)
    r.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=150, help="paired direct/gateway calls for the added latency")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds of the calls/s phase")
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--store-calls", type=int, default=1000, help="sequential records timed without a gateway")
    ap.add_argument("--settings", default="redis,cluster,cluster+wait1")
    ap.add_argument("--gateways", default="1,2")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers below are stopped
    tmp = Path(tempfile.mkdtemp(prefix="agl-bench-store-"))
    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, str(HERE / "fake_upstream.py"), "--port", str(up_port)],
                                stdout=subprocess.DEVNULL)
    up_url = f"http://127.0.0.1:{up_port}"
    single, single_url = start_redis(tmp)
    cluster = LocalCluster().start()
    urls = {"redis": (single_url, 0), "cluster": (cluster.url, 0), "cluster+wait1": (cluster.url, 1)}
    cluster_pids = [p.pid for p in cluster.procs.values()]
    redis_pids = {"redis": [single.pid], "cluster": cluster_pids, "cluster+wait1": cluster_pids}
    rids = [f"b{k}" for k in range(a.rollouts)]
    results: dict[tuple[str, int], list[dict]] = {}
    load0 = os.getloadavg()
    try:
        wait_http(up_url + "/v1/models", upstream, 20)
        for rnd in range(a.rounds):
            for setting in a.settings.split(","):
                for n in map(int, a.gateways.split(",")):
                    url, wait = urls[setting]
                    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
                    gws = start_gateways(n, up_url, url, prefix, wait)
                    watched = {"gw": [psutil.Process(p.pid) for p, _ in gws],
                               "redis": [psutil.Process(pid) for pid in redis_pids[setting]]}
                    settle(watched["gw"])
                    cpu0 = {k: sum(cpu_s(p) for p in ps) for k, ps in watched.items()}
                    try:
                        res = asyncio.run(measure(up_url, [u for _, u in gws], rids, a.pairs, a.clients, a.duration))
                        for k, ps in watched.items():
                            res[f"{k}_cpu_ms"] = (sum(cpu_s(p) for p in ps) - cpu0[k]) * 1000 / res["calls"]
                        res["record_ms"] = record_ms([u for _, u in gws])
                    finally:
                        for proc, _ in gws:
                            stop(proc)
                    if n == 1:  # once per setting and round: it does not depend on the gateways
                        res.update(asyncio.run(store_latency(url, prefix, wait, a.store_calls)))
                        res["calls"] += a.store_calls + 50
                    res["stored"] = records(url, prefix)
                    results.setdefault((setting, n), []).append(res)
                    print(f"round {rnd + 1} {setting:14s} {n} gw: {res['calls_s']:7.1f} calls/s, added p50 "
                          f"{res['p50']:.2f} ms p99 {res['p99']:.2f} ms, record {res['record_ms']:.2f} ms, "
                          f"gw CPU {res['gw_cpu_ms']:.2f} ms/call, "
                          f"Redis CPU {res['redis_cpu_ms']:.3f} ms/call, errors {res['errors']}, "
                          f"store alone p50 {res.get('store_p50', float('nan')):.3f} ms, "
                          f"stored {res['stored']}/{res['calls']}", flush=True)
    finally:
        cluster.stop()
        stop(single)
        stop(upstream)
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    print(f"\nload average (1 min) before {load0[0]:.2f}, after {load1[0]:.2f}; {os.cpu_count()} CPUs; "
          f"{a.clients} clients for calls/s, {a.pairs} pairs for added latency; median of {a.rounds} round(s)\n")
    print("| store | gateways | calls/s | added p50 ms | added p99 ms | record ms (mean) | gw CPU ms/call "
          "| Redis CPU ms/call | errors | stored/answered |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (setting, n), rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("calls_s", "p50", "p99", "record_ms", "gw_cpu_ms",
                                                            "redis_cpu_ms")}
        print(f"| {setting} | {n} | {med['calls_s']:.0f} | {med['p50']:.2f} | {med['p99']:.2f} | "
              f"{med['record_ms']:.2f} | "
              f"{med['gw_cpu_ms']:.2f} | {med['redis_cpu_ms']:.3f} | {sum(r['errors'] for r in rs)} | "
              f"{sum(r['stored'] for r in rs)}/{sum(r['calls'] for r in rs)} |")
    print("\n| store | one record, no gateway: p50 ms | p99 ms |")
    print("|---|---|---|")
    for (setting, n), rs in results.items():
        if n == 1:
            print(f"| {setting} | {statistics.median(r['store_p50'] for r in rs):.3f} | "
                  f"{statistics.median(r['store_p99'] for r in rs):.3f} |")


if __name__ == "__main__":
    main()
