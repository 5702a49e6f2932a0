"""Faults, CI-sized: nothing a gateway acknowledged (answered 200) is ever lost.

(a) a gateway replica killed with SIGKILL mid-flight: every call it answered 200 has its record; the agents'
    retries succeed on a second replica and on the restarted one; the drain protocol stops waiting for the
    dead replica once its heartbeat expires.
(b) Redis killed and restarted (``appendonly yes``, ``appendfsync always``): every acknowledged call survives;
    while Redis is down the gateway answers 503 ``store_unavailable``; it recovers by itself, control channel
    included (a pause published after the restart reaches it).
(c) load: many agents through 2 replicas while a control task pauses and resumes every ~1 s: every call
    answered 200, no record lost or duplicated, no upstream call starts after a drain was acknowledged, and
    the upstream has nothing in flight at the acknowledgement.

Gateways run as real subprocesses (``python -m agl_gateway serve``); the fake upstream runs in-process and
logs every arrival.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest
import redis
import redis.cluster
from agl_common.control import pause_and_drain, resume
from agl_common.schemas import CallRecord
from agl_common.store import REPLICA_LATE_S, Store
from fakes import Served, fake_upstream, free_port

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers
class GatewayProc:
    """``python -m agl_gateway serve`` as a subprocess; stdout+stderr go to ``log``."""

    def __init__(self, upstream: str, redis_url: str, prefix: str, replica_id: str, log: Path,
                 port: int | None = None, extra: list[str] = (), env: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.args = [sys.executable, "-m", "agl_gateway", "serve", "--upstream", upstream, "--model", "agent-model",
                     "--redis", redis_url, "--prefix", prefix, "--port", str(self.port), "--log-level", "info",
                     *extra]
        self.env = {**os.environ, "AGL_REPLICA_ID": replica_id, "AGL_HEARTBEAT_S": "0.2", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300) -> GatewayProc:
        """Start and wait for ``/healthz``. The bound is for a process that never starts, not a speed: at
        nice 19 beside CPU-heavy work the gateway's imports alone took 67 s (issue 14)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class RedisProc:
    """A private redis-server with the persistence setting we recommend: AOF, fsync on every write."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tmp
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisProc:
        with open(self.dir / "redis.log", "ab") as out:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes"],
                stdout=out, stderr=subprocess.STDOUT)
        r = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if r.ping():
                    while r.info("persistence").get("loading"):
                        time.sleep(0.05)
                    return self
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def chat(marker: str, delay: float = 0.0) -> dict:
    return {"model": "agent-model", "messages": [{"role": "user", "content": marker}], "x_delay": delay}


def markers_in(r: redis.Redis, prefix: str) -> tuple[Counter, list[CallRecord]]:
    """Ok records per marker (the user message), and every record (each must validate)."""
    ok, records = Counter(), []
    for key in r.scan_iter(match=prefix + "calls:*", count=1000):
        for _, fields in r.xrange(key):
            rec = CallRecord.model_validate_json(fields[b"d"])
            records.append(rec)
            if rec.status == "ok":
                ok[rec.request["messages"][0]["content"]] += 1
    return ok, records


@pytest.fixture
def upstream():
    """The fake engine (tests/fakes.py): answers after ``x_delay`` s; ``.app.state`` logs each arrival
    (``arrivals``) and the number of calls in progress (``active``)."""
    with Served(fake_upstream(model="up")) as s:
        yield s


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in reversed(started):
        p.stop()


# ------------------------------------------------------------------------------------------ (a) kill -9
async def test_gateway_sigkill_mid_flight_loses_no_acknowledged_call(redis_url, prefix, upstream, procs, tmp_path):
    a = GatewayProc(upstream.url, redis_url, prefix, "gw-a", tmp_path / "a.log", extra=["--open"])
    b = GatewayProc(upstream.url, redis_url, prefix, "gw-b", tmp_path / "b.log", extra=["--open"])
    procs += [a, b]
    a.start(), b.start()
    n = 24
    answered_by: dict[str, str] = {}
    failures_on_a = 0

    async def agent(c: httpx.AsyncClient, i: int):
        nonlocal failures_on_a
        marker, path = f"kill-{i}", f"/rollouts/k{i}/attempts/0/v1/chat/completions"
        try:
            r = await c.post(a.url + path, json=chat(marker, 0.2 + 0.1 * i))
            if r.status_code == 200:
                answered_by[marker] = "a"
                return
        except httpx.HTTPError:
            pass
        failures_on_a += 1
        for _ in range(20):  # the agent's own retry, on the other replica
            try:
                r = await c.post(b.url + path, json=chat(marker))
                if r.status_code == 200:
                    answered_by[marker] = "b"
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)

    async with httpx.AsyncClient(timeout=30) as c:
        tasks = [asyncio.create_task(agent(c, i)) for i in range(n)]
        # kill A once it has answered a few calls (its later calls, up to 2.5 s long, are still in flight);
        # waiting on answers rather than a fixed time keeps this right on a loaded machine
        for _ in range(300):
            if sum(who == "a" for who in answered_by.values()) >= 2:
                break
            await asyncio.sleep(0.1)
        await asyncio.to_thread(a.kill9)
        await asyncio.gather(*tasks)
    r = redis.Redis.from_url(redis_url)
    ok, _ = markers_in(r, prefix)
    from_a = [m for m, who in answered_by.items() if who == "a"]
    assert len(answered_by) == n, "every agent eventually got an answer"
    assert 0 < len(from_a) < n and failures_on_a > 0, (len(from_a), failures_on_a)  # the kill hit mid-flight
    missing = [m for m in answered_by if ok[m] < 1]
    assert not missing, f"acknowledged calls without a record: {missing}"
    # a call A recorded but could not answer before dying is recorded twice (A's, then B's retry): at most one
    # extra record per agent, never one for an agent that A answered
    assert all(ok[m] == 1 for m in from_a) and all(ok[m] <= 2 for m in answered_by)

    # the drain waits for the silent replica (it may only be starved) until its membership expires,
    # REPLICA_LATE_S after its last heartbeat, then goes on with the live one
    store = Store(redis_url, prefix)
    try:
        t0 = time.monotonic()
        replicas = await pause_and_drain(store, timeout_s=REPLICA_LATE_S + 15)
        assert [s.replica_id for s in replicas] == ["gw-b"] and time.monotonic() - t0 < REPLICA_LATE_S + 3
        await resume(store, release_all=True)
        # a restarted replica (same id and port) serves the agents' retries again
        a2 = GatewayProc(upstream.url, redis_url, prefix, "gw-a", tmp_path / "a2.log", port=a.port, extra=["--open"])
        procs.append(a2)
        await asyncio.to_thread(a2.start)
        async with httpx.AsyncClient(timeout=30) as c:
            resp = await c.post(a2.url + "/rollouts/k0/attempts/0/v1/chat/completions", json=chat("after-restart"))
        assert resp.status_code == 200
        assert [rec.seq for rec in await store.read_calls("k0")] == list(range(ok["kill-0"] + 1))
    finally:
        await store.close()


# ------------------------------------------------------------------------------------------ (b) Redis restart
@needs_redis_server
async def test_sigterm_during_a_pause_answers_held_calls_and_exits(redis_url, prefix, upstream, procs, tmp_path):
    """A gateway stopped (SIGTERM) while paused does not wait for its held calls (up to --max-hold): they
    get 503 ``shutting_down`` at once and the process exits; nothing is recorded for them."""
    gw = GatewayProc(upstream.url, redis_url, prefix, "gw-term", tmp_path / "gw.log",
                     extra=["--open", "--max-hold", "600"]).start()
    procs.append(gw)
    store = Store(redis_url, prefix)
    try:
        await pause_and_drain(store, timeout_s=10)
        url = f"{gw.url}/rollouts/T1/attempts/0/v1/chat/completions"
        held = asyncio.create_task(asyncio.to_thread(httpx.post, url, json=chat("held", 0), timeout=60))
        deadline = time.monotonic() + 10
        while not any(r.held for r in await store.replicas()):
            assert time.monotonic() < deadline, "the call was never held"
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        gw.proc.terminate()
        # the bounds show the held call was not kept until --max-hold (600 s); they are not speeds (a
        # starved process takes seconds to run its shutdown)
        resp = await asyncio.wait_for(held, 120)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"
        assert resp.headers["retry-after"] == "1"
        await asyncio.to_thread(gw.proc.wait, 120)
        assert time.monotonic() - t0 < 120
        assert await store.read_calls("T1") == []
    finally:
        await resume(store, release_all=True)
        await store.close()


@pytest.mark.parametrize("port", ["busy", "-1"])
async def test_a_port_that_cannot_be_bound_exits_before_the_gateway_starts(redis_url, prefix, upstream, procs,
                                                                          tmp_path, port):
    """A port in use (here the fake engine's) or not a port: the process exits (uvicorn's start-up failure
    code and the bind error; a usage error), without ever registering a replica. It used to log the error, run the
    app's shutdown from inside its start-up and hang there (SIGTERM and SIGINT ignored) while its heartbeat
    listed it as a live replica that every drain waited for."""
    gw = GatewayProc(upstream.url, redis_url, prefix, "gw-nobind", tmp_path / "gw.log",
                     port=int(upstream.url.rsplit(":", 1)[1]) if port == "busy" else -1)
    procs.append(gw)
    with pytest.raises(RuntimeError, match="did not start"):
        gw.start(timeout_s=300)  # returns when the process exits (the bound is for one that hangs)
    log = gw.log.read_text()
    if port == "busy":
        assert gw.proc.returncode == 3 and "address already in use" in log.lower(), log
    else:  # the option's range, checked by the CLI
        assert gw.proc.returncode == 2 and "greater" in log and "--port" in log, log
    store = Store(redis_url, prefix)
    try:
        assert await store.replicas(include_late=True) == []
    finally:
        await store.close()


async def test_redis_restart_loses_nothing_acknowledged_and_gateway_recovers(upstream, procs, tmp_path):
    rd = RedisProc(tmp_path).start()
    procs.append(rd)
    prefix = "rel:"
    gw = GatewayProc(upstream.url, rd.url, prefix, "gw-r", tmp_path / "gw.log", extra=["--open"])
    procs.append(gw)
    gw.start()
    acked: list[str] = []
    statuses: Counter = Counter()
    codes: Counter = Counter()
    stop = asyncio.Event()
    down = {"from": None, "to": None}
    first_ok_after_restart: list[float] = []

    async def agent(c: httpx.AsyncClient, i: int):
        k = 0
        while not stop.is_set():
            marker = f"redis-{i}-{k}"
            try:
                r = await c.post(f"{gw.url}/rollouts/rr{i}/attempts/0/v1/chat/completions", json=chat(marker, 0.02))
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    acked.append(marker)
                    if down["to"] and time.monotonic() > down["to"] and not first_ok_after_restart:
                        first_ok_after_restart.append(time.monotonic() - down["to"])
                else:
                    codes[r.json()["error"]["code"]] += 1
                    await asyncio.sleep(0.1)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
                await asyncio.sleep(0.1)
            k += 1

    async def until(cond, what: str, within_s: float = 120.0) -> None:
        """Wait for ``cond()``; the bound catches a gateway that never gets there, it is not a speed."""
        deadline = time.monotonic() + within_s
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=60) as c:
        tasks = [asyncio.create_task(agent(c, i)) for i in range(8)]
        await until(lambda: len(acked) >= 8, "no call succeeded before Redis went down")
        n_before = len(acked)
        await asyncio.to_thread(rd.kill9)
        down["from"] = time.monotonic()
        await asyncio.sleep(1.5)
        # while Redis is down: 503 store_unavailable, and /healthz still answers
        r = await c.post(f"{gw.url}/rollouts/rr0/attempts/0/v1/chat/completions", json=chat("while-down"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"]
        assert (await c.get(gw.url + "/healthz")).status_code == 200
        assert (await c.get(gw.url + "/readyz")).status_code == 503
        await asyncio.to_thread(rd.start)
        down["to"] = time.monotonic()
        await until(lambda: first_ok_after_restart, "the gateway did not recover by itself")
        n_after = len(acked)
        await until(lambda: len(acked) >= n_after + 8, "calls did not keep succeeding after the restart")
        stop.set()
        await asyncio.gather(*tasks)
    assert n_before > 0 and len(acked) > n_before
    assert set(statuses) <= {200, 503}, statuses  # nothing but answers and 'retry later'
    assert set(codes) <= {"store_unavailable"}, codes
    r = redis.Redis.from_url(rd.url)
    ok, _ = markers_in(r, prefix)
    lost = [m for m in acked if ok[m] != 1]
    assert not lost, f"acknowledged calls lost (or duplicated) across the Redis restart: {lost[:10]}"

    # the control channel reconnected: a pause published after the restart reaches the replica
    store = Store(rd.url, prefix)
    try:
        replicas = await pause_and_drain(store, timeout_s=15)
        assert [s.replica_id for s in replicas] == ["gw-r"] and replicas[0].paused
        async with httpx.AsyncClient(timeout=30) as c:
            held = asyncio.create_task(c.post(f"{gw.url}/rollouts/rr0/attempts/0/v1/chat/completions",
                                              json=chat("held")))
            await asyncio.sleep(0.8)
            assert not held.done()
            await resume(store, release_all=True)
            assert (await asyncio.wait_for(held, 10)).status_code == 200
    finally:
        await store.close()


# ------------------------------------------------------------------------------------------ (c) load + pauses
N_AGENTS = int(os.environ.get("AGL_RELIABILITY_AGENTS", "256"))
CALLS_PER_AGENT = 4


async def test_load_with_pause_resume_every_second(redis_url, prefix, upstream, procs, tmp_path):
    await load_with_pause_resume(redis_url, prefix, upstream, procs, tmp_path)


def sync_client(url: str) -> redis.Redis | redis.cluster.RedisCluster:
    """A synchronous client for checks: a :class:`redis.cluster.RedisCluster` for ``redis+cluster://`` URLs."""
    if url.startswith("redis+cluster://"):
        host, port = url.split("//", 1)[1].split(",")[0].rsplit(":", 1)
        return redis.cluster.RedisCluster(host=host, port=int(port))
    return redis.Redis.from_url(url)


async def load_with_pause_resume(redis_url, prefix, upstream, procs, tmp_path, agents: int | None = None) -> None:
    """(c), on the Redis at ``redis_url`` (one Redis or a cluster): see the module docstring."""
    n_agents = agents or N_AGENTS
    gws = [GatewayProc(upstream.url, redis_url, prefix, f"gw-{k}", tmp_path / f"gw{k}.log", extra=["--open"])
           for k in range(2)]
    procs += gws
    for g in gws:
        g.start()
    store = Store(redis_url, prefix)
    deadline = time.monotonic() + 20
    while len(await store.replicas()) < 2:
        assert time.monotonic() < deadline, "replicas never heartbeated"
        await asyncio.sleep(0.1)
    results: Counter = Counter()
    transport_errors: Counter = Counter()
    cycles: list[dict] = []
    done = asyncio.Event()
    rng = random.Random(0)

    retried: set[str] = set()

    async def agent(c: httpx.AsyncClient, i: int):
        g = gws[i % 2]
        for k in range(CALLS_PER_AGENT):
            marker = f"load-{i}-{k}"
            for _ in range(3):  # like the OpenAI SDK, retry a transport error (connection lost, no answer)
                try:
                    r = await c.post(f"{g.url}/rollouts/L{i}/attempts/0/v1/chat/completions",
                                     json=chat(marker, rng.uniform(0, 0.15)))
                    break
                except httpx.TransportError as exc:
                    transport_errors[repr(exc)] += 1
                    retried.add(marker)
            else:
                results["no answer after 3 tries"] += 1
                continue
            results[r.status_code] += 1
            if r.status_code != 200:
                results[r.text[:200]] += 1
            await asyncio.sleep(rng.uniform(0, 0.3))

    async def control():
        while not done.is_set():
            await asyncio.sleep(0.7)
            t_pause = time.time()
            try:
                statuses = await pause_and_drain(store, timeout_s=30, poll_s=0.02)
            finally:
                t_ack = time.time()
                active = upstream.app.state.active
                await asyncio.sleep(0.3)
                t_resume = time.time()
                await resume(store, release_all=True)
            cycles.append({"pause": t_pause, "ack": t_ack, "resume": t_resume, "upstream_active": active,
                           "in_flight": [s.in_flight for s in statuses], "n": len(statuses)})

    t0 = time.monotonic()
    # keep-alive shorter than the gateway's (uvicorn: 5 s), so a connection it is closing is never reused
    limits = httpx.Limits(max_connections=n_agents + 16, max_keepalive_connections=n_agents + 16, keepalive_expiry=1)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        ctl = asyncio.create_task(control())
        try:
            await asyncio.wait_for(asyncio.gather(*(agent(c, i) for i in range(n_agents))), 150)
        finally:
            done.set()
            await asyncio.wait_for(ctl, 60)
    elapsed = time.monotonic() - t0
    total = n_agents * CALLS_PER_AGENT
    print(f"\n{n_agents} agents x {CALLS_PER_AGENT} calls through 2 replicas in {elapsed:.1f} s, "
          f"{len(cycles)} pause/resume cycles, drain ack after "
          f"{[round(cy['ack'] - cy['pause'], 3) for cy in cycles]} s; transport errors retried: {dict(transport_errors)}")
    assert results == Counter({200: total}), results
    assert len(cycles) >= 3
    for cy in cycles:
        assert cy["n"] == 2 and cy["in_flight"] == [0, 0] and cy["upstream_active"] == 0, cy
        late = [t for t in upstream.app.state.arrivals if cy["ack"] < t < cy["resume"]]
        assert not late, f"{len(late)} upstream calls started after a drain was acknowledged: {cy}"
    assert len(retried) <= 3, f"too many lost connections: {transport_errors}"
    # 0 lost, 0 duplicated: each rollout holds exactly its calls, seq 0..n-1, each marker once (a call the
    # agent itself retried after a lost connection may have been recorded by both tries)
    r = sync_client(redis_url)
    ok, records = markers_in(r, prefix)
    assert len(ok) == total and all(v == 1 or (v == 2 and m in retried) for m, v in ok.items())
    # the try whose connection was lost may have reached the engine and been recorded as not ok (the client left)
    not_ok = [rec for rec in records if rec.status != "ok"]
    assert all(rec.request["messages"][0]["content"] in retried for rec in not_ok), not_ok
    assert len(records) == len(upstream.app.state.arrivals) == sum(ok.values()) + len(not_ok)
    per_rollout = defaultdict(list)
    for rec in records:
        per_rollout[rec.rollout_id].append(rec.seq)
    assert all(sorted(s) == list(range(len(s))) for s in per_rollout.values())
    await store.close()
