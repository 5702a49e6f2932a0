"""Gateway overhead benchmark (issue 7): added latency, calls/s and CPU per call of one gateway process.

Three processes besides Redis, so that no one's CPU is counted as another's:

* a fake vLLM (``bench/fake_upstream.py``: raw asyncio HTTP/1.1, fixed vLLM-shaped answer); its own
  capacity is measured first, with a raw keep-alive client, to show it is never the bottleneck;
* the gateway, exactly as deployed: ``python -m agl_gateway serve --open --prefix bench-<uuid>:``;
* a load generator (a spawned process, aiohttp on uvloop) that calls the fake upstream directly and the
  gateway (``/rollouts/{rid}/attempts/0/v1/...``, a few hundred rollout ids) side by side.

At 1 client the load generator alternates one direct call and one gateway call (paired, so both see the
same machine noise); at 64 clients it runs the gateway alone, then the upstream alone. Reported per route
(chat, and the translated ``/v1/messages`` and ``/v1/responses``) and client count: added latency p50/p99
(gateway minus direct, ms), gateway calls/s (at 1 client: 1 / mean gateway latency), gateway CPU-ms per
call (psutil, gateway pid) and the single-core ceiling that implies, plus Redis CPU per call (``INFO cpu``)
and Redis connections opened (``INFO stats``; both approximate if Redis is shared).
At the end every gateway call is checked to be in its rollout's Redis stream, then the prefix is deleted.

    .venv/bin/python bench/gateway.py                      # ~1 minute
    .venv/bin/python bench/gateway.py --profile py-spy      # + where the gateway's CPU goes (chat@64)
    .venv/bin/python bench/gateway.py --profile cprofile --profile-phase chat@64,messages@64
    .venv/bin/python bench/gateway.py --otel                # gateway with --otel, spans to bench/otlp_sink.py

``--profile`` adds, after the measured phases (which it does not perturb), one more run of each
``--profile-phase`` (default ``chat@64``) with the gateway profiled, and prints the CPU-ms per call by
component (uvicorn, starlette/fastapi, aiohttp, redis-py, pydantic, LiteLLM...) and the top
functions. ``py-spy``: sampling (``--gil``: only samples holding the GIL, i.e. on CPU or about to be);
needs ``.venv/bin/pip install py-spy``. ``cprofile``: the gateway is started under a wrapper whose
cProfile (timer: the main thread's CPU time, so preemption by other processes is not counted) is switched
on and off by SIGUSR1/SIGUSR2 around the phase; it also shows C functions (orjson, sockets), but its
per-call overhead inflates code made of many small Python calls. Files: ``--profile-out`` prefix.

Only loopback is used. Nothing is asserted: targets are printed next to the measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import orjson
import psutil
import redis
from agl_trainer.services import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

TARGET_ADDED_P50_MS = 1.0      # at 1 client
TARGET_CALLS_S = 600.0         # per gateway process, at 64 clients
REFERENCE = {1: "210 calls/s, +3.8 ms p50", 64: "130 calls/s"}

SYSTEM = "You are a careful assistant. Answer with one short sentence. " * 8
QUESTION = "Rollout benchmark: what is the sum of the first ten positive integers? Show the result only. " * 4

BODIES = {
    "chat": {"model": "bench-model", "max_tokens": 32, "temperature": 1.0,
             "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]},
    "messages": {"model": "claude-bench", "max_tokens": 32, "system": SYSTEM,
                 "messages": [{"role": "user", "content": QUESTION}]},
    "responses": {"model": "bench-model", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 32},
}
ROUTE_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


# ------------------------------------------------------------------------------------------ helpers
def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def redis_conns(r: redis.Redis) -> int:
    """Connections Redis has accepted so far (all clients: approximate if Redis is shared)."""
    return int(r.info("stats")["total_connections_received"])


def open_redis_conns(proc: psutil.Process, port: int) -> int:
    return sum(1 for c in proc.net_connections("tcp") if c.raddr and c.raddr.port == port)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, wait: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# ------------------------------------------------------------------------- load generator (child)
def loadgen_main(conn) -> None:
    """Runs in its own process: executes phases sent over ``conn``, returns latencies."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_loadgen(conn))


async def _loadgen(conn) -> None:
    import aiohttp

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=60), skip_auto_headers=("User-Agent",), auto_decompress=False)
    loop = asyncio.get_running_loop()
    try:
        while True:
            cmd, spec = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                break
            if cmd == "phase":
                result = await _phase(session, spec)
            elif cmd == "raw":
                result = await _raw_capacity(spec)
            else:
                result = {"error": f"unknown command {cmd}"}
            conn.send(result)
    finally:
        await session.close()


async def _phase(session, spec: dict) -> dict:
    """``spec``: targets [(name, url template with {rid}, body bytes)], concurrency, duration_s, max_calls.

    Each of ``concurrency`` workers calls every target in turn (so 2 targets: paired direct/gateway calls)
    until ``duration_s`` has passed or ``max_calls`` rounds were started.
    """
    targets = spec["targets"]
    rids = spec.get("rids") or ["-"]
    lat: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    errors: dict[str, Counter] = {name: Counter() for name, _, _ in targets}
    counters = {name: itertools.count(spec.get("rid_offset", 0)) for name, _, _ in targets}
    rounds = itertools.count()
    max_calls = spec.get("max_calls") or 1 << 60
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    deadline = t0 + spec["duration_s"]

    async def worker() -> None:
        while time.perf_counter() < deadline and next(rounds) < max_calls:
            for name, url, body in targets:
                rid = rids[next(counters[name]) % len(rids)]
                t = time.perf_counter()
                try:
                    async with session.post(url.format(rid=rid), data=body, headers=headers) as resp:
                        data = await resp.read()
                        status = resp.status
                except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                    errors[name][type(exc).__name__] += 1
                    continue
                dt = time.perf_counter() - t
                if status == 200:
                    lat[name].append(dt)
                else:
                    errors[name][f"{status} {data[:120]!r}"] += 1

    await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
    return {"wall_s": time.perf_counter() - t0, "lat": lat, "errors": {k: dict(v) for k, v in errors.items()}}


async def _raw_capacity(spec: dict) -> dict:
    """Keep-alive POSTs on ``connections`` raw sockets for ``duration_s``: the fake upstream's capacity."""
    loop = asyncio.get_running_loop()
    body = spec["body"]
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    done = 0
    deadline = time.perf_counter() + spec["duration_s"]
    finished = loop.create_future()
    open_conns = spec["connections"]

    class Client(asyncio.Protocol):
        def connection_made(self, transport):
            self.t, self.buf, self.need = transport, bytearray(), -1
            transport.write(request)

        def data_received(self, data):
            nonlocal done
            self.buf += data
            while True:
                if self.need < 0:
                    end = self.buf.find(b"\r\n\r\n")
                    if end < 0:
                        return
                    head = bytes(self.buf[:end]).lower()
                    i = head.find(b"content-length:")
                    self.need = end + 4 + int(head[i + 15:].split(b"\r\n", 1)[0])
                if len(self.buf) < self.need:
                    return
                del self.buf[:self.need]
                self.need = -1
                done += 1
                if time.perf_counter() < deadline:
                    self.t.write(request)
                else:
                    self.t.close()
                    return

        def connection_lost(self, exc):
            nonlocal open_conns
            open_conns -= 1
            if open_conns == 0 and not finished.done():
                finished.set_result(None)

    t0 = time.perf_counter()
    for _ in range(spec["connections"]):
        await loop.create_connection(Client, "127.0.0.1", spec["port"])
    await asyncio.wait_for(finished, spec["duration_s"] + 30)
    return {"wall_s": time.perf_counter() - t0, "calls": done}


#: ``python -c`` wrapper of ``agl_gateway``: cProfile (main thread CPU time) on at SIGUSR1, off + dumped at
#: SIGUSR2 to the path written in ``$AGL_BENCH_PROFILE_CTL``. Nothing is profiled between the signals.
CPROFILE_WRAPPER = """
import cProfile, os, runpy, signal, sys, time
sys.argv = ["agl_gateway"] + sys.argv[1:]
prof = None
def on(*_):
    global prof
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
def off(*_):
    global prof
    if prof is not None:
        prof.disable()
        prof.dump_stats(open(os.environ["AGL_BENCH_PROFILE_CTL"]).read().strip())
        prof = None
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
runpy.run_module("agl_gateway", run_name="__main__", alter_sys=True)
"""


def gateway_version() -> str:
    """Commit, plus a hash of the gateway/common sources when they differ from it (results name the code)."""
    import hashlib

    if os.environ.get("PYTHONPATH"):  # an A/B run against another checkout: name what is imported
        where = subprocess.run([sys.executable, "-c", "import agl_gateway; print(agl_gateway.__file__)"],
                               capture_output=True, text=True, check=False).stdout.strip()
        src = Path(where).parents[4] if where else ROOT
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True,
                              check=False).stdout.strip()
        return f"{head or 'unknown'} at {src} (PYTHONPATH)"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "packages/gateway", "packages/common"], cwd=ROOT,
                               capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "unknown"
    if not dirty:
        return head
    h = hashlib.sha1()
    for f in sorted((ROOT / "packages").glob("*/src/agl_*/**/*.py")):
        if f.parts[-4] in ("gateway", "common") or "agl_gateway" in f.parts or "agl_common" in f.parts:
            h.update(f.read_bytes())
    return f"{head} + uncommitted changes (sources sha1 {h.hexdigest()[:10]})"


# ------------------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.prefix = f"bench-{uuid.uuid4().hex[:12]}:"
        self.rids = [f"r{k:04d}" for k in range(args.rollouts)]
        self.r = redis.Redis.from_url(args.redis)
        self.redis_port = self.r.connection_pool.connection_kwargs.get("port", 6379)
        self.upstream = self.gateway = self.spy = self.sink = None
        self.spans = None
        self.loadgen = self.conn = None
        self.rows: list[dict] = []
        self.gw_ok_calls = 0
        self.notes: list[str] = []
        self.profiles: dict[str, str] = {}
        self.profiled_rows: dict[str, dict] = {}
        self.prof_ctl = f"{args.profile_out}.ctl"

    # -- processes
    def start(self) -> None:
        a = self.args
        self.up_port, self.gw_port = free_port(), free_port()
        self.upstream = subprocess.Popen(
            [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(self.up_port),
             "--prompt-tokens", str(a.prompt_tokens), "--completion-tokens", str(a.completion_tokens)],
            stdout=subprocess.DEVNULL)
        self.up_url = f"http://127.0.0.1:{self.up_port}"
        wait_http(self.up_url + "/v1/models", self.upstream, 20)
        gw_cmd = [sys.executable] + (["-c", CPROFILE_WRAPPER] if a.profile == "cprofile" else ["-m", "agl_gateway"])
        gw_cmd += ["serve", "--upstream", self.up_url, "--port", str(self.gw_port),
                   "--open", "--prefix", self.prefix, "--redis", a.redis, "--log-level", "warning"]
        env = dict(os.environ, AGL_BENCH_PROFILE_CTL=self.prof_ctl)
        if a.otel:  # one OpenTelemetry span per call, exported over OTLP/HTTP to a sink process of its own
            sink_port = free_port()
            self.sink = subprocess.Popen([sys.executable, str(HERE / "otlp_sink.py"), "--port", str(sink_port)],
                                         stdout=subprocess.DEVNULL)
            self.sink_url = f"http://127.0.0.1:{sink_port}"
            wait_http(self.sink_url + "/count", self.sink, 30)
            gw_cmd.append("--otel")
            env.update(OTEL_EXPORTER_OTLP_ENDPOINT=self.sink_url, OTEL_SDK_DISABLED="false")
        self.gateway = subprocess.Popen(gw_cmd, cwd=ROOT, env=env)
        self.gw_url = f"http://127.0.0.1:{self.gw_port}"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.loadgen = ctx.Process(target=loadgen_main, args=(child,), daemon=True)
        self.loadgen.start()
        wait_http(self.gw_url + "/healthz", self.gateway, 60)
        self.p_gw, self.p_up = psutil.Process(self.gateway.pid), psutil.Process(self.upstream.pid)
        self.p_lg = psutil.Process(self.loadgen.pid)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
        if self.loadgen is not None:
            self.loadgen.join(10)
            if self.loadgen.is_alive():
                self.loadgen.terminate()
        stop(self.spy, signal.SIGINT)
        with contextlib.suppress(OSError):
            os.unlink(self.prof_ctl)
        stop(self.gateway, signal.SIGINT)  # SIGINT: graceful, and cProfile writes its file (and spans flush)
        stop(self.upstream)
        if self.sink is not None:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(self.sink_url + "/count", timeout=5) as resp:
                    self.spans = orjson.loads(resp.read())
            stop(self.sink)
        keys = list(self.r.scan_iter(match=self.prefix + "*", count=1000))
        for k in range(0, len(keys), 500):
            self.r.delete(*keys[k:k + 500])
        self.deleted = len(keys)

    # -- phases
    def call(self, cmd: str, spec: dict) -> dict:
        self.conn.send((cmd, spec))
        return self.conn.recv()

    def measured(self, cmd: str, spec: dict) -> dict:
        before = (cpu_s(self.p_gw), cpu_s(self.p_up), cpu_s(self.p_lg), redis_cpu_s(self.r), redis_conns(self.r))
        res = self.call(cmd, spec)
        after = (cpu_s(self.p_gw), cpu_s(self.p_up), cpu_s(self.p_lg), redis_cpu_s(self.r), redis_conns(self.r))
        deltas = [y - x for x, y in zip(before, after, strict=True)]
        res["cpu"] = dict(zip(("gateway", "upstream", "loadgen", "redis"), deltas[:4], strict=True))
        res["redis_new_conns"] = after[4] - before[4]
        res["gw_redis_conns"] = open_redis_conns(self.p_gw, self.redis_port)
        return res

    def gw_target(self, route: str) -> tuple[str, str, bytes]:
        return ("gateway", self.gw_url + "/rollouts/{rid}/attempts/0" + ROUTE_PATHS[route],
                orjson.dumps(BODIES[route]))

    def direct_target(self) -> tuple[str, str, bytes]:
        return ("direct", self.up_url + "/v1/chat/completions", orjson.dumps(BODIES["chat"]))

    def check_errors(self, res: dict, what: str) -> None:
        for name, errs in res["errors"].items():
            if errs:
                self.notes.append(f"{what} {name}: errors {errs}")

    def run(self) -> None:
        a = self.args
        # 1. the fake upstream's own capacity (raw client), then its latency through aiohttp
        res = self.measured("raw", {"port": self.up_port, "connections": 64, "duration_s": a.upstream_s,
                                    "body": orjson.dumps(BODIES["chat"])})
        self.up_capacity = res["calls"] / res["wall_s"]
        self.up_cpu_us = res["cpu"]["upstream"] / max(res["calls"], 1) * 1e6
        # 2. warm-up: create every rollout (open mode), load LiteLLM, fill the connection pools
        for route in ["chat"] + [r for r in ("messages", "responses") if r in a.routes or r == "messages"]:
            res = self.call("phase", {"targets": [self.gw_target(route)], "rids": self.rids, "concurrency": 16,
                                      "duration_s": 60, "max_calls": len(self.rids) if route == "chat" else 64})
            self.gw_ok_calls += len(res["lat"]["gateway"])
            self.check_errors(res, f"warm-up {route}")
        self.call("phase", {"targets": [self.direct_target()], "concurrency": 64, "duration_s": 0.5})
        # 3. measured phases
        for route in a.routes:
            for c in a.clients:
                self.rows.append(self.phase(route, c))
        # 4. profiled repeats (not in the table)
        if a.profile:
            for phase in a.profile_phase:
                route, c = phase.split("@")
                self.profiled_rows[phase] = self.phase(route, int(c), profile=True)

    def phase(self, route: str, c: int, profile: bool = False) -> dict:
        a = self.args
        self.current = f"{route}@{c}"
        self.wait_idle()
        if profile:
            self.start_profile()
        if c == 1:  # paired: direct, gateway, direct, gateway...
            res = self.measured("phase", {"targets": [self.direct_target(), self.gw_target(route)],
                                          "rids": self.rids, "concurrency": 1, "duration_s": a.duration})
            direct = res["lat"]["direct"]
            gw_rate = len(res["lat"]["gateway"]) / sum(res["lat"]["gateway"]) if res["lat"]["gateway"] else 0.0
        else:
            res = self.measured("phase", {"targets": [self.gw_target(route)], "rids": self.rids,
                                          "rid_offset": 7 * c, "concurrency": c, "duration_s": a.duration})
            gw_rate = len(res["lat"]["gateway"]) / res["wall_s"]
        if profile:
            self.stop_profile()
        if c != 1:
            dres = self.call("phase", {"targets": [self.direct_target()], "concurrency": c,
                                       "duration_s": min(2.0, a.duration)})
            direct = dres["lat"]["direct"]
            self.check_errors(dres, f"{route}@{c} direct")
        self.check_errors(res, f"{route}@{c}")
        gw = res["lat"]["gateway"]
        n_gw = len(gw) + sum(res["errors"]["gateway"].values())
        self.gw_ok_calls += len(gw)
        return {
            "route": route, "clients": c, "calls": len(gw), "errors": n_gw - len(gw), "rate": gw_rate,
            "d50": pct(direct, 50) * 1e3, "d99": pct(direct, 99) * 1e3,
            "g50": pct(gw, 50) * 1e3, "g99": pct(gw, 99) * 1e3, "gmean": statistics.fmean(gw) * 1e3 if gw else 0,
            "cpu_ms": res["cpu"]["gateway"] / max(n_gw, 1) * 1e3,
            "redis_ms": res["cpu"]["redis"] / max(n_gw, 1) * 1e3,
            "up_cpu_pct": res["cpu"]["upstream"] / res["wall_s"] * 100,
            "lg_cpu_pct": res["cpu"]["loadgen"] / res["wall_s"] * 100,
            "gw_cpu_pct": res["cpu"]["gateway"] / res["wall_s"] * 100,
            "redis_new_conns": res["redis_new_conns"], "gw_redis_conns": res["gw_redis_conns"],
        }

    def wait_idle(self, limit_s: float = 30.0) -> None:
        """Wait until the gateway is idle (LiteLLM's background import, a previous phase's tail)."""
        deadline = time.monotonic() + limit_s
        while self.p_gw.cpu_percent(0.3) > 5 and time.monotonic() < deadline:
            pass

    def start_profile(self) -> None:
        a = self.args
        if a.profile == "py-spy":
            self.profiles[self.current] = out = f"{a.profile_out}.{self.current}.txt"
            spy = Path(sys.executable).with_name("py-spy")
            self.spy = subprocess.Popen([str(spy), "record", "--pid", str(self.gateway.pid), "--format", "raw",
                                         "--function", "--gil", "--rate", "200", "-o", out],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
        else:
            self.profiles[self.current] = out = f"{a.profile_out}.{self.current}.prof"
            Path(self.prof_ctl).write_text(out)
            self.gateway.send_signal(signal.SIGUSR1)

    def stop_profile(self) -> None:
        if self.spy is not None:
            stop(self.spy, signal.SIGINT)
            self.spy = None
        else:
            out = self.profiles[self.current]
            with contextlib.suppress(OSError):
                os.unlink(out)
            self.gateway.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while not Path(out).exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    # -- durability
    def check_durable(self) -> str:
        pipe = self.r.pipeline()
        for rid in self.rids:
            pipe.xlen(self.prefix + f"calls:{{{rid}}}")
        stored = sum(pipe.execute())
        bad = 0
        for rid in self.rids[:: max(1, len(self.rids) // 8)]:
            for _, fields in self.r.xrange(self.prefix + f"calls:{{{rid}}}", count=20):
                rec = orjson.loads(fields[b"d"])
                ok = (rec["status"] == "ok" and len(rec["prompt_token_ids"]) == self.args.prompt_tokens
                      and len(rec["response_token_ids"]) == self.args.completion_tokens
                      and len(rec["response_logprobs"] or []) == self.args.completion_tokens)
                if not ok and not bad:
                    brief = {k: len(v) if isinstance(v, list) else v for k, v in rec.items()
                             if k not in ("request", "response")}
                    self.notes.append(f"first bad record: {brief}")
                bad += not ok
        return (f"{stored} records in Redis streams for {self.gw_ok_calls} answered gateway calls"
                f" ({'all durable' if stored == self.gw_ok_calls else 'MISMATCH'}); "
                f"sampled records with wrong ids/logprobs: {bad}")

    # -- report
    def report(self, durable: str) -> None:
        a = self.args
        load = os.getloadavg()
        print()
        print(f"AGL gateway benchmark — {platform.python_implementation()} {platform.python_version()}, "
              f"{psutil.cpu_count()} CPUs, load avg {load[0]:.1f}/{load[1]:.1f} (other work shares this machine)")
        print(f"gateway source: {gateway_version()}")
        print("tracing: " + ("off" if not a.otel else f"on (--otel): the OTLP sink received "
                             f"{(self.spans or {}).get('spans', '?')} spans in {(self.spans or {}).get('requests', '?')}"
                             f" export requests"))
        print(f"answer: {a.prompt_tokens} prompt + {a.completion_tokens} completion tokens with logprobs; "
              f"{len(self.rids)} rollout ids; {a.duration:g} s per phase")
        print(f"fake upstream capacity: {self.up_capacity:,.0f} calls/s with a raw 64-connection client "
              f"(client and upstream share the CPUs); {self.up_cpu_us:.0f} µs upstream CPU per call "
              f"→ ~{1e6 / max(self.up_cpu_us, 1e-9):,.0f} calls/s per core")
        print()
        hdr = (f"{'route':<10}{'clients':>7}{'calls':>7}{'err':>5}{'gw calls/s':>11}{'direct p50/p99':>16}"
               f"{'gateway p50/p99':>17}{'added p50':>10}{'added p99':>10}{'gw CPU ms/call':>15}"
               f"{'CPU ceiling/s':>14}{'redis CPU ms':>13}{'upstream/client CPU':>20}{'redis conns new/open':>21}")
        print(hdr)
        print("-" * len(hdr))
        for row in self.rows:
            print(f"{row['route']:<10}{row['clients']:>7}{row['calls']:>7}{row['errors']:>5}{row['rate']:>11.0f}"
                  f"{row['d50']:>8.2f}/{row['d99']:<7.2f}{row['g50']:>9.2f}/{row['g99']:<7.2f}"
                  f"{row['g50'] - row['d50']:>10.2f}{row['g99'] - row['d99']:>10.2f}{row['cpu_ms']:>15.2f}"
                  f"{1e3 / max(row['cpu_ms'], 1e-9):>14.0f}{row['redis_ms']:>13.3f}"
                  f"{row['up_cpu_pct']:>12.0f}% /{row['lg_cpu_pct']:>4.0f}%"
                  f"{row['redis_new_conns']:>15}/{row['gw_redis_conns']:<5}")
        print()
        print("targets (per gateway process, every call durably in Redis) vs this run:")
        for row in self.rows:
            ref = f"reference design: {REFERENCE[row['clients']]}" if row["route"] == "chat" and \
                row["clients"] in REFERENCE else ""
            if row["clients"] == 1:
                verdict = "meets" if row["g50"] - row["d50"] <= TARGET_ADDED_P50_MS else "misses"
                print(f"  {row['route']:<10} 1 client : added p50 {row['g50'] - row['d50']:6.2f} ms "
                      f"(target ≤ {TARGET_ADDED_P50_MS:g} ms: {verdict}); {row['rate']:5.0f} calls/s  {ref}")
            else:
                verdict = "meets" if row["rate"] >= TARGET_CALLS_S else "misses"
                print(f"  {row['route']:<10}{row['clients']:>2} clients: {row['rate']:6.0f} calls/s "
                      f"(target ≥ {TARGET_CALLS_S:g}: {verdict}; CPU-bound ceiling "
                      f"{1e3 / max(row['cpu_ms'], 1e-9):.0f}/s at {row['gw_cpu_pct']:.0f}% of a core)  {ref}")
        print(f"durability: {durable}")
        for note in self.notes:
            print(f"note: {note}")


COMPONENTS = [  # (label, substrings of a frame's file): first match wins
    ("agl_gateway / agl_common (own code)", ("agl_gateway/", "agl_common/")),
    ("uvicorn + httptools/h11 (HTTP server)", ("uvicorn/", "h11/", "httptools")),
    ("starlette + fastapi (routing, middleware)", ("starlette/", "fastapi/")),
    ("aiohttp (upstream client)", ("aiohttp/",)),
    ("httpx + httpcore (upstream client)", ("httpx/", "httpcore/")),
    ("redis-py + hiredis (rollout GET, record script, control, heartbeat)", ("redis/", "hiredis")),
    ("pydantic (CallRecord, Rollout)", ("pydantic/", "pydantic_core/")),
    ("litellm (translation)", ("litellm/", "openai/", "anthropic/")),
    ("prometheus_client", ("prometheus_client/",)),
    ("orjson", ("orjson",)),
]
#: Library-generic code (anyio, asyncio streams, contextlib...): its time counts to the component that called it.
GENERIC = ("anyio/", "sniffio", "contextlib", "enum.py", "weakref", "typing.py", "abc.py", "functools.py",
           "asyncio/", "<frozen", "re/", "email/", "importlib", "copy.py", "dataclasses.py", "threading.py",
           "logging/", "socket.py", "selectors.py", "urllib/", "http/cookiejar", "ipaddress", "reprlib", "inspect.py",
           "~")
EVENT_LOOP = "event loop (uvloop C code: polling, socket I/O, callbacks)"
#: Frames that only start the server: time whose innermost non-generic frame is one of these is the event loop's.
ROOT_FRAMES = ("uvicorn/main.py", "uvicorn/server.py", "uvicorn/_compat.py", "agl_gateway/cli.py",
               "agl_gateway/__main__.py", "typer/", "click/", "runpy", "<module>", "<string>")


def frame_component(frame: str) -> str | None:
    if any(k in frame for k in ROOT_FRAMES):
        return EVENT_LOOP
    return component(frame)


def component(frame: str) -> str | None:
    """The component of one frame, ``None`` for library-generic code."""
    for label, keys in COMPONENTS:
        if any(k in frame for k in keys):
            return label
    if any(k in frame for k in GENERIC):
        return None
    path = frame.rsplit("(", 1)[-1].rstrip(")").split(":")[0] if "(" in frame else frame.split(" ")[0]
    parts = Path(path).parts
    if "site-packages" in parts and parts.index("site-packages") + 1 < len(parts):
        return f"other ({parts[parts.index('site-packages') + 1]})"
    return f"other ({'/'.join(parts[-2:]) or frame[:40]})"


def print_py_spy(path: str, top: int, phase: str = "", cpu_ms: float = 0.0) -> None:
    """Self and inclusive time per function from py-spy's collapsed stacks (``--format raw --function``)."""
    self_t: Counter = Counter()
    incl: Counter = Counter()
    comp: Counter = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        self_t[frames[-1]] += n
        comp[next((c for c in map(frame_component, reversed(frames)) if c), EVENT_LOOP)] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        print("py-spy: no samples")
        return
    print(f"\npy-spy, {phase}: {total} samples of the gateway while busy; {cpu_ms:.2f} CPU-ms per call")
    print("CPU per call by component (the sample's innermost non-generic frame: anyio, asyncio streams, "
          "sockets count to their caller; C code counts to its Python caller)")
    for label, n in comp.most_common():
        print(f"  {100 * n / total:5.1f}%  {cpu_ms * n / total:5.2f} ms  {label}")
    print(f"top {top} functions by own time")
    for f, n in self_t.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {f}")
    print("the gateway's own functions by inclusive time")
    own = [(f, n) for f, n in incl.items()
           if ("agl_gateway/" in f or "agl_common/" in f) and not any(k in f for k in ROOT_FRAMES)]
    for f, n in sorted(own, key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * n / total:5.1f}%  {cpu_ms * n / total:5.2f} ms  {f}")


def cprofile_component(stats: dict, key: tuple) -> str:
    """Component of a cProfile entry, following the heaviest caller out of C and library-generic code."""
    seen = set()
    while key not in seen:
        seen.add(key)
        file, _, name = key
        found = frame_component(f"{file} {name}" if file != "~" else "~")
        if found:
            return found
        callers = stats.get(key, (0, 0, 0, 0, {}))[4]
        if not callers:
            break
        key = max(callers.items(), key=lambda kv: kv[1][3])[0]
    return EVENT_LOOP


def print_cprofile(path: str, top: int, phase: str, cpu_ms: float, calls: int) -> None:
    """Own CPU time by component and the top functions (own and cumulative) from a cProfile dump."""
    import pstats

    st = pstats.Stats(path)
    total = sum(v[2] for v in st.stats.values()) or 1e-9
    comp: Counter = Counter()
    for key, (_, _, tt, _, _) in st.stats.items():
        comp[cprofile_component(st.stats, key)] += tt
    print(f"\ncProfile, {phase}: {total:.2f} s main-thread CPU over {calls} model calls "
          f"({1e3 * total / max(calls, 1):.2f} ms/call profiled; {cpu_ms:.2f} ms/call unprofiled, used below)")
    print("CPU per call by component (own time; C functions and generic library code such as anyio, asyncio "
          "streams and sockets count to their heaviest caller's component)")
    for label, t in comp.most_common():
        if t / total >= 0.005:
            print(f"  {100 * t / total:5.1f}%  {cpu_ms * t / total:5.2f} ms  {label}")

    def name(k):
        file, line, fn = k
        if file == "~":
            return fn
        parts = Path(file).parts
        short = "/".join(parts[-2:]) if "site-packages" not in parts else \
            "/".join(parts[parts.index("site-packages") + 1:])
        return f"{fn} ({short}:{line})"

    print(f"top {top} functions by own time")
    for k, v in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"  {100 * v[2] / total:5.1f}%  {v[1]:>7} calls  {name(k)}")
    print("the gateway's own functions by cumulative time")
    own = [(k, v) for k, v in st.stats.items()
           if ("agl_gateway" in k[0] or "agl_common" in k[0]) and not any(r in k[0] for r in ROOT_FRAMES)]
    for k, v in sorted(own, key=lambda kv: -kv[1][3])[:top]:
        print(f"  {100 * v[3] / total:5.1f}%  {cpu_ms * v[3] / total:5.2f} ms  {name(k)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measured phase")
    ap.add_argument("--clients", default="1,64", help="comma-separated concurrent client counts")
    ap.add_argument("--routes", default="chat,messages,responses")
    ap.add_argument("--rollouts", type=int, default=256, help="distinct rollout ids")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--completion-tokens", type=int, default=32)
    ap.add_argument("--upstream-s", type=float, default=3.0, help="seconds of the upstream capacity phase")
    ap.add_argument("--redis", default=os.environ.get("AGL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--profile", choices=("py-spy", "cprofile"), help="profile the --profile-phase phases again")
    ap.add_argument("--profile-phase", default="chat@64", help="comma-separated route@clients to profile")
    ap.add_argument("--profile-out", default="/tmp/agl-gateway-profile", help="profile file prefix")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--otel", action="store_true", help="gateway with --otel: one OpenTelemetry span per call, "
                    "exported over OTLP/HTTP to bench/otlp_sink.py")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    args.routes = [r for r in args.routes.split(",") if r]
    unknown = set(args.routes) - set(ROUTE_PATHS)
    if unknown:
        ap.error(f"unknown routes {sorted(unknown)}")
    args.profile_phase = [p for p in args.profile_phase.split(",") if p]
    if args.profile == "py-spy" and not Path(sys.executable).with_name("py-spy").exists():
        ap.error("--profile py-spy needs py-spy in the venv: .venv/bin/pip install py-spy")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` cleans up on SIGTERM too
    bench = Bench(args)
    t0 = time.monotonic()
    try:
        bench.start()
        bench.run()
        durable = bench.check_durable()
    finally:
        bench.close()
    bench.report(durable)
    print(f"cleanup: deleted {bench.deleted} Redis keys under {bench.prefix!r}; "
          f"total run {time.monotonic() - t0:.0f} s")
    for phase, path in bench.profiles.items():
        row = next((r for r in bench.rows if f"{r['route']}@{r['clients']}" == phase), None)
        cpu_ms = row["cpu_ms"] if row else 0.0
        if not Path(path).exists():
            print(f"\nprofile of {phase}: {path} was not written")
        elif args.profile == "py-spy":
            print_py_spy(path, args.top, phase, cpu_ms)
        else:
            prow = bench.profiled_rows[phase]
            print_cprofile(path, args.top, phase, cpu_ms, prow["calls"] + prow["errors"])


if __name__ == "__main__":
    main()
