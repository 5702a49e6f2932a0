"""A lean HTTP/1.1 client for the one request every model call makes: POST JSON, read the whole answer.

aiohttp costs ~100 µs of CPU per request (headers multidicts, cookie jar, tracing hooks, timers, stream
readers); this ~40, system calls included (a loop of requests to bench/fake_upstream.py): one
``transport.write`` of the request, httptools (C) to parse the answer, a keep-alive pool per engine. Streams, ``/tokenize`` and ``/models`` stay on aiohttp. Only
``http://`` engines; :func:`make_client` returns None for others and the caller keeps aiohttp.

Semantics kept from the aiohttp session it replaces: a total timeout per request (``TimeoutError``, also
when connecting takes over ``connect_timeout_s``), :class:`ConnectFailed` when no connection could be
made (nothing was sent: another engine may be tried), :class:`UpstreamBroken` when the connection broke
or the answer was not HTTP; idle connections are dropped after ``keepalive_s`` (under the engines' own
keep-alive, so a connection the engine is closing is not reused), at most ``limit`` connections (callers
wait beyond); gzip/deflate answers are decompressed.
"""

from __future__ import annotations

import asyncio
import collections
import time
import zlib
from urllib.parse import urlsplit

import httptools


class ConnectFailed(OSError):
    """No connection to the engine (nothing was sent)."""


class UpstreamBroken(Exception):
    """The connection broke before a whole answer arrived, or the answer was not HTTP/1.1."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: collections.deque) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.fut: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self.body: list[bytes] = []
        self.encoding = b""
        self.until_eof = False  # the answer has neither Content-Length nor chunked encoding
        self._framed = True

    def connection_made(self, transport) -> None:
        self.transport = transport

    def request(self, data: bytes) -> asyncio.Future:
        self.fut = asyncio.get_running_loop().create_future()
        self.body, self.encoding, self.until_eof = [], b"", False
        self.transport.write(data)
        return self.fut

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-encoding":
            self.encoding = value.strip().lower()
        elif name in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.until_eof = self.parser.get_status_code() >= 200 and not self._framed

    def on_message_begin(self) -> None:
        self._framed = False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        fut, self.fut = self.fut, None
        keep = self.parser.should_keep_alive()
        if fut is not None and not fut.done():
            fut.set_result((self.parser.get_status_code(), b"".join(self.body), self.encoding))
        if not keep:
            self.close()

    def data_received(self, data: bytes) -> None:
        if self.fut is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamBroken(f"malformed HTTP answer: {exc}"))

    def fail(self, exc: Exception) -> None:
        fut, self.fut = self.fut, None
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        fut = self.fut
        if fut is not None and self.until_eof and not fut.done():  # an answer that ends with the connection
            self.fut = None
            fut.set_result((self.parser.get_status_code(), b"".join(self.body), self.encoding))
        elif fut is not None:
            self.fail(UpstreamBroken("server disconnected"))
        try:
            self.pool.remove(self)
        except ValueError:
            pass


class UpstreamClient:
    """POST a JSON body and read the answer, over keep-alive connections pooled per ``host:port``."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 5.0, keepalive_s: float = 2.0,
                 limit: int = 1024):
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self.limit = asyncio.Semaphore(limit)
        self.pools: dict[tuple[str, int], collections.deque] = {}
        self.targets: dict[str, tuple[str, int, bytes, bytes]] = {}
        self.all: set[_Conn] = set()

    def _target(self, url: str) -> tuple[str, int, bytes, bytes]:
        t = self.targets.get(url)
        if t is None:
            u = urlsplit(url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"not an http:// URL: {url!r}")
            port = u.port or 80
            host_header = u.hostname if port == 80 else f"{u.hostname}:{port}"
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            t = self.targets[url] = (u.hostname, port, path.encode(), host_header.encode())
        return t

    async def _connect(self, host: str, port: int, pool: collections.deque) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(pool), host, port),
                                             self.connect_timeout_s)
        except TimeoutError:  # (an OSError too): a timeout, as aiohttp's connect timeout was (504)
            raise
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        self.all.add(conn)
        return conn

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of ``POST url`` with a JSON ``body``. Raises ``TimeoutError``,
        :class:`ConnectFailed` or :class:`UpstreamBroken`."""
        host, port, path, host_header = self._target(url)
        pool = self.pools.get((host, port))
        if pool is None:
            pool = self.pools[(host, port)] = collections.deque()
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
            path, host_header, len(body))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        async with self.limit:
            conn = None
            now = time.monotonic()
            while pool:  # the most recently used connection first; stale ones are closed
                c = pool.pop()
                if not c.closed and now - c.idle_since < self.keepalive_s:
                    conn = c
                    break
                c.close()
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._connect(host, port, pool)
            fut = conn.request(head + body)
            timer = loop.call_at(deadline, conn.fail, TimeoutError("upstream engine timed out"))
            try:
                status, content, encoding = await fut
            except BaseException:
                conn.close()  # cancelled or failed mid-answer: the connection is unusable
                self.all.discard(conn)
                raise
            finally:
                timer.cancel()
            if conn.closed:
                self.all.discard(conn)
            else:
                conn.idle_since = time.monotonic()
                pool.append(conn)
        if encoding in (b"gzip", b"deflate"):
            try:
                content = zlib.decompress(content, 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS)
            except zlib.error as exc:
                raise UpstreamBroken(f"answer not decodable as {encoding.decode()}: {exc}") from None
        return status, content

    async def close(self) -> None:
        for conn in list(self.all):
            conn.close()
        self.all.clear()
        self.pools.clear()


def make_client(upstreams: list[str], timeout_s: float) -> UpstreamClient | None:
    """A client for the engines if they are all ``http://``, else None (aiohttp handles them)."""
    if not all(urlsplit(u).scheme == "http" for u in upstreams):
        return None
    return UpstreamClient(timeout_s)
