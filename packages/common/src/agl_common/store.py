"""The Redis layout and every read and write of it (redis-py asyncio).

Keys, all under a configurable prefix ``P`` (default ``agl:``):

================================  ========  ==================================================
key                               type      holds
================================  ========  ==================================================
``P rollout:{rid}``               string    the :class:`Rollout` as JSON
``P rollouts``                    zset      rollout ids scored by creation time (Unix s)
``P queue``                       list      rollout ids waiting for the controller
``P calls:{rid}``                 stream    one entry per recorded model call, field ``d``
``P seq:{rid}:{aid}``             string    call counter of one attempt (next ``seq``)
``P events:{rid}``                stream    custom events posted by the agent
``P policy``                      string    the :class:`Policy` new calls are routed to
``P control``                     pub/sub   :class:`ControlCommand` messages
``P control:last``                string    the last command, for replicas that missed it
``P replica:{id}``                string    :class:`ReplicaStatus` heartbeat, expires after 5 s
``P completed``                   stream    one entry per move to succeeded/failed (``rid``, ``gid``,
                                            ``aid``), written in the same transaction as the status;
                                            read by trainers through consumer groups
``P trained``                     set       group ids a trainer has committed (trained at most once)
``P groups:{tag}``                string    counter of the groups a trainer run created
================================  ========  ==================================================

A store object is passed to whoever needs it; nothing is kept in module-level state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from .schemas import (
    CallRecord,
    ControlCommand,
    Policy,
    ReplicaStatus,
    Rollout,
    RolloutStatus,
    TERMINAL,
    check_transition,
)
from .settings import DEFAULT_PREFIX, DEFAULT_REDIS_URL

REPLICA_TTL_S = 5
#: The ``completed`` stream is trimmed (approximately) to this many entries; a trainer must not lag further.
COMPLETED_MAXLEN = 1_000_000

#: KEYS: seq counter, calls stream; ARGV: the record JSON with ``"seq":-1`` (its third field, before any
#: agent-controlled text, so the first match is always the record's own).
_RECORD_CALL = """
local seq = redis.call('INCR', KEYS[1]) - 1
local body = string.gsub(ARGV[1], '"seq":%-1', '"seq":' .. seq, 1)
redis.call('XADD', KEYS[2], '*', 'd', body)
return seq
"""


class RolloutNotFound(KeyError):
    """No rollout with this id exists."""


class Store:
    """Typed access to one experiment's Redis keys.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        prefix: key prefix, so several experiments can share one Redis.
        max_connections: connection pool size; beyond it callers wait for a free connection.
    Errors from Redis (``redis.exceptions.ConnectionError`` and friends) propagate to the caller.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, prefix: str = DEFAULT_PREFIX,
                 max_connections: int = 512):
        self.redis_url = redis_url
        self.prefix = prefix
        # A blocking pool: past ``max_connections`` a caller waits (up to 10 s) for a free connection
        # instead of failing at once (redis-py's default pool turned load into "Too many connections").
        self.r: aioredis.Redis = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=max_connections, timeout=10, socket_connect_timeout=5, socket_timeout=10,
            health_check_interval=10))
        self._record_script = self.r.register_script(_RECORD_CALL)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    # ---------------------------------------------------------------- rollouts
    async def create_rollout(self, rollout: Rollout, enqueue: bool = True) -> Rollout:
        """Store a new rollout (fails with ``ValueError`` if the id exists) and queue it."""
        key = self.key("rollout", rollout.rollout_id)
        ok = await self.r.set(key, rollout.model_dump_json(), nx=True)
        if not ok:
            raise ValueError(f"rollout {rollout.rollout_id!r} already exists")
        pipe = self.r.pipeline(transaction=True)
        pipe.zadd(self.key("rollouts"), {rollout.rollout_id: rollout.created_at})
        if enqueue:
            pipe.lpush(self.key("queue"), rollout.rollout_id)
        await pipe.execute()
        return rollout

    async def get_rollout(self, rollout_id: str) -> Rollout:
        raw = await self.r.get(self.key("rollout", rollout_id))
        if raw is None:
            raise RolloutNotFound(rollout_id)
        return Rollout.model_validate_json(raw)

    async def get_rollouts(self, rollout_ids: list[str]) -> list[Rollout]:
        """Fetch many rollouts in one round trip; raises :class:`RolloutNotFound` for a missing one."""
        if not rollout_ids:
            return []
        raws = await self.r.mget([self.key("rollout", rid) for rid in rollout_ids])
        out = []
        for rid, raw in zip(rollout_ids, raws):
            if raw is None:
                raise RolloutNotFound(rid)
            out.append(Rollout.model_validate_json(raw))
        return out

    async def list_rollouts(self, limit: int = 1000) -> list[Rollout]:
        ids = [i.decode() for i in await self.r.zrange(self.key("rollouts"), 0, limit - 1)]
        return await self.get_rollouts(ids)

    async def update_rollout(self, rollout_id: str, change: Callable[[Rollout], None]) -> Rollout:
        """Apply ``change`` to the stored rollout atomically (optimistic WATCH/MULTI, retried).

        ``change`` mutates the rollout in place and may raise to abort (nothing is written).
        A changed ``status`` is checked against the state machine here, in one place.
        """
        key = self.key("rollout", rollout_id)
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise RolloutNotFound(rollout_id)
                    rollout = Rollout.model_validate_json(raw)
                    old_status = rollout.status
                    change(rollout)
                    if rollout.status != old_status:
                        check_transition(old_status, rollout.status)
                    pipe.multi()
                    pipe.set(key, rollout.model_dump_json())
                    if rollout.status != old_status and rollout.status in TERMINAL:
                        pipe.xadd(self.key("completed"), {"rid": rollout.rollout_id, "gid": rollout.group_id or "",
                                                          "aid": rollout.attempt_id},
                                  maxlen=COMPLETED_MAXLEN, approximate=True)
                    await pipe.execute()
                    return rollout
                except WatchError:
                    continue

    async def set_status(
        self, rollout_id: str, status: RolloutStatus, failure: str | None = None
    ) -> Rollout:
        """Move a rollout to ``status`` (checked), stamping ``started_at`` / ``ended_at``."""

        def change(r: Rollout) -> None:
            r.status = status
            now = time.time()
            if status == RolloutStatus.running:
                r.started_at = now
                r.failure = None
            elif status in (RolloutStatus.succeeded, RolloutStatus.failed):
                r.ended_at = now
                r.failure = failure

        return await self.update_rollout(rollout_id, change)

    async def pop_queued(self, timeout_s: float = 1.0) -> str | None:
        """Block up to ``timeout_s`` seconds for the next queued rollout id."""
        item = await self.r.brpop([self.key("queue")], timeout=timeout_s)
        return item[1].decode() if item else None

    async def enqueue(self, rollout_id: str) -> None:
        await self.r.lpush(self.key("queue"), rollout_id)

    async def rollout_ids(self, limit: int | None = None) -> list[str]:
        """Rollout ids in creation order (all, or the first ``limit``)."""
        return [i.decode() for i in await self.r.zrange(self.key("rollouts"), 0, -1 if limit is None else limit - 1)]

    async def queued_ids(self) -> list[str]:
        """Rollout ids waiting in the queue, next to be claimed last."""
        return [i.decode() for i in await self.r.lrange(self.key("queue"), 0, -1)]

    async def next_group_number(self, tag: str) -> int:
        """0, 1, 2... per ``tag`` (``INCR P groups:{tag}``): a restarted trainer never reuses a number."""
        return int(await self.r.incr(self.key("groups", tag))) - 1

    # ---------------------------------------------------------------- calls
    async def record_call(self, record: CallRecord) -> CallRecord:
        """Assign the next ``seq`` of the attempt and append the record to the rollout's stream.

        One atomic server-side script (one round trip): the counter and the stream never disagree, even if
        the gateway dies mid-call. Returns once Redis has acknowledged the write.
        """
        record.seq = -1
        seq = await self.r.eval(_RECORD_CALL, 2, self.key("seq", record.rollout_id, record.attempt_id),
                                self.key("calls", record.rollout_id), record.model_dump_json())
        record.seq = int(seq)
        return record

    async def record_call_json(self, rollout_id: str, attempt_id: str, record_json: bytes) -> int:
        """:meth:`record_call` for a record already serialized (the gateway's hot path); returns its ``seq``.

        ``record_json`` must be :class:`CallRecord` JSON with ``"seq":-1`` as its third field. The script is
        sent by hash (EVALSHA, loaded on first use by redis-py's ``Script``).
        """
        keys = [self.key("seq", rollout_id, attempt_id), self.key("calls", rollout_id)]
        return int(await self._record_script(keys=keys, args=[record_json]))

    async def count_calls(self, rollout_id: str, attempt_id: str) -> int:
        raw = await self.r.get(self.key("seq", rollout_id, attempt_id))
        return int(raw) if raw else 0

    async def read_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[CallRecord]:
        """Every recorded call of a rollout (optionally one attempt), ordered by ``seq``."""
        entries = await self.r.xrange(self.key("calls", rollout_id))
        calls = [CallRecord.model_validate_json(fields[b"d"]) for _, fields in entries]
        if attempt_id is not None:
            calls = [c for c in calls if c.attempt_id == attempt_id]
        return sorted(calls, key=lambda c: (int(c.attempt_id), c.seq))

    async def add_event(self, rollout_id: str, attempt_id: str, type_: str, data: dict[str, Any]) -> str:
        body = orjson.dumps({"attempt_id": attempt_id, "type": type_, "data": data, "t": time.time()})
        entry_id = await self.r.xadd(self.key("events", rollout_id), {"d": body})
        return entry_id.decode()

    async def read_events(self, rollout_id: str) -> list[dict[str, Any]]:
        entries = await self.r.xrange(self.key("events", rollout_id))
        return [orjson.loads(fields[b"d"]) for _, fields in entries]

    # ---------------------------------------------------------------- policy & control
    async def get_policy(self) -> Policy | None:
        raw = await self.r.get(self.key("policy"))
        return Policy.model_validate_json(raw) if raw else None

    async def set_policy(self, policy: Policy) -> None:
        await self.r.set(self.key("policy"), policy.model_dump_json())

    async def publish_control(self, command: ControlCommand) -> None:
        """Persist ``command`` as the last one, then broadcast it to every gateway replica."""
        body = command.model_dump_json()
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.key("control:last"), body)
        if command.cmd == "resume" and command.model is not None:
            pipe.set(
                self.key("policy"),
                Policy(model=command.model, version=command.version or 0).model_dump_json(),
            )
        pipe.publish(self.key("control"), body)
        await pipe.execute()

    async def last_control(self) -> ControlCommand | None:
        raw = await self.r.get(self.key("control:last"))
        return ControlCommand.model_validate_json(raw) if raw else None

    def subscribe_control(self):
        """A redis-py ``PubSub`` to subscribe to the control channel with (``await ps.subscribe(*channels)``
        with :meth:`control_channel`; ``ps.listen()``; ``ps.aclose()``)."""
        return self.r.pubsub()

    def control_channel(self) -> str:
        """The pub/sub channel :class:`ControlCommand` messages are published on."""
        return self.key("control")

    async def heartbeat(self, status: ReplicaStatus) -> None:
        """Write the replica's status (expires after ``REPLICA_TTL_S``) and register it in ``P replicas``
        (a zset scored by the Unix time its heartbeat expires), in one round trip."""
        status.updated_at = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.key("replica", status.replica_id), status.model_dump_json(), ex=REPLICA_TTL_S)
        pipe.zadd(self.key("replicas"), {status.replica_id: status.updated_at + REPLICA_TTL_S})
        await pipe.execute()

    async def drop_replica(self, replica_id: str) -> None:
        """Forget a replica at once (a clean shutdown): its status and its registry entry."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.key("replica", replica_id))
        pipe.zrem(self.key("replicas"), replica_id)
        await pipe.execute()

    async def replicas(self) -> list[ReplicaStatus]:
        """Live gateway replicas (those whose heartbeat has not expired), from the ``P replicas`` registry:
        two round trips whatever the keyspace holds (expired entries are pruned on the way)."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zremrangebyscore(self.key("replicas"), "-inf", now)
        pipe.zrange(self.key("replicas"), 0, -1)
        ids = [i.decode() for i in (await pipe.execute())[1]]
        if not ids:
            return []
        raws = await self.r.mget([self.key("replica", rid) for rid in ids])
        return [ReplicaStatus.model_validate_json(raw) for raw in raws if raw]

    # ---------------------------------------------------------------- controller claims, leases, retries
    # Two more keys, used by the controller only:
    #   ``P processing:{cid}`` (list): rollout ids controller ``cid`` claimed and has not finished yet;
    #   ``P controller:{cid}`` (string): that controller's lease, expiring ``ttl_s`` after its last renewal.
    # A processing list whose lease has expired belongs to a dead controller; another one adopts it.
    async def claim_queued(self, controller_id: str, timeout_s: float | None = 1.0) -> str | None:
        """Atomically move the next queued rollout id into ``P processing:{controller_id}`` and return it.

        ``timeout_s``: block up to that many seconds (BLMOVE); ``None``: do not block (LMOVE).
        Returns ``None`` when the queue stayed empty. The id stays in the processing list until
        :meth:`release_claim` or :meth:`requeue_claim`, so a crash never loses it.
        """
        src, dst = self.key("queue"), self.key("processing", controller_id)
        pipe = self.r.pipeline(transaction=False)  # registered first, so a claim is never out of the registry
        pipe.sadd(self.key("controllers"), controller_id)
        if timeout_s is None:
            pipe.lmove(src, dst, "RIGHT", "LEFT")
        else:
            pipe.blmove(src, dst, timeout_s, "RIGHT", "LEFT")
        item = (await pipe.execute())[1]
        return item.decode() if item else None

    async def release_claim(self, controller_id: str, rollout_id: str) -> None:
        """Remove the oldest claim of ``rollout_id`` from the controller's processing list (no error if absent)."""
        await self.r.lrem(self.key("processing", controller_id), -1, rollout_id)

    async def requeue_claim(self, controller_id: str, rollout_id: str) -> None:
        """In one transaction, remove ``rollout_id`` from the processing list and put it at the queue's head."""
        pipe = self.r.pipeline(transaction=True)
        pipe.lrem(self.key("processing", controller_id), -1, rollout_id)
        pipe.rpush(self.key("queue"), rollout_id)
        await pipe.execute()

    async def claimed(self, controller_id: str) -> list[str]:
        """Rollout ids in the controller's processing list."""
        return [i.decode() for i in await self.r.lrange(self.key("processing", controller_id), 0, -1)]

    async def adopt_claim(self, from_controller: str, to_controller: str) -> str | None:
        """Atomically move one id from ``from_controller``'s processing list to ``to_controller``'s.

        Safe when several controllers adopt the same dead list at once: each id goes to exactly one.
        Returns ``None`` once the list is empty.
        """
        item = await self.r.lmove(self.key("processing", from_controller), self.key("processing", to_controller),
                                  "RIGHT", "LEFT")
        return item.decode() if item else None

    async def renew_lease(self, controller_id: str, ttl_s: float) -> None:
        """(Re)set the controller's lease so that it expires ``ttl_s`` seconds from now, and register the
        controller in ``P controllers`` (a set: every controller that may own a processing list)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.key("controller", controller_id), str(time.time()), px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self.key("controllers"), controller_id)
        await pipe.execute()

    async def drop_lease(self, controller_id: str) -> None:
        """Delete the controller's lease at once (a clean exit): its leftover claims can be adopted."""
        await self.r.delete(self.key("controller", controller_id))

    async def claim_owners(self) -> dict[str, bool]:
        """Every registered controller id that has a processing list, mapped to whether its lease is still
        alive (from the ``P controllers`` registry, not a keyspace scan). A controller with neither a lease
        nor a processing list left is dropped from the registry."""
        ids = sorted(i.decode() for i in await self.r.smembers(self.key("controllers")))
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for cid in ids:
            pipe.exists(self.key("processing", cid))
        pipe.mget([self.key("controller", cid) for cid in ids])
        *has_list, alive = await pipe.execute()
        gone = [cid for cid, n, raw in zip(ids, has_list, alive) if not n and raw is None]
        if gone:
            await self.r.srem(self.key("controllers"), *gone)
        return {cid: raw is not None for cid, n, raw in zip(ids, has_list, alive) if n}

    async def retry_attempt(self, rollout_id: str, attempt_id: str, enqueue: bool = False) -> Rollout:
        """Start a new attempt: ``running | failed → queuing`` with ``attempt_id + 1``, reward and times cleared.

        The old attempt is fenced from then on (the gateway answers 409 to its calls and rewards).
        Raises ``ValueError`` if ``attempt_id`` is no longer the current attempt (someone else retried it
        first) or the rollout is neither running nor failed, and :class:`RolloutNotFound`. ``enqueue``: also push the id onto the queue (a manual retry).
        """

        def change(r: Rollout) -> None:
            if r.attempt_id != attempt_id:
                raise ValueError(f"attempt {attempt_id} of {rollout_id!r} is stale (current: {r.attempt_id})")
            if r.status not in (RolloutStatus.running, RolloutStatus.failed):
                raise ValueError(f"rollout {rollout_id!r} is {r.status.value}: only running or failed can be retried")
            r.status = RolloutStatus.queuing
            r.attempt_id = str(int(r.attempt_id) + 1)
            r.reward = r.reward_message = r.failure = None
            r.started_at = r.ended_at = None

        rollout = await self.update_rollout(rollout_id, change)
        if enqueue:
            await self.enqueue(rollout_id)
        return rollout

    # ---------------------------------------------------------------- trainer: completions via consumer groups
    async def ensure_consumer_group(self, group: str) -> None:
        """Create consumer group ``group`` on ``P completed`` at its end (``$``); no error if it exists."""
        try:
            await self.r.xgroup_create(self.key("completed"), group, id="$", mkstream=True)
        except aioredis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_completed(self, group: str, consumer: str, block_ms: int = 500,
                             count: int = 1000) -> list[tuple[str, dict[str, str]]]:
        """New completion entries for ``consumer`` (XREADGROUP ``>``), blocking up to ``block_ms`` ms.

        Entries stay pending in the group until :meth:`ack_completed`: a consumer that dies before
        acknowledging leaves them for :meth:`reclaim_completed`. Returns ``[(entry_id, fields)]``.
        """
        res = await self.r.xreadgroup(group, consumer, {self.key("completed"): ">"}, count=count, block=block_ms)
        return [(eid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                for _, entries in res or [] for eid, fields in entries]

    async def reclaim_completed(self, group: str, consumer: str) -> list[tuple[str, dict[str, str]]]:
        """Take over every pending (delivered, unacknowledged) entry of ``group``, whoever it was delivered
        to (XAUTOCLAIM, min idle 0): what a trainer that died mid-step had read and not committed."""
        out, cursor = [], "0-0"
        while True:
            res = await self.r.xautoclaim(self.key("completed"), group, consumer, min_idle_time=0,
                                          start_id=cursor, count=1000)
            cursor = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
            out += [(eid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                    for eid, fields in res[1] if fields]  # a trimmed entry comes back without fields
            if cursor == "0-0":
                return out

    async def ack_completed(self, group: str, entry_ids: list[str]) -> None:
        """Acknowledge completion entries (XACK): they are no longer pending in ``group``."""
        if entry_ids:
            await self.r.xack(self.key("completed"), group, *entry_ids)

    async def commit_trained(self, group: str, group_ids: list[str], entry_ids: list[str]) -> None:
        """In one transaction, mark ``group_ids`` trained (``SADD P trained``) and acknowledge their entries."""
        pipe = self.r.pipeline(transaction=True)
        if group_ids:
            pipe.sadd(self.key("trained"), *group_ids)
        if entry_ids:
            pipe.xack(self.key("completed"), group, *entry_ids)
        await pipe.execute()

    async def trained(self, group_ids: list[str]) -> list[bool]:
        """Whether each group id is already in ``P trained``."""
        if not group_ids:
            return []
        return [bool(x) for x in await self.r.smismember(self.key("trained"), group_ids)]
