"""The store on Redis Cluster (a real local one: 3 masters + 3 replicas, scripts/local_redis_cluster.py), and
the layout rules that make it possible, checked on one Redis too.

* layout: every key of one rollout in one slot, every experiment-wide key in one slot; a database of the old
  layout (or another version) is refused, never mixed; the record script is idempotent per write token;
* the whole store API on the cluster (transactions, scripts, MGET across slots, SCAN, pub/sub, consumer
  groups), then gateway + controller + trainer's scheduler end to end on it;
* the reliability load test (2 gateway replicas, pause/resume every second) on the cluster: 0 lost, 0 duplicated;
* failover: a master is killed during load after its replica fell behind; with ``AGL_WAIT_REPLICAS=0``
  acknowledged records are lost, with ``1`` none is (the test prints both counts).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis
from agl_common.schemas import CallRecord, ControlCommand, ReplicaStatus, Rollout, RolloutStatus
from agl_common.store import LAYOUT_VERSION, LayoutError, NotReplicated, Store, connect
from test_reliability import GatewayProc, chat, load_with_pause_resume, markers_in, sync_client
from test_reliability import procs, upstream  # noqa: F401  (pytest fixtures)

from fakes import Served, fake_upstream

HARNESS = [sys.executable, str(Path(__file__).parent / "harnesses" / "scripted.py")]
cluster = pytest.mark.redis_cluster


# ------------------------------------------------------------------------------------------ layout (one Redis)
def test_keys_of_a_rollout_share_a_slot_and_global_keys_share_one():
    from redis.crc import key_slot

    s = Store("redis://127.0.0.1:1/0", "exp:")
    rid = "run-q7-g0-3"
    per_rollout = [s.rollout_key("rollout", rid), s.rollout_key("calls", rid), s.rollout_key("seq", rid, "2"),
                   s.rollout_key("tokens", rid, "2"), s.rollout_key("events", rid)]
    assert per_rollout[1] == "exp:calls:{run-q7-g0-3}" and per_rollout[2] == "exp:seq:{run-q7-g0-3}:2"
    assert len({key_slot(k.encode()) for k in per_rollout}) == 1
    glob = [s.key(n) for n in ("queue", "rollouts", "completed", "trained", "policy", "control", "control:last",
                               "layout")] + [s.key("processing", "c1"), s.key("replica", "gw"), s.key("groups", "t")]
    assert glob[0] == "exp:{exp}:queue" and len({key_slot(k.encode()) for k in glob}) == 1


def test_bad_prefix_and_cluster_url_are_refused():
    with pytest.raises(ValueError, match="hash-tag"):
        Store("redis://127.0.0.1:1/0", "a{b}:")
    with pytest.raises(ValueError, match="no database"):
        connect("redis+cluster://127.0.0.1:7000/3")
    with pytest.raises(ValueError, match="no node"):
        connect("redis+cluster:///")
    with pytest.raises(ValueError):
        Store("redis://127.0.0.1:1/0", "p:", wait_replicas=-1)


def test_cluster_url_names_its_seed_nodes_and_credentials():
    c = connect("redis+cluster://u:p%40ss@h1:7000,[::1]:7001,h3/?retries=5")  # nothing is contacted yet
    assert list(c.nodes_manager.startup_nodes) == ["h1:7000", "::1:7001", "h3:6379"]
    assert (c.connection_kwargs["username"], c.connection_kwargs["password"]) == ("u", "p@ss")
    assert c.retry.get_retries() == 5
    assert not Store("redis://127.0.0.1:1/0", "p:").cluster and Store("rediss+cluster://h:1", "p:").cluster


async def test_old_layout_is_refused_not_mixed(redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    r.lpush(prefix + "queue", "old-rollout")  # layout 1: untagged ``P queue``
    s = Store(redis_url, prefix)
    try:
        with pytest.raises(LayoutError, match="layout 1"):
            await s.create_rollout(Rollout(rollout_id="r1"))
        assert r.get(s.rollout_key("rollout", "r1")) is None and r.get(s.key("layout")) is None  # nothing written
        r.delete(prefix + "queue")
        r.set(s.key("layout"), "99")
        with pytest.raises(LayoutError, match="layout 99"):
            await s.ensure_layout()
        r.delete(s.key("layout"))
        await s.create_rollout(Rollout(rollout_id="r1"))
        assert int(r.get(s.key("layout"))) == LAYOUT_VERSION
    finally:
        await s.close()


async def test_a_retried_write_is_recorded_once(store):
    """The record script keys each write by a token: redis-py retrying after a lost reply adds nothing."""
    await store.create_rollout(Rollout(rollout_id="r1"), enqueue=False)
    rec = CallRecord(rollout_id="r1", attempt_id="0", seq=-1, route="chat", request={}, response={})
    body = rec.model_dump_json().encode()
    keys = [store.rollout_key("seq", "r1", "0"), store.rollout_key("calls", "r1"),
            store.rollout_key("tokens", "r1", "0"), store.rollout_key("rollout", "r1")]
    bounds = ["0", 100, 10**9]
    first = await store._record_script(keys=keys, args=[body, "tok-1", *bounds])
    again = await store._record_script(keys=keys, args=[body, "tok-1", *bounds])
    other = await store._record_script(keys=keys, args=[body, "tok-2", *bounds])
    assert (first, again, other) == (0, 0, 1)
    assert [c.seq for c in await store.read_calls("r1")] == [0, 1]


async def test_waiting_for_replicas_that_do_not_exist_is_not_an_acknowledgement(redis_url, prefix):
    s = Store(redis_url, prefix, wait_replicas=1, wait_timeout_ms=50)  # the shared Redis has no replica
    await s.create_rollout(Rollout(rollout_id="r1"), enqueue=False)
    rec = CallRecord(rollout_id="r1", attempt_id="0", seq=-1, route="chat", request={}, response={})
    try:
        with pytest.raises(NotReplicated, match="0 of 1 replicas"):
            await s.record_call(rec)
        assert await s.count_calls("r1", "0") == 1  # written on the master, only not acknowledged
    finally:
        await s.close()


# ------------------------------------------------------------------------------------------ the cluster
@cluster
async def test_every_store_operation_on_the_cluster(cluster_store, redis_cluster):
    s = cluster_store
    assert s.cluster
    ids = [f"r{i}" for i in range(24)]  # enough rollouts to land on all three masters
    for rid in ids:
        await s.create_rollout(Rollout(rollout_id=rid, group_id="g" + rid[1:]))
    nodes = {s.r.get_node_from_key(s.rollout_key("rollout", rid)).name for rid in ids}
    assert len(nodes) == 3
    assert [r.rollout_id for r in await s.list_rollouts()] == ids  # MGET split by slot
    for k in range(3):
        rec = CallRecord(rollout_id="r5", attempt_id="0", seq=-1, route="chat", request={"k": k}, response={})
        assert (await s.record_call(rec)).seq == k
    assert await s.count_calls("r5", "0") == 3 and [c.request["k"] for c in await s.read_calls("r5")] == [0, 1, 2]
    await s.add_event("r5", "0", "note", {"x": 1})
    assert (await s.read_events("r5"))[0]["data"] == {"x": 1}
    # controller: blocking move queue → processing list, requeue, adopt, leases (one slot)
    assert await s.claim_queued("c1", 0.5) == "r0"
    await s.renew_lease("c1", 5)
    assert await s.claimed("c1") == ["r0"] and await s.claim_owners() == {"c1": True}
    assert await s.adopt_claim("c1", "c2") == "r0"
    await s.requeue_claim("c2", "r0")
    assert await s.claim_queued("c2", None) == "r0"
    # trainer: consumer group on the completed stream, reclaim, commit (SADD + XACK in one transaction)
    await s.ensure_consumer_group("trainer:t")
    await s.set_status("r0", RolloutStatus.running)
    await s.set_status("r0", RolloutStatus.succeeded)
    got = await s.read_completed("trainer:t", "a", block_ms=200)
    assert [f["rid"] for _, f in got] == ["r0"]
    assert [e for e, _ in await s.reclaim_completed("trainer:t", "b")] == [got[0][0]]
    await s.commit_trained("trainer:t", ["g0"], [got[0][0]])
    assert await s.trained(["g0", "g1"]) == [True, False]
    # control: state in a transaction, message over cluster pub/sub (subscriber and publisher on any node)
    ps = await s.subscribe_control()
    await s.publish_control(ControlCommand(cmd="resume", id="x", model="m2", version=3))
    assert (await s.get_policy()).version == 3 and (await s.last_control()).id == "x"
    deadline = time.monotonic() + 5
    while True:
        m = await ps.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if m:
            assert ControlCommand.model_validate_json(m["data"]).id == "x"
            break
        assert time.monotonic() < deadline, "control message never arrived"
    await ps.aclose()
    await s.heartbeat(ReplicaStatus(replica_id="gw1"))
    assert [r.replica_id for r in await s.replicas()] == ["gw1"]  # SCAN over every master
    # WAIT: each master has one replica, so one acknowledgement comes; two cannot
    waiting = Store(redis_cluster.url, s.prefix, wait_replicas=1, wait_timeout_ms=2000)
    too_many = Store(redis_cluster.url, s.prefix, wait_replicas=2, wait_timeout_ms=50)
    try:
        rec = CallRecord(rollout_id="r7", attempt_id="0", seq=-1, route="chat", request={}, response={})
        assert (await waiting.record_call(rec)).seq == 0
        with pytest.raises(NotReplicated):
            await too_many.record_call(rec)
    finally:
        await waiting.close()
        await too_many.close()


@cluster
@pytest.mark.parametrize("where", ["send", "reply"])
@pytest.mark.parametrize("race", [AttributeError("'NoneType' object has no attribute 'writelines'"),
                                  RuntimeError("unable to perform operation on <TCPTransport closed=True>")],
                         ids=["attribute", "runtime"])
async def test_a_connection_closed_under_a_command_is_a_connection_error_on_every_path(cluster_store, monkeypatch,
                                                                                      race, where):
    """redis-py (8.1) closes a node's connections from one command's error path while another uses one (a
    failover); that other command then fails with ``AttributeError``/``RuntimeError``. A single command, a
    pipeline (the gateway's per-call ``attempt_usage``: it answered 500 in a failover) and a transaction all
    raise :class:`redis.exceptions.ConnectionError` for it, which callers answer 503 (retry)."""
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError

    s = cluster_store
    await s.create_rollout(Rollout(rollout_id="r1"), enqueue=False)
    name = "read_response" if where == "reply" else "send_packed_command"
    real = getattr(AbstractConnection, name)
    armed = []

    async def closed_under_us(self, *a, **kw):
        if armed:
            armed.clear()
            await self.disconnect()  # what the other command's error path did
            raise race
        return await real(self, *a, **kw)

    monkeypatch.setattr(AbstractConnection, name, closed_under_us)
    calls = [lambda: s.get_rollout("r1"), lambda: s.attempt_usage("r1", "0"),
             lambda: s.update_rollout("r1", lambda r: None)]
    for call in calls:
        armed.append(1)
        with pytest.raises(RedisConnectionError, match="topology change"):
            await call()
        assert not armed  # the race was hit, not skipped
    monkeypatch.undo()
    assert await s.attempt_usage("r1", "0") == (0, 0)  # nothing left broken


@cluster
async def test_gateway_controller_and_trainer_on_the_cluster(redis_cluster, cluster_store, prefix, tmp_path):
    """Groups created by the trainer's scheduler, run by the local controller through an in-process gateway,
    rewarded, announced on the completed stream and committed: everything on the cluster."""
    from agl_controller import LocalRunner
    from agl_gateway import GatewaySettings, create_app
    from agl_trainer.scheduler import GroupScheduler

    store = cluster_store
    inputs = [{"calls": 2, "reward": 1.0}, {"calls": 1, "reward": 0.0}]
    with Served(fake_upstream()) as up:
        settings = GatewaySettings(upstream=up.url, redis_url=redis_cluster.url, prefix=prefix, model="m", key="k3y",
                                   wait_replicas=1)
        with Served(create_app(settings)) as gw:
            runner = LocalRunner(store, gw.url, HARNESS, "m", key="k3y", log_dir=tmp_path / "logs")
            stop = asyncio.Event()
            ctl = asyncio.create_task(runner.run_forever(stop))
            try:
                sched = GroupScheduler(store, inputs, group_size=2, train_groups=2, tag="cl")
                batch = await sched.next_batch(0, timeout_s=60)
                await sched.commit(batch.groups)
            finally:
                stop.set()
                await asyncio.wait_for(ctl, 30)
    assert len(batch.groups) == 2
    for g in batch.groups:
        assert all(r.status == RolloutStatus.succeeded for r in g.rollouts), [r.failure for r in g.rollouts]
        for r in g.rollouts:
            assert len(await store.read_calls(r.rollout_id)) == r.input["calls"]
    assert await store.trained([g.group_id for g in batch.groups]) == [True, True]


@cluster
async def test_load_with_pause_resume_on_the_cluster(redis_cluster, prefix, upstream, procs, tmp_path):
    await load_with_pause_resume(redis_cluster.url, prefix, upstream, procs, tmp_path,
                                 agents=int(os.environ.get("AGL_CLUSTER_LOAD_AGENTS", "128")))


# ------------------------------------------------------------------------------------------ failover
async def _failover_run(wait_replicas: int, upstream, procs, tmp_path) -> dict:
    """Agents call through 2 gateways; one master's replica is cut off (its PSYNC refused), the master keeps
    acknowledging for ~1 s, then it is killed and its replica promoted. Returns the counts."""
    from local_redis_cluster import LocalCluster

    prefix = f"fo{wait_replicas}:"
    with LocalCluster() as lc:
        env = {"AGL_WAIT_REPLICAS": str(wait_replicas), "AGL_WAIT_TIMEOUT_MS": "300"}
        gws = [GatewayProc(upstream.url, lc.url, prefix, f"fo{wait_replicas}-{k}",
                           tmp_path / f"fo{wait_replicas}-{k}.log", extra=["--open"], env=env) for k in range(2)]
        procs += gws
        for g in gws:
            g.start()
        acked: Counter = Counter()
        answers: Counter = Counter()
        retried: set[str] = set()
        acked_at: dict[str, tuple[float, int]] = {}
        t_cut = t_kill = float("inf")
        done = asyncio.Event()
        rng = random.Random(wait_replicas)

        async def agent(c: httpx.AsyncClient, i: int):
            k = 0
            while not done.is_set():
                marker = f"fo-{i}-{k}"
                k += 1
                for _ in range(200):  # until answered: 503 while the slot has no master / no replica yet
                    try:
                        r = await c.post(f"{gws[i % 2].url}/rollouts/F{i}/attempts/0/v1/chat/completions",
                                         json=chat(marker))
                    except httpx.TransportError:
                        answers["transport error"] += 1
                        retried.add(marker)
                        await asyncio.sleep(0.1)
                        continue
                    answers[r.status_code] += 1
                    if r.status_code == 200:
                        acked[marker] += 1
                        acked_at[marker] = (time.monotonic(), i)
                        break
                    retried.add(marker)
                    await asyncio.sleep(0.1)
                await asyncio.sleep(rng.uniform(0, 0.05))

        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.create_task(agent(c, i)) for i in range(24)]
            await asyncio.sleep(1.5)
            probe = Store(lc.url, prefix)
            await probe.r.initialize()
            victim = probe.r.get_node_from_key(probe.rollout_key("calls", "F0")).port
            await probe.close()
            replica = next(n for n in lc.nodes() if not n["master"] and _master_port(n["port"]) == victim)["port"]
            # cut the replica off: the master refuses its resync, keeps serving (and acknowledging) writes
            redis.Redis(port=victim).execute_command("ACL", "SETUSER", "default", "-psync", "-sync")
            redis.Redis(port=replica).execute_command("CLIENT", "KILL", "TYPE", "master")
            t_cut = time.monotonic()
            await asyncio.sleep(1.0)
            lc.kill(victim)
            t_kill = time.monotonic()
            new_master = await asyncio.to_thread(lc.wait_failover, victim)
            t_promoted = time.monotonic()
            lc.restart(victim)  # comes back as the new master's replica (so WAIT can be satisfied again)
            await asyncio.to_thread(lc.wait_healthy, 60)
            await asyncio.sleep(1.0)
            done.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        ok, records = markers_in(sync_client(lc.url), prefix)
        lost = [m for m in acked if ok[m] == 0]
        # a call answered 503 (e.g. not replicated in time) may still have been written, and its retry records
        # it again; a call answered once is recorded once (the write token absorbs redis-py's own retries)
        duplicated = [m for m, v in ok.items() if v > 1 and m not in retried]

        def phase(m: str) -> str:
            t, i = acked_at[m]
            node = "victim" if i in on_victim else "other"
            return f"{node}:" + ("before cut" if t < t_cut else "cut-off" if t < t_kill else "after kill")
        probe = Store(lc.url, prefix)
        await probe.r.initialize()
        on_victim = {i for i in range(24) if probe.r.get_node_from_key(probe.rollout_key("calls", f"F{i}")).port
                     in (victim, new_master)}
        await probe.close()
        return {"wait_replicas": wait_replicas, "lost_when": dict(Counter(phase(m) for m in lost)),
                "acknowledged": len(acked), "lost": len(lost),
                "duplicated": len(duplicated), "records": len(records), "answers": dict(answers),
                "victim": victim, "new_master": new_master, "promotion_s": round(t_promoted - t_kill, 2)}


def _master_port(replica_port: int) -> int:
    info = redis.Redis(port=replica_port, decode_responses=True).info("replication")
    return int(info["master_port"])


@cluster
async def test_failover_loses_acknowledged_records_only_without_wait(upstream, procs, tmp_path):
    no_wait = await _failover_run(0, upstream, procs, tmp_path)
    for p in procs:
        p.stop()
    procs.clear()
    waited = await _failover_run(1, upstream, procs, tmp_path)
    print(f"\nfailover, master killed after its replica fell ~1 s behind:\n  AGL_WAIT_REPLICAS=0: {no_wait}\n"
          f"  AGL_WAIT_REPLICAS=1: {waited}")
    assert waited["lost"] == 0 and waited["acknowledged"] > 0
    assert no_wait["lost"] > 0  # asynchronous replication: what the master acknowledged alone died with it
    assert no_wait["duplicated"] == waited["duplicated"] == 0
    # while the master is gone the gateway answers 503 (retry) at worst, never 500
    assert set(no_wait["answers"]) | set(waited["answers"]) <= {200, 503, "transport error"}
