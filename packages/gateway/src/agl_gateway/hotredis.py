"""The two Redis commands of every model call (rollout ``GET``, record script), on a lean pipelined client.

redis-py's asyncio client costs ~110 µs of CPU per command (pool lock, retry wrapper, timeouts,
observability hooks, command packing); a call makes two. Here one TCP connection per gateway carries
every hot command, pipelined: each command is one ``transport.write`` and one future resolved in order by
a small RESP2 parser (~10 µs per command). Everything else (rollout creation, control channel,
heartbeat) stays on :class:`agl_common.store.Store`.

Failures keep redis-py's exception types, so callers map them as before (503 ``store_unavailable``):
``ConnectionError`` (cannot connect, or the connection dropped with the command in flight: not retried,
so a record is never written twice), ``TimeoutError`` (no reply within ``timeout_s``; the connection is
dropped), ``ResponseError`` (an error reply). The next command reconnects. Only ``redis://`` URLs (host,
port, db, user, password) are handled here; for any other (``rediss://``, ``unix://``) :func:`hot_store`
falls back to the store's own methods.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from agl_common.schemas import CallRecord, Rollout
from agl_common.store import _RECORD_CALL, RolloutNotFound, Store
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

_NIL = object()


def _pack(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    """One connection: commands go out in order, replies resolve the oldest pending future."""

    def __init__(self, on_lost) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque = collections.deque()  # (future, monotonic send time)
        self.buf = bytearray()
        self.closed = False
        self.on_lost = on_lost

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, packed: bytes) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((fut, time.monotonic()))
        self.transport.write(packed)
        return fut

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while self.pending:
                parsed = _parse(buf, pos)
                if parsed is None:
                    break
                value, pos = parsed
                fut = self.pending.popleft()[0]
                if not fut.done():
                    if isinstance(value, ResponseError):
                        fut.set_exception(value)
                    else:
                        fut.set_result(value)
        except ValueError:  # not RESP: the stream can no longer be trusted
            self.abort(ConnectionError("protocol error reading from Redis"))
            return
        if pos:
            del buf[:pos]

    def abort(self, exc: Exception) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.fail(exc)

    def fail(self, exc: Exception) -> None:
        self.closed = True
        while self.pending:
            fut = self.pending.popleft()[0]
            if not fut.done():
                fut.set_exception(exc)
        self.on_lost(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"Redis connection lost: {exc or 'closed by server'}"))


def _parse(buf: bytearray, pos: int) -> tuple[Any, int] | None:
    """One RESP2 value at ``pos``: ``(value, next_pos)``, or None if incomplete. Nil is ``None``."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line = buf[pos], bytes(buf[pos + 1:end])
    nxt = end + 2
    if kind == 0x24:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, nxt
        if len(buf) < nxt + n + 2:
            return None
        return bytes(buf[nxt:nxt + n]), nxt + n + 2
    if kind == 0x3A:  # : integer
        return int(line), nxt
    if kind == 0x2B:  # + simple string
        return line, nxt
    if kind == 0x2D:  # - error
        return ResponseError(line.decode("utf-8", "replace")), nxt
    if kind == 0x2A:  # * array
        n = int(line)
        if n < 0:
            return None, nxt
        items = []
        for _ in range(n):
            parsed = _parse(buf, nxt)
            if parsed is None:
                return None
            item, nxt = parsed
            items.append(item)
        return items, nxt
    raise ValueError(f"unexpected RESP type byte {kind!r}")


class HotRedis:
    """A pipelined client for a few non-blocking commands over one connection (reconnects on demand)."""

    def __init__(self, host: str, port: int, db: int = 0, username: str | None = None,
                 password: str | None = None, connect_timeout_s: float = 2.0, timeout_s: float = 10.0):
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s
        self.proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> HotRedis | None:
        """A client for a ``redis://`` URL, or None for a URL this client does not handle."""
        u = urlsplit(url)
        if u.scheme != "redis" or u.query or not u.hostname:
            return None
        path = u.path.lstrip("/")
        if path and not path.isdigit():
            return None
        return cls(u.hostname, u.port or 6379, int(path or 0), unquote(u.username) if u.username else None,
                   unquote(u.password) if u.password else None, **kw)

    def _lost(self, proto: _Protocol) -> None:
        if self.proto is proto:
            self.proto = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        proto = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(lambda: _Protocol(self._lost), self.host, self.port)
                setup = []
                if self.password is not None:
                    auth = [b"AUTH"] + ([self.username.encode()] if self.username else []) + [self.password.encode()]
                    setup.append(proto.send(_pack(*auth)))
                if self.db:
                    setup.append(proto.send(_pack(b"SELECT", str(self.db).encode())))
                for fut in setup:
                    await fut
        except (OSError, TimeoutError, ResponseError, ConnectionError) as exc:
            if proto is not None:
                proto.abort(ConnectionError("connection setup failed"))
            raise ConnectionError(f"cannot connect to Redis at {self.host}:{self.port}: {type(exc).__name__}: {exc}") from None
        if self._watchdog is None:
            self._watchdog = loop.call_later(1.0, self._watch)
        self.proto = proto  # here, not by the awaiting caller: a caller cancelled meanwhile leaks nothing
        return proto

    def _watch(self) -> None:
        """Once a second: drop the connection if its oldest command waited over ``timeout_s``."""
        proto = self.proto
        if proto is not None and proto.pending and time.monotonic() - proto.pending[0][1] > self.timeout_s:
            proto.abort(TimeoutError(f"no reply from Redis within {self.timeout_s:g} s"))
        self._watchdog = asyncio.get_running_loop().call_later(1.0, self._watch)

    async def _proto(self) -> _Protocol:
        proto = self.proto
        if proto is not None and not proto.closed:
            return proto
        if self._connecting is None:  # one connection attempt shared by every caller waiting for it
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, task: asyncio.Future) -> None:
        self._connecting = None
        if not task.cancelled():
            task.exception()  # retrieved (the callers re-raise it), so asyncio logs nothing

    async def execute(self, *args: bytes) -> Any:
        proto = self.proto
        if proto is None or proto.closed:
            proto = await self._proto()
        return await proto.send(_pack(*args))

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
            self.proto = None


_RECORD_SHA = hashlib.sha1(_RECORD_CALL.encode()).hexdigest().encode()
_RECORD_SCRIPT = _RECORD_CALL.encode()


class HotStore:
    """The hot path's view of the store: rollout lookup and record write (see the module docstring)."""

    def __init__(self, store: Store, client: HotRedis | None):
        self.store, self.client = store, client
        self.prefix = store.prefix.encode()

    async def get_rollout(self, rollout_id: str) -> Rollout:
        if self.client is None:
            return await self.store.get_rollout(rollout_id)
        raw = await self.client.execute(b"GET", self.prefix + b"rollout:" + rollout_id.encode())
        if raw is None:
            raise RolloutNotFound(rollout_id)
        return Rollout.model_validate_json(raw)

    async def record_json(self, rollout_id: str, attempt_id: str, record: bytes) -> int:
        """Append a record (JSON with ``"seq":-1`` as its third field) with the attempt's next ``seq``."""
        if self.client is None:
            return (await self.store.record_call(CallRecord.model_validate_json(record))).seq
        rid = rollout_id.encode()
        keys = (self.prefix + b"seq:" + rid + b":" + attempt_id.encode(), self.prefix + b"calls:" + rid)
        try:
            return await self.client.execute(b"EVALSHA", _RECORD_SHA, b"2", *keys, record)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.client.execute(b"EVAL", _RECORD_SCRIPT, b"2", *keys, record)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def hot_store(store: Store) -> HotStore:
    return HotStore(store, HotRedis.from_url(store.redis_url))
