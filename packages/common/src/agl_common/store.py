"""The Redis layout and every read and write of it (redis-py asyncio).

Keys, all under a configurable prefix ``P`` (default ``agl:``). Braces are literal: they are Redis Cluster
*hash tags*, so every key of one rollout lives in one slot (``{rid}``) and every experiment-wide key in one slot
of its own (``{E}``, the prefix without its trailing ``:``, so ``agl:{agl}:queue``). Each Lua script and each
transaction below touches keys of a single tag; the same code runs on one Redis and on Redis Cluster
(:func:`connect`). Layout version :data:`LAYOUT_VERSION` is stored in ``P {E}:layout``; a database written by an
older layout is refused with :class:`LayoutError` (:meth:`Store.ensure_layout`).

==================================  ========  ================================================
key                                 type      holds
==================================  ========  ================================================
``P rollout:{rid}``                 string    the :class:`Rollout` as JSON
``P calls:{rid}``                   stream    one entry per recorded model call, field ``d``
``P seq:{rid}:{aid}``               string    call counter of one attempt (next ``seq``)
``P tokens:{rid}:{aid}``            hash      write token → ``seq`` of each recorded call (a retried write
                                              of the same call is recognised, not recorded twice); field
                                              ``_bytes``: the bytes the attempt's records hold
``P events:{rid}``                  stream    custom events posted by the agent
``P events:{rid}:n``                hash      attempt id → events that attempt posted (the per-attempt cap)
``P {E}:layout``                    string    the key layout's version (:data:`LAYOUT_VERSION`)
``P {E}:rollouts``                  zset      rollout ids scored by creation time (Unix s)
``P {E}:queue``                     list      rollout ids waiting for the controller
``P {E}:policy``                    string    the :class:`Policy` new calls are routed to
``P {E}:control``                   pub/sub   :class:`ControlCommand` messages
``P {E}:control:last``              string    the last command, for replicas that missed it
``P {E}:pauses``                    hash      held pauses: pause id → Unix time it expires (owned pauses)
``P {E}:replica:{id}``              string    :class:`ReplicaStatus` heartbeat, expires after 30 s
``P {E}:replicas``                  zset      replica ids scored by the Unix time their membership expires
``P {E}:replica-owner:{id}``        string    the token of the gateway process holding replica id ``id``,
                                              expires :data:`REPLICA_LATE_S` after its last heartbeat
``P {E}:completed``                 stream    one entry per move to succeeded/failed (``rid``, ``gid``,
                                              ``aid``), appended right after the status is written
                                              (:meth:`Store.announce_completed`); read by trainers
                                              through consumer groups
``P {E}:trained``                   set       group ids a trainer has committed (trained at most once)
``P {E}:groups:{tag}``              string    counter of the groups a trainer run created
``P {E}:group_members``             hash      group id → :class:`GroupInfo` JSON (its rollout ids, policy
                                              version and owning trainer run), written before its rollouts
``P {E}:run-groups:{run}``          set       group ids of run ``run`` (:attr:`GroupInfo.run`), written
                                              with the group's record (one script)
``P {E}:trainer``                   string    ``"{owner token} {run id}"`` of the one trainer of the prefix,
                                              expires :data:`TRAINER_LEASE_S` after its last renewal
==================================  ========  ================================================

A store object is passed to whoever needs it; nothing is kept in module-level state.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import orjson
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, ClusterPubSub, PipelineCommand, RedisCluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ConnectionError as RedisConnectionError,
    InvalidResponse,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TimeoutError as RedisTimeoutError,
    TryAgainError,
    WatchError,
)
from redis.retry import Retry

from .aio import keeps_cancellation, methods_keep_cancellation
from .schemas import (
    CallRecord,
    ControlCommand,
    GroupInfo,
    Policy,
    ReplicaStatus,
    Rollout,
    RolloutStatus,
    TERMINAL,
    check_rollout_id,
    check_transition,
    env_map_fault,
    record_fault,
)
from .settings import DEFAULT_PREFIX, DEFAULT_REDIS_URL, check_prefix, printable, redacted_url, unparsed_password

#: A gateway replica is *live* while its last heartbeat (sent every second) is younger than this (s).
REPLICA_TTL_S = 5
#: A replica whose heartbeat is late (an event loop starved by CPU contention, a long GC pause) stays a member
#: this long (s): a drain waits for it, rather than taking its silence for death and resuming past its calls.
#: A clean shutdown leaves at once (:meth:`Store.drop_replica`); a killed replica holds drains this long at most.
REPLICA_LATE_S = 30
#: Seconds a trainer's lease of its prefix outlives its last renewal (renewed every 2.5 s): how long a killed
#: trainer's prefix stays taken.
TRAINER_LEASE_S = 15.0
#: The ``completed`` stream is trimmed (approximately) to this many entries; a trainer must not lag further.
COMPLETED_MAXLEN = 1_000_000
#: Version of the key layout above. 1: untagged keys (``P calls:rid``, ``P queue``); 2: hash-tagged keys.
LAYOUT_VERSION = 2
#: Tries of a recorded call that waits for replicas on a cluster (~20 s with the backoff: longer than a failover).
RECORD_RETRIES = 40
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError, MovedError, AskError,
             TryAgainError)
#: URL schemes that select redis-py's cluster client (``redis+cluster://host:port[,host:port...]``).
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: Options of a Redis URL that change the shape or type of replies (redis-py passes them to every connection):
#: refused by :func:`connect`, the Store reads bytes in RESP2 shapes.
REPLY_OPTIONS = frozenset({"decode_responses", "encoding", "encoding_errors", "legacy_responses"})
#: The ``?options`` a single-Redis URL may carry: redis-py's own URL options (``URL_QUERY_ARGUMENT_PARSERS``, less
#: :data:`REPLY_OPTIONS`) and the connection's plain-text settings. redis-py passes any other name to the connection
#: as a string (``?credential_provider=x``, ``?retry=3``: tracebacks at the first command): refused by name.
URL_OPTIONS = frozenset({
    "db", "socket_timeout", "socket_connect_timeout", "socket_read_size", "socket_keepalive", "retry_on_timeout",
    "max_connections", "health_check_interval", "timeout", "protocol", "client_name", "username", "password",
    "ssl_check_hostname", "ssl_include_verify_flags", "ssl_exclude_verify_flags", "ssl_min_version", "ssl_cert_reqs",
    "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_ciphers",
    "lib_name", "lib_version"})
#: The numeric :data:`URL_OPTIONS` and the range each takes, ``(lowest, highest, whether lowest itself is taken)``,
#: checked before redis-py reads them: it took ``inf``, ``nan``, ``0`` and ``1e300`` as given (an infinite or
#: astronomic timeout hung every command on a silent server; a gateway holds one connection for its control channel,
#: so one connection in all left none for its calls).
URL_NUMBERS = {"socket_timeout": (0, 3600, False), "socket_connect_timeout": (0, 3600, False),
               "timeout": (0, 3600, False), "health_check_interval": (0, 86400, True),
               "max_connections": (2, 2**20, True), "socket_read_size": (0, 2**26, False)}


def _lua_open_attempt(rollout: str, attempt: str) -> str:
    """Lua that returns -1 (no such rollout), -2 (another attempt runs) or -3 (it finished) unless the rollout JSON
    at key ``rollout`` is on attempt ``attempt`` and queuing or running (:data:`RECORD_REFUSED`): what a harness
    writes (a call record, an event) is checked against the rollout in the same step as the write."""
    return f"""
local raw = redis.call('GET', {rollout})
if not raw then return -1 end
local ok, rollout = pcall(cjson.decode, raw)
if not ok or type(rollout) ~= 'table' then return -1 end
if rollout['attempt_id'] ~= {attempt} then return -2 end
if rollout['status'] ~= 'queuing' and rollout['status'] ~= 'running' then return -3 end
"""


#: Append a harness's event while its attempt is open (as a call record: :func:`_lua_open_attempt`) and the stream
#: holds fewer than ARGV[2] of the attempt's (one step: concurrent posts cannot pass the cap, an event posted as
#: the rollout ends cannot land after it). KEYS: events stream, per-attempt counts, the rollout (one slot); ARGV:
#: event JSON, most events an attempt may post, attempt id.
_ADD_EVENT = _lua_open_attempt("KEYS[3]", "ARGV[3]") + """
if tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0') >= tonumber(ARGV[2]) then return false end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])
"""

#: A heartbeat of the replica owning ``KEYS[1]`` (``ARGV[1]``: its token): renew its ownership, write its status
#: (``KEYS[2]``) and its registry entry (``KEYS[3]``); 0 and nothing written if another process owns the id.
_OWNED_HEARTBEAT = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
return 1
"""

#: Forget replica id ``KEYS[1]`` unless a process other than ``ARGV[1]`` owns it (``ARGV[1]`` empty: whoever
#: does): delete its ownership, its status (``KEYS[2]``) and its registry entry (``KEYS[3]``, member ``ARGV[2]``).
_DROP_REPLICA = """
local owner = redis.call('GET', KEYS[1])
if ARGV[1] ~= '' and owner and owner ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
return 1
"""

#: Register group ``ARGV[1]`` (record ``ARGV[2]``) in the hash ``KEYS[1]`` unless it exists (then 0), and add it
#: to its run's set ``KEYS[2]`` if one is given.
_REGISTER_GROUP = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if KEYS[2] then redis.call('SADD', KEYS[2], ARGV[1]) end
return 1
"""

_RAISE_COUNTER = """
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if now < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""

_OWNED_LEASE = """
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, 1, string.len(ARGV[1]) + 1) ~= ARGV[1] .. ' ' then return 0 end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
if KEYS[2] then redis.call('SADD', KEYS[2], ARGV[4]) end
return 1
"""

_DROP_OWNED_LEASE = """
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. ' ' then redis.call('DEL', KEYS[1]) end
return 1
"""

#: KEYS: seq counter, calls stream, write tokens (one slot: ``{rid}``); ARGV: the record JSON with
#: ``"seq":-1`` (its third field, before any agent-controlled text, so the first match is always the record's
#: own), and the write's token. A token seen before returns its ``seq`` without a second record: a client
#: that retries after a lost reply (redis-py retries on connection errors, e.g. during a failover) records
#: once. The token is then written again (same value), so a ``WAIT`` after the retry covers the record.
#: KEYS[4]: the rollout; ARGV[3..5]: attempt id, most calls and most record bytes an attempt may hold. The rollout
#: is read in the same step as the write (:func:`_lua_open_attempt`): a call held by a pause, or in flight, while its
#: rollout finished or its attempt was retried is refused here, whatever the gateway checked when the call came in.
#: Negative returns: see :data:`RECORD_REFUSED`.
_RECORD_CALL = """
local done = redis.call('HGET', KEYS[3], ARGV[2])
if done then
  redis.call('HSET', KEYS[3], ARGV[2], done)
  return tonumber(done)
end
""" + _lua_open_attempt("KEYS[4]", "ARGV[3]") + """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[4]) then return -4 end
if tonumber(redis.call('HGET', KEYS[3], '_bytes') or '0') + string.len(ARGV[1]) > tonumber(ARGV[5]) then
  return -5
end
local seq = redis.call('INCR', KEYS[1]) - 1
local body = string.gsub(ARGV[1], '"seq":%-1', '"seq":' .. seq, 1)
redis.call('XADD', KEYS[2], '*', 'd', body)
redis.call('HSET', KEYS[3], ARGV[2], seq)
redis.call('HINCRBY', KEYS[3], '_bytes', string.len(ARGV[1]))
return seq
"""

#: the record script's refusals: return value → :class:`RecordRefused` code
RECORD_REFUSED = {-1: "rollout_not_found", -2: "stale_attempt", -3: "rollout_finished", -4: "too_many_calls",
                  -5: "too_many_bytes"}
#: an attempt's default bounds (a harness holding a scoped key cannot fill Redis through model calls)
CALLS_PER_ATTEMPT_MAX = 10_000
RECORD_BYTES_PER_ATTEMPT_MAX = 256 * 1024 * 1024


class RecordRefused(RuntimeError):
    """A call record the store would not write: ``code`` is one of :data:`RECORD_REFUSED`'s values (the
    rollout is gone, another attempt runs, it finished, or the attempt holds its most calls or bytes)."""

    def __init__(self, code: str, rollout_id: str, attempt_id: str):
        super().__init__(f"record of {rollout_id!r} attempt {attempt_id!r} refused: {code}")
        self.code, self.rollout_id, self.attempt_id = code, rollout_id, attempt_id


class RolloutNotFound(KeyError):
    """No rollout with this id exists."""


class UnreadableRecord(ValueError):
    """A stored record this version cannot read (one written by another AGL version, or by hand): a one-line
    message naming it and its first fault. Every CLI prints it as one line (round 23: a rollout of an unknown status
    made listings a 100-line traceback, an unreadable policy could not be replaced)."""


def _parsed(model: type, raw: bytes | str, what: str):
    """``raw`` read as ``model`` (a pydantic model); :class:`UnreadableRecord` naming ``what`` if it does not
    validate."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "the record"
        raise UnreadableRecord(printable(f"{what}: its stored record cannot be read by this version ({where}: "
                                         f"{first.get('msg', 'invalid')}; {exc.error_count()} error(s))")) from None


class CallsRecordedSince(RuntimeError):
    """An attempt holds other records than the caller saw (:meth:`Store.update_rollout` ``calls_seen``)."""


class LayoutError(RuntimeError):
    """The database holds keys of another layout version under this prefix (see docs/operations.md)."""


class NotReplicated(RedisError):
    """A write was applied by the master but fewer than ``wait_replicas`` replicas acknowledged it in time.

    A :class:`redis.exceptions.RedisError`, so callers treat it as "store unavailable": the write is not
    acknowledged (it may still survive, or be lost in a failover).
    """


#: What redis-py (8.1) raises when its cluster client closes a connection another command is using.
_CLOSED_UNDER_US = (AttributeError, RuntimeError)


class _PubSub(aioredis.client.PubSub):
    """redis-py's pub/sub whose commands and reads never hide a cancellation
    (:func:`~agl_common.aio.keeps_cancellation`; 36 of 100 lost in a loop of subscribe, listen, close). The one object of redis-py that callers of the
    :class:`Store` use themselves (:meth:`Store.subscribe_control`); the Store's own methods are guarded whole."""

    execute_command = keeps_cancellation(aioredis.client.PubSub.execute_command)
    parse_response = keeps_cancellation(aioredis.client.PubSub.parse_response)


class _ClusterPubSub(ClusterPubSub):
    """The cluster pub/sub, likewise."""

    execute_command = keeps_cancellation(ClusterPubSub.execute_command)
    parse_response = keeps_cancellation(aioredis.client.PubSub.parse_response)


def _closed_under(what: Any, exc: BaseException) -> RedisConnectionError:
    """The race of :class:`_RedisCluster` (``exc``, one of ``_CLOSED_UNDER_US``, under command ``what``) as what
    callers handle: :class:`redis.exceptions.ConnectionError`."""
    return RedisConnectionError(f"connection closed under {what!r} during a topology change: {exc}")


async def _race_as_connection_error(awaitable: Awaitable[Any], what: Any) -> Any:
    """Await ``awaitable``; the race of :class:`_RedisCluster` is raised as :func:`_closed_under` says."""
    try:
        return await awaitable
    except _CLOSED_UNDER_US as exc:
        raise _closed_under(what, exc) from exc


class _ClusterPipeline(ClusterPipeline):
    """redis-py's cluster pipeline (and transaction) with the same race reported as a connection error: its
    commands reach the nodes without :meth:`RedisCluster.execute_command` (the gateway's per-call
    :meth:`Store.attempt_usage` answered 500 in tests/test_redis_cluster.py's failover test)."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:  # (a WATCHed transaction runs the command now, part of it before the first await)
            res = super().execute_command(*args, **kwargs)
        except _CLOSED_UNDER_US as exc:
            raise _closed_under(args[0], exc) from exc
        return res if res is self else _race_as_connection_error(res, args[0])  # queued, or run now (WATCHed)

    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await _race_as_connection_error(super().execute(*args, **kwargs), "pipeline")

    async def watch(self, *names: Any) -> Any:
        return await _race_as_connection_error(super().watch(*names), "WATCH")

    async def unwatch(self) -> Any:
        return await _race_as_connection_error(super().unwatch(), "UNWATCH")

    async def reset(self) -> None:
        await _race_as_connection_error(super().reset(), "UNWATCH")


class _RedisCluster(RedisCluster):
    """redis-py's asyncio cluster client with one of its races reported as what it is, a connection error.

    During a failover, redis-py (8.1) closes a node's connections from one command's error path while another
    command is using one of them; that command then fails with ``AttributeError: 'NoneType' object has no
    attribute 'writelines'`` or ``RuntimeError: unable to perform operation on <TCPTransport closed=True>``
    (both seen in tests/test_redis_cluster.py's failover test). Callers handle
    :class:`redis.exceptions.ConnectionError` (the gateway answers 503 and the agent retries), not those. The
    same holds for its pipelines and transactions (:class:`_ClusterPipeline`).
    """

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await _race_as_connection_error(super().execute_command(*args, **kwargs), args[0])

    async def initialize(self, *args: Any, **kwargs: Any) -> _RedisCluster:
        """redis-py's, with its set-up failures as the errors every caller handles: a server that answers but is no
        cluster node (``CLUSTER SLOTS`` refused) → :class:`StoreRefused`; no node reachable, or slots not (yet)
        agreed or covered → :class:`redis.exceptions.ConnectionError` (a bare ``RedisClusterException`` was a
        traceback in every CLI)."""
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            if isinstance(exc.__cause__, (RedisClusterException, ResponseError)):
                raise StoreRefused(f"the server is not a Redis Cluster node ({exc.__cause__}); a single Redis "
                                   "takes a redis:// URL") from None
            raise RedisConnectionError(str(exc)) from exc

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> _ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _ClusterPipeline(self, transaction)


class StoreRefused(RedisConnectionError):
    """Redis answered but refused the connection's set-up: a database number it does not have (``/16`` on a
    server of 16). A :class:`redis.exceptions.ConnectionError`, so every CLI prints it in one line; trying again
    does not help, so a gateway refuses to start on it (:func:`agl_gateway.app.claim_replica_id`)."""


class _CheckedSetup:
    """Mixed into redis-py's connection class: an error answer to the set-up commands (``SELECT``) raises
    :class:`StoreRefused` naming the URL (without its secrets), not a bare ``ResponseError`` that reads as a fault
    of whatever command came first."""

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        try:
            await super().on_connect_check_health(check_health)  # type: ignore[misc]
        except ResponseError as exc:
            await self.disconnect()  # type: ignore[attr-defined]
            raise StoreRefused(f"the Redis server refused database {getattr(self, 'db', 0)}: {exc}") from None


def redis_error_line(exc: Exception) -> str:
    """The one line a CLI prints for a Redis it cannot use or that refused a command (``exc``: a
    :class:`redis.exceptions.RedisError`), the server's text made printable (:func:`~agl_common.settings.printable`: a
    server answering with terminal escapes must not drive the terminal)."""
    said = printable(str(exc))
    if isinstance(exc, StoreRefused):
        return f"Redis refused: {said} (--redis / AGL_REDIS_URL)"
    if isinstance(exc, AuthenticationError):
        return f"Redis refused the credentials: {said} (the user and password of --redis / AGL_REDIS_URL)"
    if isinstance(exc, InvalidResponse):
        return f"not a Redis server: {said} (a mistyped port? --redis / AGL_REDIS_URL)"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return f"Redis did not answer: {said} (is it running? --redis / AGL_REDIS_URL)"
    return (f"Redis refused a command: {said} (out of memory, a user without that permission, a read-only replica? "
            "--redis / AGL_REDIS_URL)")


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` selects Redis Cluster (scheme ``redis+cluster`` or ``rediss+cluster``)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def check_redis_url(url: str) -> str:
    """``url`` if a Redis client can be made from it (nothing is connected); ``ValueError`` naming what is wrong
    otherwise (not a Redis URL, an unknown ``?option``, a database out of range). For configs and CLIs, before
    anything starts."""
    connect(url, 1)
    return url


def connect(url: str, max_connections: int = 512) -> aioredis.Redis | RedisCluster:
    """The asyncio client for ``url``: a :class:`redis.asyncio.Redis` on a blocking pool, or for
    ``redis+cluster://h1:p1[,h2:p2...][?opts]`` (``rediss+cluster`` for TLS) a
    :class:`redis.asyncio.cluster.RedisCluster` seeded with those nodes.

    ``max_connections``: pool size (per node on a cluster). On one Redis a caller waits up to 10 s for a free
    connection; the cluster client raises ``MaxConnectionsError`` instead. A cluster URL must not name a
    database (Redis Cluster only has db 0): ``ValueError``.
    """
    if unparsed_password(url):  # (every later message would show a piece of it as the path or an option)
        raise ValueError(f"bad Redis URL {redacted_url(url)}: its password holds '/', '?' or '#': percent-encode "
                         "them (%2F, %3F, %23)")
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    changes_replies = sorted(REPLY_OPTIONS & set(query))
    if changes_replies:  # the Store reads bytes in redis-py's RESP2 shapes; decoded replies broke every command
        raise ValueError(f"bad Redis URL {redacted_url(url)}: ?{', ?'.join(changes_replies)} changes what Redis "
                         "replies look like; AGL sets that itself")
    if any(v != "2" for v in query.get("protocol", [])):  # (RESP3 replies broke the Store's stream reads)
        raise ValueError(f"bad Redis URL {redacted_url(url)}: ?protocol takes 2 only (AGL reads RESP2 replies)")
    unknown = sorted(set(query) - URL_OPTIONS - REPLY_OPTIONS) if parts.scheme not in CLUSTER_SCHEMES else []
    if unknown:
        raise ValueError(f"bad Redis URL {redacted_url(url)}: ?{', ?'.join(unknown)} is no option AGL takes (it "
                         f"takes ?{', ?'.join(sorted(URL_OPTIONS))})")
    if parts.scheme in ("redis", "rediss") and not re.fullmatch(r"/?([0-9]+)?", parts.path):
        # (redis-py reads a path it cannot parse, ``/abc`` or ``/1/x``, as database 0 without a word)
        raise ValueError(f"bad Redis URL {redacted_url(url)}: the path must be a database number, got "
                         f"{parts.path!r:.40}")
    if parts.scheme not in CLUSTER_SCHEMES:
        # A blocking pool: past ``max_connections`` a caller waits (up to 10 s) for a free connection
        # instead of failing at once (redis-py's default pool turned load into "Too many connections").
        for name in sorted(set(URL_NUMBERS) & set(query)):  # (``inf`` turned a timeout off, ``0`` read nothing for ever)
            low, high, low_taken = URL_NUMBERS[name]
            for value in query[name]:
                try:
                    number = float(value)
                except ValueError:
                    continue  # (redis-py names it below)
                if not (math.isfinite(number) and (number >= low if low_taken else number > low) and number <= high):
                    raise ValueError(f"bad Redis URL {redacted_url(url)}: ?{name} takes a number "
                                     f"{'from' if low_taken else 'above'} {low} to {high}, got {value[:40]!r}")
        try:  # an unknown option value (``?ssl_cert_reqs=x``) or a database out of range fails here, not later
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=10, socket_connect_timeout=5, socket_timeout=10,
                health_check_interval=10)
            pool.connection_class(**pool.connection_kwargs)
            if not 0 <= int(pool.connection_kwargs.get("db", 0)) < 2**31:
                raise ValueError("database number out of range")
        except (TypeError, ValueError, RedisError) as exc:  # (redis-py's TLS options raise a bare RedisError)
            raise ValueError(f"bad Redis URL {redacted_url(url)}: {exc}") from None
        pool.connection_class = type(pool.connection_class.__name__, (_CheckedSetup, pool.connection_class), {})
        return aioredis.Redis.from_pool(pool)
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster URL has no database number (got path {parts.path!r} in "
                         f"{redacted_url(url)})")
    netloc = parts.netloc.rsplit("@", 1)[-1]
    nodes = []
    for hostport in filter(None, netloc.split(",")):
        host, sep, port = hostport.rpartition(":")
        if not sep or hostport.endswith("]"):  # no port given (``h`` or ``[::1]``)
            host, port = hostport, ""
        nodes.append(ClusterNode(host.strip("[]") or "127.0.0.1", int(port or 6379)))
    if not nodes:
        raise ValueError(f"no node in Redis Cluster URL {redacted_url(url)}")
    auth = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    user, _, password = auth.partition(":")
    if set(query) - {"retries"}:  # (nothing else of the query was read: every other option was silently dropped)
        raise ValueError(f"bad Redis URL {redacted_url(url)}: a Redis Cluster URL takes ?retries=N only, got "
                         f"?{', ?'.join(sorted(set(query) - {'retries'}))}")
    # Failover: a replica is promoted after ``cluster-node-timeout`` (15 s by default); retry connection errors
    # with a short capped backoff for about that long instead of redis-py's default 3 tries.
    given = query.get("retries", ["40"])
    if len(given) != 1 or not re.fullmatch(r"[0-9]{1,4}", given[0]):
        raise ValueError(f"bad Redis URL {redacted_url(url)}: ?retries takes one number of tries (0-9999)")
    retries = int(given[0])
    return _RedisCluster(
        startup_nodes=nodes, username=unquote(user) or None, password=unquote(password) or None,
        ssl=CLUSTER_SCHEMES[parts.scheme] == "rediss", max_connections=max_connections,
        socket_connect_timeout=1, socket_timeout=10,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries))


@methods_keep_cancellation
class Store:
    """Typed access to one experiment's Redis keys.

    Args:
        redis_url: ``redis://127.0.0.1:6379/0`` (one Redis) or ``redis+cluster://h1:p1,h2:p2`` (Redis Cluster,
            see :func:`connect`).
        prefix: key prefix, so several experiments can share one Redis; must not contain ``{`` or ``}``
            (hash-tag delimiters): ``ValueError``.
        max_connections: connection pool size; beyond it callers wait for a free connection.
        wait_replicas: after each recorded call, wait (``WAIT``) until this many replicas hold it, so an
            acknowledged record survives the loss of its master; 0: do not wait (Redis replication is
            asynchronous: an acknowledged record can then be lost in a failover).
        wait_timeout_ms: how long to wait for them; fewer replicas in time raises :class:`NotReplicated`.
    Errors from Redis (``redis.exceptions.ConnectionError`` and friends) propagate to the caller.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, prefix: str = DEFAULT_PREFIX,
                 max_connections: int = 512, wait_replicas: int = 0, wait_timeout_ms: int = 1000):
        check_prefix(prefix)
        if wait_replicas < 0 or wait_timeout_ms < 0:
            raise ValueError("wait_replicas and wait_timeout_ms must be >= 0")
        self.redis_url = redis_url
        self.prefix = prefix
        self.cluster = is_cluster_url(redis_url)
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.r: aioredis.Redis | RedisCluster = connect(redis_url, max_connections)
        self._record_script = self.r.register_script(_RECORD_CALL)
        self._event_script = self.r.register_script(_ADD_EVENT)
        self._heartbeat_script = self.r.register_script(_OWNED_HEARTBEAT)
        self._drop_replica_script = self.r.register_script(_DROP_REPLICA)
        self._register_group_script = self.r.register_script(_REGISTER_GROUP)
        self._raise_counter_script = self.r.register_script(_RAISE_COUNTER)
        self._owned_lease_script = self.r.register_script(_OWNED_LEASE)
        self._drop_owned_lease_script = self.r.register_script(_DROP_OWNED_LEASE)
        self._global = prefix + "{" + (prefix[:-1] if prefix.endswith(":") else prefix) + "}:"
        self._layout_ok = False

    def key(self, *parts: str) -> str:
        """An experiment-wide key (``P {E}:a:b``): all of them share one hash slot, so a transaction or a
        blocking move over several of them (queue → processing list) works on a cluster."""
        return self._global + ":".join(parts)

    def rollout_key(self, kind: str, rollout_id: str, *parts: str) -> str:
        """A key of one rollout (``P kind:{rid}[:part...]``): every key of a rollout shares its slot."""
        return self.prefix + kind + ":{" + rollout_id + "}" + "".join(":" + p for p in parts)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    async def ensure_layout(self) -> None:
        """Stamp an empty prefix with :data:`LAYOUT_VERSION`, or check the stamp already there.

        Raises :class:`LayoutError` when the prefix holds another version, or keys of the untagged layout 1
        (``P queue``, ``P rollouts``, ``P completed``, ``P policy``, ``P control:last``) with no stamp: mixing
        layouts would lose rollouts. docs/operations.md describes the one-time way out. Idempotent; checked
        once per store object (then cached).
        """
        if self._layout_ok:
            return
        marker = self.key("layout")
        raw = await self.r.get(marker)
        if raw is None:
            old = [self.prefix + k for k in ("queue", "rollouts", "completed", "policy", "control:last")]
            found = [k for k, n in zip(old, [await self.r.exists(k) for k in old]) if n]
            if found:
                raise LayoutError(
                    f"Redis holds keys of AGL's layout 1 under prefix {self.prefix!r} ({', '.join(found)}), and this "
                    f"version writes layout {LAYOUT_VERSION} (hash-tagged keys). Finish or discard that experiment "
                    f"(delete its keys) or use another prefix; see docs/operations.md, 'Key layout versions'.")
            await self.r.set(marker, str(LAYOUT_VERSION), nx=True)
            raw = await self.r.get(marker)
        if int(raw) != LAYOUT_VERSION:
            raise LayoutError(f"prefix {self.prefix!r} holds key layout {int(raw)}, this version of AGL reads "
                              f"layout {LAYOUT_VERSION}; use the matching AGL version or another prefix")
        self._layout_ok = True

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        """MGET, split by slot on a cluster (keys of several rollouts live on several nodes)."""
        if self.cluster:
            return await self.r.mget_nonatomic(keys)
        return await self.r.mget(keys)

    # ---------------------------------------------------------------- rollouts
    async def create_rollout(self, rollout: Rollout, enqueue: bool = True) -> Rollout:
        """Store a new rollout and queue it. Raises ``ValueError`` if the id exists or cannot name a rollout
        (:func:`~agl_common.schemas.check_rollout_id`), or its ``env_map`` cannot be an environment
        (:func:`~agl_common.schemas.env_map_fault`)."""
        check_rollout_id(rollout.rollout_id)
        if why := env_map_fault(rollout):
            raise ValueError(f"rollout {rollout.rollout_id!r}: {why}")
        await self.ensure_layout()
        key = self.rollout_key("rollout", rollout.rollout_id)
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
        raw = await self.r.get(self.rollout_key("rollout", rollout_id))
        if raw is None:
            raise RolloutNotFound(rollout_id)
        return _parsed(Rollout, raw, f"rollout {rollout_id!r}")

    async def get_rollouts(self, rollout_ids: list[str], skip_missing: bool = False) -> list[Rollout]:
        """Fetch many rollouts in one round trip, in the order of ``rollout_ids``. Raises :class:`RolloutNotFound`
        for a missing one and :class:`UnreadableRecord` for one this version cannot read, or with ``skip_missing``
        leaves either out (what views of the index use: a record deleted or evicted by hand while the index still
        lists its id, or one another version wrote, made whole listings fail)."""
        if not rollout_ids:
            return []
        raws = await self._mget([self.rollout_key("rollout", rid) for rid in rollout_ids])
        out = []
        for rid, raw in zip(rollout_ids, raws):
            if raw is None and skip_missing:
                continue
            if raw is None:
                raise RolloutNotFound(rid)
            try:
                out.append(_parsed(Rollout, raw, f"rollout {rid!r}"))
            except UnreadableRecord:
                if not skip_missing:
                    raise
        return out

    async def rollout_ids(self) -> list[str]:
        """Every rollout id, oldest first (creation time)."""
        return [i.decode() for i in await self.r.zrange(self.key("rollouts"), 0, -1)]

    async def run_rollout_ids(self, run: str) -> list[str]:
        """The rollout ids of run ``run`` (every group registered with :attr:`GroupInfo.run` ``== run``, its
        evaluations included), oldest first; ids no longer in the rollout index are left out. ``[]`` for a run
        with no registered group (an unknown run, or one recorded before groups carried their run)."""
        gids = sorted(i.decode() for i in await self.r.smembers(self.key("run-groups", run)))
        members = [rid for info in await self.groups(gids) if info is not None for rid in info.rollout_ids]
        if not members:
            return []
        scores = await self.r.zmscore(self.key("rollouts"), members)
        return [rid for _, rid in sorted((s, rid) for s, rid in zip(scores, members) if s is not None)]

    async def list_rollouts(self, limit: int = 1000) -> list[Rollout]:
        ids = [i.decode() for i in await self.r.zrange(self.key("rollouts"), 0, limit - 1)]
        return await self.get_rollouts(ids)

    async def update_rollout(self, rollout_id: str, change: Callable[[Rollout], None],
                             calls_seen: tuple[str, int] | None = None) -> Rollout:
        """Apply ``change`` to the stored rollout atomically (optimistic WATCH/MULTI, retried).

        ``change`` mutates the rollout in place and may raise to abort (nothing is written).
        ``calls_seen=(attempt_id, n)``: only if that attempt still holds exactly ``n`` records (its call counter
        is watched too), else :class:`CallsRecordedSince` and nothing is written: the controller ends a run
        only on the calls its judge saw.
        A changed ``status`` is checked against the state machine here, in one place. A move to
        succeeded/failed is then announced on ``P {E}:completed`` (:meth:`announce_completed`): a second
        write, since the rollout's slot and the stream's differ on a cluster. A process that dies between
        the two leaves its controller claim behind; the controller that adopts it announces again.
        """
        key = self.rollout_key("rollout", rollout_id)
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    seq_key = None if calls_seen is None else self.rollout_key("seq", rollout_id, calls_seen[0])
                    await pipe.watch(key, *([seq_key] if seq_key else []))
                    raw = await pipe.get(key)
                    if raw is None:
                        raise RolloutNotFound(rollout_id)
                    if seq_key and int(await pipe.get(seq_key) or 0) != calls_seen[1]:
                        raise CallsRecordedSince(rollout_id, calls_seen[0])
                    rollout = _parsed(Rollout, raw, f"rollout {rollout_id!r}")
                    old_status = rollout.status
                    change(rollout)
                    if rollout.status != old_status:
                        check_transition(old_status, rollout.status)
                    pipe.multi()
                    pipe.set(key, rollout.model_dump_json())
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        if rollout.status != old_status and rollout.status in TERMINAL:
            await self.announce_completed(rollout)
        return rollout

    async def announce_completed(self, rollout: Rollout) -> None:
        """Append ``(rid, gid, aid)`` of a finished rollout to ``P {E}:completed`` (trimmed to about
        :data:`COMPLETED_MAXLEN`). Readers treat an entry as a wake-up and read the status: a repeated
        announcement is harmless."""
        await self.r.xadd(self.key("completed"), {"rid": rollout.rollout_id, "gid": rollout.group_id or "",
                                                  "aid": rollout.attempt_id},
                          maxlen=COMPLETED_MAXLEN, approximate=True)

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

    async def queued_ids(self) -> list[str]:
        """Rollout ids waiting in the queue, next to be claimed last."""
        return [i.decode() for i in await self.r.lrange(self.key("queue"), 0, -1)]

    async def next_group_number(self, tag: str) -> int:
        """0, 1, 2... per ``tag`` (``INCR P groups:{tag}``): a restarted trainer never reuses a number."""
        return int(await self.r.incr(self.key("groups", tag))) - 1

    async def skip_group_numbers(self, tag: str, below: int) -> None:
        """Make :meth:`next_group_number` of ``tag`` give ``below`` or more from now on (a resumed run whose
        Redis lost its counter: the numbers its steps used are never given again). Never lowers the counter."""
        await self._raise_counter_script(keys=[self.key("groups", tag)], args=[int(below)])

    async def register_group(self, info: GroupInfo) -> None:
        """Record a group's members, owner and run (``HSETNX P group_members``, and ``SADD P run-groups:{run}``
        in the same script); call it before creating its rollouts.

        Raises ``ValueError`` if the group id is registered already: a group is never redefined.
        """
        await self.ensure_layout()
        keys = [self.key("group_members")] + ([self.key("run-groups", info.run)] if info.run is not None else [])
        if not await self._register_group_script(keys=keys, args=[info.group_id, info.model_dump_json()]):
            raise ValueError(f"group {info.group_id!r} already exists")

    async def groups(self, group_ids: list[str]) -> list[GroupInfo | None]:
        """The registered :class:`GroupInfo` of each id, ``None`` for an id never registered (one round trip)."""
        if not group_ids:
            return []
        raws = await self.r.hmget(self.key("group_members"), group_ids)
        return [_parsed(GroupInfo, raw, f"group {gid!r}") if raw else None for gid, raw in zip(group_ids, raws)]

    # ---------------------------------------------------------------- calls
    async def record_call(self, record: CallRecord) -> CallRecord:
        """Assign the next ``seq`` of the attempt and append the record to the rollout's stream.

        One atomic server-side script (one round trip): the counter and the stream never disagree, even if
        the gateway dies mid-call. Raises ``ValueError`` (nothing written) for a record that breaks the rules the
        gateway keeps (:func:`agl_common.schemas.record_fault`). Returns once Redis has acknowledged the write
        (and, with ``wait_replicas``, once that many replicas hold it).
        """
        why = record_fault(record)
        if why:
            raise ValueError(f"call record of {record.rollout_id!r} refused: {why}")
        record.seq = -1
        record.seq = await self.record_call_json(record.rollout_id, record.attempt_id,
                                                 record.model_dump_json().encode())
        return record

    async def record_call_json(self, rollout_id: str, attempt_id: str, record_json: bytes,
                               max_calls: int = CALLS_PER_ATTEMPT_MAX,
                               max_bytes: int = RECORD_BYTES_PER_ATTEMPT_MAX) -> int:
        """:meth:`record_call` for a record already serialized (the gateway's hot path); returns its ``seq``.

        Written only while the rollout is queuing or running under ``attempt_id``, and while the attempt holds
        fewer than ``max_calls`` records of fewer than ``max_bytes`` bytes in all (checked in the same step as
        the write); otherwise raises :class:`RecordRefused`.

        ``record_json`` must be :class:`CallRecord` JSON with ``"seq":-1`` as its third field. The script is
        sent by hash (EVALSHA; loaded with SCRIPT LOAD when a node does not know it yet). Each call carries a
        fresh write token, so redis-py's own retry after a lost reply never records the call twice.
        With ``wait_replicas`` > 0, ``WAIT wait_replicas wait_timeout_ms`` follows on the same connection
        (one round trip); fewer replicas in time raises :class:`NotReplicated`.
        """
        keys = [self.rollout_key("seq", rollout_id, attempt_id), self.rollout_key("calls", rollout_id),
                self.rollout_key("tokens", rollout_id, attempt_id), self.rollout_key("rollout", rollout_id)]
        args = [record_json, uuid.uuid4().hex, attempt_id, max_calls, max_bytes]
        if not self.wait_replicas:
            return self._written(await self._record_script(keys=keys, args=args), rollout_id, attempt_id)
        if not self.cluster:
            # One connection: redis-py re-sends the whole pipeline on a new connection after a connection
            # error; a write already done is then re-stamped by the script, so the WAIT still covers it.
            for _ in range(2):  # a server that does not know the script yet: load it and go again
                pipe = self.r.pipeline(transaction=False)
                pipe.evalsha(self._record_script.sha, len(keys), *keys, *args)
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                try:
                    seq, acked = await pipe.execute()
                    break
                except NoScriptError:
                    await self.r.script_load(_RECORD_CALL)
            return self._written(self._replicated(seq, acked, keys[1]), rollout_id, attempt_id)
        return self._written(await self._record_and_wait_cluster(keys, args), rollout_id, attempt_id)

    async def attempt_usage(self, rollout_id: str, attempt_id: str) -> tuple[int, int]:
        """``(records, record bytes)`` one attempt holds (what the record script bounds)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.rollout_key("seq", rollout_id, attempt_id))
        pipe.hget(self.rollout_key("tokens", rollout_id, attempt_id), "_bytes")
        calls, size = await pipe.execute()
        return int(calls or 0), int(size or 0)

    @staticmethod
    def _written(seq: Any, rollout_id: str, attempt_id: str) -> int:
        """The record script's answer as a ``seq``; raises :class:`RecordRefused` for a refusal."""
        seq = int(seq)
        if seq < 0:
            raise RecordRefused(RECORD_REFUSED[seq], rollout_id, attempt_id)
        return seq

    def _replicated(self, seq: Any, acked: Any, what: str) -> int:
        if int(seq) < 0:  # refused: nothing was written for the replicas to hold
            return int(seq)
        if int(acked) < self.wait_replicas:
            raise NotReplicated(f"{acked} of {self.wait_replicas} replicas acknowledged the record of {what} "
                                f"within {self.wait_timeout_ms} ms")
        return int(seq)

    async def _record_and_wait_cluster(self, keys: list[str], args: list) -> int:
        """EVALSHA + WAIT pipelined on one connection to the master of the rollout's slot (WAIT counts the
        writes of its own connection; redis-py's cluster pipeline may re-route a retried WAIT elsewhere).

        On a connection error, a redirect (MOVED/ASK), CLUSTERDOWN or TRYAGAIN (a failover in progress) the
        pair is sent again, up to :data:`RECORD_RETRIES` times with a capped backoff, after reloading the
        slot map: the write token makes the script idempotent, and a repeated token re-stamps the record so
        that the WAIT on the new connection covers it.
        """
        cmds = [("EVALSHA", self._record_script.sha, len(keys), *keys, *args),
                ("WAIT", self.wait_replicas, self.wait_timeout_ms)]
        last: Exception | None = None
        for attempt in range(RECORD_RETRIES):
            if attempt:
                await asyncio.sleep(min(0.5, 0.05 * 2 ** attempt))
            try:
                await self.r.initialize()  # the slot map (a no-op unless a failure asked for a reload)
                node = self.r.get_node_from_key(keys[0])
            except (*RETRYABLE, *_CLOSED_UNDER_US) as exc:
                last = exc if isinstance(exc, RETRYABLE) else _closed_under("CLUSTER SLOTS", exc)
                continue
            batch = [PipelineCommand(i, *c) for i, c in enumerate(cmds)]
            try:
                await node.execute_pipeline(batch)
            except (*RETRYABLE, *_CLOSED_UNDER_US) as exc:  # the send failed (node down; see _RedisCluster)
                batch[0].result = batch[1].result = RedisConnectionError(str(exc))
            seq, acked = batch[0].result, batch[1].result
            if isinstance(seq, NoScriptError):
                last = seq
                try:
                    await _race_as_connection_error(node.execute_command("SCRIPT", "LOAD", _RECORD_CALL), "SCRIPT")
                except RETRYABLE as exc:  # the node went down meanwhile: the next try reloads the slot map
                    last = exc
                    self.r._initialize = True
                continue
            err = next((r for r in (seq, acked) if isinstance(r, Exception)), None)
            if err is None:
                return self._replicated(seq, acked, keys[1])
            if not isinstance(err, RETRYABLE):
                raise err
            last = err
            self.r._initialize = True  # reload the slot map before the next try (what redis-py does)
        raise last if last is not None else NotReplicated(f"record of {keys[1]} not written")

    async def count_calls(self, rollout_id: str, attempt_id: str) -> int:
        raw = await self.r.get(self.rollout_key("seq", rollout_id, attempt_id))
        return int(raw) if raw else 0

    async def read_calls(self, rollout_id: str, attempt_id: str | None = None) -> list[CallRecord]:
        """Every recorded call of a rollout (optionally one attempt), ordered by ``seq``."""
        entries = await self.r.xrange(self.rollout_key("calls", rollout_id))
        calls = [_parsed(CallRecord, fields[b"d"], f"call {entry_id.decode()} of rollout {rollout_id!r}")
                 for entry_id, fields in entries]
        if attempt_id is not None:
            calls = [c for c in calls if c.attempt_id == attempt_id]
        return sorted(calls, key=lambda c: (int(c.attempt_id), c.seq))

    async def call_entries(self, rollout_id: str) -> int:
        """How many call records the rollout's stream holds, all attempts together (XLEN; 0 if none)."""
        return int(await self.r.xlen(self.rollout_key("calls", rollout_id)))

    async def add_event(self, rollout_id: str, attempt_id: str, type_: str, data: dict[str, Any],
                        max_events: int | None = None) -> str | None:
        """Append an event to the rollout's stream; returns its entry id.

        ``max_events`` (a harness's event, through the gateway): written only while ``attempt_id`` is the rollout's
        attempt and it is queuing or running, checked in the same step as the write (else :class:`RecordRefused`,
        as for a call record), and only while this attempt posted fewer than ``max_events`` (else ``None``,
        nothing written; a retried attempt starts at 0). Without it (the controller's own events), as it is."""
        body = orjson.dumps({"attempt_id": attempt_id, "type": type_, "data": data, "t": time.time()})
        key = self.rollout_key("events", rollout_id)
        if max_events is None:
            entry_id = await self.r.xadd(key, {"d": body})
        else:
            entry_id = await self._event_script(
                keys=[key, self.rollout_key("events", rollout_id, "n"), self.rollout_key("rollout", rollout_id)],
                args=[body, max_events, attempt_id])
            if entry_id is None:
                return None
            if isinstance(entry_id, int) and entry_id < 0:
                raise RecordRefused(RECORD_REFUSED[entry_id], rollout_id, attempt_id)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def recent_events(self, rollout_id: str, count: int) -> tuple[int, list[dict[str, Any]]]:
        """How many events the rollout's stream holds (all attempts) and its last ``count``, oldest first (one
        round trip: XLEN, XREVRANGE COUNT; a page need not read thousands of events to show 50)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(self.rollout_key("events", rollout_id))
        pipe.xrevrange(self.rollout_key("events", rollout_id), count=count)
        total, entries = await pipe.execute()
        return int(total), [orjson.loads(fields[b"d"]) for _, fields in reversed(entries)]

    async def read_events(self, rollout_id: str) -> list[dict[str, Any]]:
        entries = await self.r.xrange(self.rollout_key("events", rollout_id))
        return [orjson.loads(fields[b"d"]) for _, fields in entries]

    # ---------------------------------------------------------------- policy & control
    async def get_policy(self) -> Policy | None:
        raw = await self.r.get(self.key("policy"))
        return _parsed(Policy, raw, "the current policy") if raw else None

    async def set_policy(self, policy: Policy) -> None:
        """Store ``policy`` as the current one, checked first (``model_copy`` validates nothing: a policy every later
        read would refuse was stored; round 23). Raises ``pydantic.ValidationError`` (a ``ValueError``)."""
        await self.r.set(self.key("policy"), Policy.model_validate(policy.model_dump()).model_dump_json())

    async def publish_control(self, command: ControlCommand) -> None:
        """Apply ``command`` to the set of held pauses (``P pauses``: pause id → Unix time it expires), persist
        it as the last one, then broadcast it to every gateway replica (which re-read :meth:`pauses`)."""
        body = command.model_dump_json()
        pipe = self.r.pipeline(transaction=True)
        if command.cmd == "pause":
            pipe.hset(self.key("pauses"), command.id, repr(command.expires_at or time.time() + 3600.0))
        elif command.release_all:
            pipe.delete(self.key("pauses"))
        elif command.release is not None:
            pipe.hdel(self.key("pauses"), command.release)
        pipe.set(self.key("control:last"), body)
        policy = command.policy()
        if policy is not None:
            pipe.set(self.key("policy"), policy.model_dump_json())
        await pipe.execute()
        # After the transaction, not in it (a cluster transaction holds one slot's keys; PUBLISH has none):
        # a replica that misses the message reads ``control:last`` when it (re)subscribes.
        await self.r.publish(self.key("control"), body)

    async def subscribe_control(self) -> aioredis.client.PubSub:
        """A pub/sub connection subscribed to ``P {E}:control`` (close it with ``aclose()``).

        On a cluster the channel is served by any node (PUBLISH reaches every node); the slot map is loaded
        first (redis-py's cluster pub/sub needs it). Raises Redis connection errors.
        """
        if self.cluster:
            await self.r.initialize()
        pubsub = self.r.pubsub()
        pubsub.__class__ = _ClusterPubSub if self.cluster else _PubSub  # (see _PubSub)
        try:
            await pubsub.subscribe(self.key("control"))
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def pauses(self) -> dict[str, float]:
        """The pauses held now: pause id → Unix time (s) it expires; expired ones are dropped on the way."""
        raw = await self.r.hgetall(self.key("pauses"))
        now = time.time()
        held = {}
        for k, v in raw.items():  # an entry this version cannot read (a hand's: "soon", inf, a key not UTF-8) is
            try:  # left out: it broke the gateway's control loop, so that no pause was ever applied (round 23)
                expiry = float(v)
                if math.isfinite(expiry):
                    held[k.decode()] = expiry
            except (ValueError, UnicodeDecodeError):
                continue
        expired = [k for k, t in held.items() if t <= now]
        if expired:
            await self.r.hdel(self.key("pauses"), *expired)
        return {k: t for k, t in held.items() if t > now}

    async def last_control(self) -> ControlCommand | None:
        raw = await self.r.get(self.key("control:last"))
        return _parsed(ControlCommand, raw, "the last control command") if raw else None

    async def claim_replica(self, replica_id: str, owner: str) -> bool:
        """Take replica id ``replica_id`` for the process whose token is ``owner`` (``SET NX``: of two gateways
        starting under one id, one gets it). ``True`` if it is ``owner``'s now (or was already); ``False`` while
        another process owns it: its ownership lapses :data:`REPLICA_LATE_S` after that one's last heartbeat (as
        long as a drain waits for a late replica: one whose event loop was starved must not find its id taken)."""
        key = self.key("replica-owner", replica_id)
        if await self.r.set(key, owner, nx=True, px=int(REPLICA_LATE_S * 1000)):
            return True
        held = await self.r.get(key)
        return held is not None and held.decode() == owner

    async def heartbeat(self, status: ReplicaStatus, owner: str | None = None) -> bool:
        """Write the replica's status and register it in ``P replicas`` (a zset scored by the Unix time its
        membership expires, :data:`REPLICA_LATE_S` after this heartbeat), in one round trip. With ``owner`` (the
        token of :meth:`claim_replica`) its ownership is renewed in the same step, and nothing is written if
        another process owns the id: returns ``False`` then, ``True`` otherwise."""
        status.updated_at = time.time()
        rid = status.replica_id
        if owner is not None:
            return bool(await self._heartbeat_script(
                keys=[self.key("replica-owner", rid), self.key("replica", rid), self.key("replicas")],
                args=[owner, int(REPLICA_LATE_S * 1000), status.model_dump_json(), REPLICA_LATE_S,
                      status.updated_at + REPLICA_LATE_S, rid]))
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.key("replica", rid), status.model_dump_json(), ex=REPLICA_LATE_S)
        pipe.zadd(self.key("replicas"), {rid: status.updated_at + REPLICA_LATE_S})
        await pipe.execute()
        return True

    async def drop_replica(self, replica_id: str, owner: str = "") -> None:
        """Forget a replica at once (a clean shutdown): its status, its registry entry and its ownership, unless
        a process other than ``owner`` owns the id (then nothing; ``owner`` empty: whoever owns it)."""
        await self._drop_replica_script(
            keys=[self.key("replica-owner", replica_id), self.key("replica", replica_id), self.key("replicas")],
            args=[owner, replica_id])

    async def replicas(self, include_late: bool = False) -> list[ReplicaStatus]:
        """Gateway replicas from the ``P replicas`` registry (two round trips whatever the keyspace holds;
        expired entries are pruned on the way).

        By default only *live* ones (last heartbeat younger than :data:`REPLICA_TTL_S`); with ``include_late``
        also those whose heartbeat is late but younger than :data:`REPLICA_LATE_S` (every member: what a
        drain must wait for). ``updated_at`` tells them apart.
        """
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zremrangebyscore(self.key("replicas"), "-inf", now)
        pipe.zrange(self.key("replicas"), 0, -1)
        ids = [i.decode() for i in (await pipe.execute())[1]]
        if not ids:
            return []
        raws = await self.r.mget([self.key("replica", rid) for rid in ids])
        out = [_parsed(ReplicaStatus, raw, f"the heartbeat of replica {rid!r}") for rid, raw in zip(ids, raws) if raw]
        return out if include_late else [r for r in out if now - r.updated_at < REPLICA_TTL_S]

    async def replica(self, replica_id: str) -> ReplicaStatus | None:
        """The last heartbeat of replica ``replica_id`` (live or late), or ``None`` if it has none."""
        raw = await self.r.get(self.key("replica", replica_id))
        return _parsed(ReplicaStatus, raw, f"the heartbeat of replica {replica_id!r}") if raw else None

    # ---------------------------------------------------------------- controller claims, leases, retries
    # Two more keys, used by the controller only:
    #   ``P processing:{cid}`` (list): rollout ids controller ``cid`` claimed and has not finished yet;
    #   ``P controller:{cid}`` (string): that controller's lease (``"{owner token} {Unix time}"`` of its last renewal,
    #   or the time alone when set without an owner), expiring ``ttl_s`` after its last renewal.
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

    async def renew_lease(self, controller_id: str, ttl_s: float, owner: str | None = None) -> bool:
        """(Re)set the controller's lease so that it expires ``ttl_s`` seconds from now, and register the
        controller in ``P controllers`` (a set: every controller that may own a processing list).

        With ``owner`` (a token of the process: a controller's own), the lease is taken or renewed only if nobody
        holds it or ``owner`` does, in one step (of two controllers starting under one id at once, one gets it);
        returns whether it is ``owner``'s now. Without, it is set whoever holds it (``True``)."""
        ttl_ms = max(1, int(ttl_s * 1000))
        if owner is not None:
            return bool(await self._owned_lease_script(keys=[self.key("controller", controller_id),
                                                             self.key("controllers")],
                                                       args=[owner, str(time.time()), ttl_ms, controller_id]))
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.key("controller", controller_id), str(time.time()), px=ttl_ms)
        pipe.sadd(self.key("controllers"), controller_id)
        await pipe.execute()
        return True

    async def hold_trainer(self, owner: str, run: str, ttl_s: float = TRAINER_LEASE_S) -> str | None:
        """Take or renew the prefix's trainer lease for run ``run`` of the process whose token is ``owner`` (one step:
        of two trainers starting at once, one gets it): one trainer per prefix, as the prefix has one policy, one
        control channel and one consumer group per run. Returns ``None`` if it is ``owner``'s now, else the run id
        of the trainer that holds it."""
        if await self._owned_lease_script(keys=[self.key("trainer")], args=[owner, run, max(1, int(ttl_s * 1000)), ""]):
            return None
        holder = await self.trainer_of()
        return holder[0] if holder else "(one whose lease just lapsed)"

    async def trainer_of(self) -> tuple[str, float] | None:
        """``(run id, seconds until its lease expires)`` of the trainer holding the prefix, or None."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.key("trainer"))
        pipe.pttl(self.key("trainer"))
        raw, pttl = await pipe.execute()
        if raw is None or pttl < 0:
            return None
        return printable(raw.decode(errors="replace").partition(" ")[2]), pttl / 1000  # (a hand's bytes: shown, round 23)

    async def let_go_trainer(self, owner: str) -> None:
        """End ``owner``'s trainer lease of the prefix (a run's end); another process's lease is left alone."""
        await self._drop_owned_lease_script(keys=[self.key("trainer")], args=[owner])

    async def lease_of(self, controller_id: str) -> tuple[str, float] | None:
        """The controller's lease: ``(its last renewal's Unix time as text, seconds until it expires)``, or None
        once it expired."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.key("controller", controller_id))
        pipe.pttl(self.key("controller", controller_id))
        raw, pttl = await pipe.execute()
        return None if raw is None or pttl < 0 else (raw.decode(), pttl / 1000)

    async def drop_lease(self, controller_id: str, owner: str | None = None) -> None:
        """Delete the controller's lease at once (a clean exit): its leftover claims can be adopted. With ``owner``,
        only if ``owner`` holds it (:meth:`renew_lease`): never another process's lease of the same id."""
        if owner is None:
            await self.r.delete(self.key("controller", controller_id))
        else:
            await self._drop_owned_lease_script(keys=[self.key("controller", controller_id)], args=[owner])

    async def live_controllers(self) -> list[str]:
        """Ids of the registered controllers whose lease is alive (sorted; from the ``P controllers`` registry)."""
        ids = sorted(i.decode() for i in await self.r.smembers(self.key("controllers")))
        if not ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for cid in ids:  # EXISTS each (a cluster pipeline refuses a multi-key EXISTS)
            pipe.exists(self.key("controller", cid))
        return [cid for cid, n in zip(ids, await pipe.execute()) if n]

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
        for cid in ids:  # GET each (a cluster pipeline refuses MGET)
            pipe.get(self.key("controller", cid))
        res = await pipe.execute()
        has_list, alive = res[: len(ids)], res[len(ids):]
        gone = [cid for cid, n, raw in zip(ids, has_list, alive) if not n and raw is None]
        if gone:
            await self.r.srem(self.key("controllers"), *gone)
        return {cid: raw is not None for cid, n, raw in zip(ids, has_list, alive) if n}

    async def retry_attempt(self, rollout_id: str, attempt_id: str, enqueue: bool = False,
                            running_only: bool = False,
                            check: Callable[[Rollout], None] | None = None) -> Rollout:
        """Start a new attempt: ``running | failed → queuing`` with ``attempt_id + 1``, reward and times cleared.

        The old attempt is fenced from then on (the gateway answers 409 to its calls and rewards).
        Raises ``ValueError`` if ``attempt_id`` is no longer the current attempt (someone else retried it
        first) or the rollout is neither running nor failed (with ``running_only``, not running: what a controller
        retrying its own attempt asks, in the same transaction as the change: a rollout another controller ended
        meanwhile stays ended), and :class:`RolloutNotFound`. ``enqueue``: also push the id onto the queue (a
        manual retry). ``check``: called first on the rollout as stored, in the same transaction; what it raises
        aborts the retry (nothing is written) and reaches the caller.
        """
        allowed = (RolloutStatus.running,) if running_only else (RolloutStatus.running, RolloutStatus.failed)

        def change(r: Rollout) -> None:
            if check is not None:
                check(r)
            if r.attempt_id != attempt_id:
                raise ValueError(f"attempt {attempt_id} of {rollout_id!r} is stale (current: {r.attempt_id})")
            if r.status not in allowed:
                raise ValueError(f"rollout {rollout_id!r} is {r.status.value}: only "
                                 f"{' or '.join(a.value for a in allowed)} can be retried")
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
