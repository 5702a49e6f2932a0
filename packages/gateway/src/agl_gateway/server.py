"""uvicorn's httptools protocol with the request head (request line + headers) bounded.

httptools parses ~3x cheaper than h11 per request (bench/gateway.py: ~0.2 ms of CPU per call less), but
it buffers a request line or header of any size. Here the bytes received while a request's head is
incomplete are counted; past :data:`MAX_HEAD_BYTES` (plus at most one read) the connection gets
``431 Request Header Fields Too Large`` and is closed, as h11 with ``h11_max_incomplete_event_size``
did (it answered 400).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: Largest request line + headers accepted (h11's default bound, which the gateway used before).
MAX_HEAD_BYTES = 64 * 1024

_MSG = b"request line and headers are too long"
_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_MSG), _MSG))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` that refuses a request head over :data:`MAX_HEAD_BYTES` with a 431, and a
    chunked body's trailer section over the same bound.

    Two checks on the head: the parsed size (request target + header names and values) once the head is
    complete, exact like h11's; and the bytes received while a head is incomplete (a header still arriving),
    which bounds what httptools buffers to the limit plus one read. The trailer section (header lines after a
    chunked body's last, empty chunk) had no bound at all: httptools buffers a trailer line until it ends and
    uvicorn appended every trailer to the request's headers. The same two checks apply to it (bytes received
    after a chunk header with no body yet, counted from the next read; parsed size), and trailers are then
    dropped, as RFC 9110 section 6.5.1 lets a recipient do: nothing here reads them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests or inside a head: received bytes count
        self._head_bytes = 0  # bytes received since then
        self._in_chunk_head = False  # after a chunk's header, before its body (a trailer section, if the last)
        self._tail_bytes = 0  # bytes received since then, from the read after the chunk header
        self._tail_size = 0  # parsed size of the trailer lines so far
        self._too_large = False

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > MAX_HEAD_BYTES:
            self._too_large = True
            raise ValueError("request head too large")  # httptools: HttpParserCallbackError, then send_400
        super().on_headers_complete()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:
            return super().on_header(name, value)
        self._tail_size += len(name) + len(value) + 4  # a trailer: counted, then dropped
        if self._tail_size > MAX_HEAD_BYTES:
            self._too_large = True
            raise ValueError("trailer section too large")

    def on_chunk_header(self) -> None:
        self._in_chunk_head, self._tail_bytes = True, 0

    def on_body(self, body: bytes) -> None:
        self._in_chunk_head = False
        super().on_body(body)

    def on_chunk_complete(self) -> None:
        self._in_chunk_head = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0
        self._in_chunk_head, self._tail_bytes, self._tail_size = False, 0, 0

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            return super().send_400_response(msg)
        self._refuse()

    def _refuse(self) -> None:
        self.logger.warning("request head or trailer over %d bytes: 431, connection closed", MAX_HEAD_BYTES)
        if self.cycle is None or self.cycle.response_complete:  # (else an answer is being written)
            self.transport.write(_431)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        elif self._in_chunk_head:
            self._tail_bytes += len(data)
        super().data_received(data)
        over = (self._in_head and self._head_bytes > MAX_HEAD_BYTES) or \
            (self._in_chunk_head and self._tail_bytes > MAX_HEAD_BYTES)
        if over and not self.transport.is_closing():
            self._refuse()


class GatewayServer(uvicorn.Server):
    """uvicorn's server that, on SIGTERM/SIGINT, also closes the app's pause gate (:meth:`PauseGate.close`).

    uvicorn's graceful shutdown waits for every open request; a call held by a pause would keep the process
    alive until the pause ends or ``--max-hold`` (600 s) passes. With the gate closed, held calls are
    answered 503 ``shutting_down`` (``Retry-After: 1``) at once and in-flight calls finish normally.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        st = getattr(getattr(self.config.app, "state", None), "agl", None)
        if st is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing is held
                asyncio.get_running_loop().call_soon_threadsafe(st.gate.close)
        super().handle_exit(sig, frame)
