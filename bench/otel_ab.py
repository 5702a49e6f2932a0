"""Tracing on vs off in the whole gateway, paired (issue 17): two gateway processes side by side, one with
``--otel`` (spans exported over OTLP/HTTP to ``bench/otlp_sink.py``), one without, in front of the same fake
vLLM (``bench/fake_upstream.py``) and Redis. Each client sends one chat call to each gateway in turn, so both
see the same machine noise; this matters on a shared machine, where two separate runs of ``gateway.py`` can
differ more than tracing costs.

Per phase (``--clients`` concurrent clients, ``--duration`` seconds) it prints, for each gateway: calls, p50 and
p99 latency, and CPU ms per call (psutil, that gateway's process: request path, batch thread and export); then
the difference on − off, and the spans the sink received against the traced gateway's calls. Nothing is
asserted. Only loopback is used; the keys of both prefixes are deleted at the end.

    .venv/bin/python bench/otel_ab.py [--clients 1,16] [--duration 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import orjson
import psutil
import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gateway import BODIES, ROOT, cpu_s, free_port, pct, stop, wait_http  # noqa: E402


async def drive(urls: dict[str, str], clients: int, duration: float) -> dict[str, list[float]]:
    """``clients`` workers, each calling every gateway in turn until ``duration`` s; latencies (s) per name."""
    import aiohttp

    body = orjson.dumps(BODIES["chat"])
    lat: dict[str, list[float]] = {name: [] for name in urls}
    errors = {name: 0 for name in urls}
    deadline = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(w: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                for name, url in urls.items():
                    t = time.perf_counter()
                    async with session.post(url.format(rid=f"r{(w * 7919 + k) % 256:04d}"), data=body,
                                            headers={"content-type": "application/json"}) as resp:
                        await resp.read()
                        if resp.status == 200:
                            lat[name].append(time.perf_counter() - t)
                        else:
                            errors[name] += 1
                k += 1

        await asyncio.gather(*(worker(w) for w in range(clients)))
    for name, n in errors.items():
        if n:
            print(f"  {name}: {n} errors")
    return lat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,16", help="comma-separated concurrent client counts")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per phase")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--redis", default=os.environ.get("AGL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = ap.parse_args()
    r = redis.Redis.from_url(args.redis)
    prefixes = {"off": f"bench-{uuid.uuid4().hex[:10]}:", "on": f"bench-{uuid.uuid4().hex[:10]}:"}
    procs: list[subprocess.Popen] = []
    try:
        up_port, sink_port = free_port(), free_port()
        upstream = subprocess.Popen([sys.executable, str(HERE / "fake_upstream.py"), "--port", str(up_port)],
                                    stdout=subprocess.DEVNULL)
        sink = subprocess.Popen([sys.executable, str(HERE / "otlp_sink.py"), "--port", str(sink_port)],
                                stdout=subprocess.DEVNULL)
        procs += [upstream, sink]
        wait_http(f"http://127.0.0.1:{up_port}/v1/models", upstream, 20)
        wait_http(f"http://127.0.0.1:{sink_port}/count", sink, 30)
        gws, urls = {}, {}
        for name, prefix in prefixes.items():
            port = free_port()
            cmd = [sys.executable, "-m", "agl_gateway", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
                   "--port", str(port), "--open", "--prefix", prefix, "--redis", args.redis, "--log-level", "warning"]
            env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}",
                       OTEL_SDK_DISABLED="false")
            gws[name] = subprocess.Popen(cmd + (["--otel"] if name == "on" else []), cwd=ROOT, env=env)
            procs.append(gws[name])
            wait_http(f"http://127.0.0.1:{port}/healthz", gws[name], 60)
            urls[name] = f"http://127.0.0.1:{port}/rollouts/{{rid}}/attempts/0/v1/chat/completions"
        ps = {name: psutil.Process(p.pid) for name, p in gws.items()}
        asyncio.run(drive(urls, 16, 3.0))  # warm-up: rollouts created, pools filled
        for p in ps.values():  # idle: LiteLLM's background import and the warm-up's tail are not counted
            deadline = time.monotonic() + 90
            while p.cpu_percent(0.5) > 5 and time.monotonic() < deadline:
                pass
        print(f"load avg {os.getloadavg()[0]:.1f}; chat, 256 prompt + 32 completion tokens; {args.duration:g} s "
              "per phase; both gateways called in turn by each client")
        print(f"{'clients':>7} {'repeat':>6} {'gateway':>8} {'calls':>6} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'CPU ms/call':>11}")
        for clients in [int(c) for c in args.clients.split(",")]:
            for rep in range(args.repeats):
                before = {name: cpu_s(p) for name, p in ps.items()}
                lat = asyncio.run(drive(urls, clients, args.duration))
                time.sleep(0.5)  # the batch thread's export of the last spans is counted too
                cpu = {name: (cpu_s(p) - before[name]) / max(len(lat[name]), 1) * 1e3 for name, p in ps.items()}
                for name in ("off", "on"):
                    xs = lat[name]
                    print(f"{clients:>7} {rep + 1:>6} {name:>8} {len(xs):>6} {pct(xs, 50) * 1e3:>7.2f} "
                          f"{pct(xs, 99) * 1e3:>7.2f} {cpu[name]:>11.3f}")
                d50 = (pct(lat["on"], 50) - pct(lat["off"], 50)) * 1e3
                print(f"{'':>7} {'':>6} {'on − off':>8} {'':>6} {d50:>7.2f} {'':>7} {cpu['on'] - cpu['off']:>11.3f}"
                      f"   (load avg {os.getloadavg()[0]:.1f})")
        stop(gws["on"])  # shutdown flushes the last spans
        with urllib.request.urlopen(f"http://127.0.0.1:{sink_port}/count", timeout=5) as resp:
            spans = orjson.loads(resp.read())["spans"]
        recorded = sum(r.xlen(k) for k in r.scan_iter(match=prefixes["on"] + "calls:*", count=1000))
        print(f"spans received by the sink: {spans}; calls recorded by the traced gateway: {recorded}"
              + ("" if spans == recorded else "  (MISMATCH)"))
    finally:
        for p in reversed(procs):
            stop(p)
        for prefix in prefixes.values():
            keys = list(r.scan_iter(match=prefix + "*", count=1000))
            for k in range(0, len(keys), 500):
                r.delete(*keys[k:k + 500])


if __name__ == "__main__":
    main()
