"""Live delivery of a streamed chat reply (``stream: true``): the pipeline's task relays, the response sends.

The call pipeline (:mod:`.pipeline`) runs in its own task and puts server-sent events on a
:class:`LiveRelay`; :class:`RelayResponse` sends them to the agent. What the engine streams is relayed
as it comes, except that

* events before the first token are held: an error until then is answered with its real status and
  body (not 200 plus an error event), and a stream aborted by a weight update before its first token
  is retried unseen;
* the event carrying the finish reason, the usage and ``[DONE]`` are held until the record is written
  (the record exists before the agent has the whole answer);
* an agent that goes away stops the relay; the pipeline records what was captured as abandoned.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp.http_exceptions import HttpProcessingError
from fastapi.responses import StreamingResponse

from .capture import StreamCapture
from .errors import ApiError
from .state import GatewayState
from .upstream import engine_call


def sse_error(err: ApiError) -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}}) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class LiveRelay:
    """Server-sent events of one live reply, from the pipeline's task to the agent's response.

    ``started`` resolves once the first event is queued, or raises the ``ApiError`` that ended the call
    before any event (answered with its own status). ``sent``: events queued so far. ``gone``: the agent
    closed the response before its end (then ``reader``, the task reading the engine, is cancelled).
    """

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent = 0
        self.gone = False
        self.delivered = False
        self.reader: asyncio.Task | None = None
        self._left = asyncio.Event()

    def send(self, event: bytes) -> None:
        self.queue.put_nowait(event)
        self.sent += 1
        if not self.started.done():
            self.started.set_result(None)

    def end(self, events: list[bytes] = ()) -> None:
        """Queue ``events`` and close the stream."""
        for e in events:
            self.send(e)
        self.queue.put_nowait(None)
        if not self.started.done():
            self.started.set_result(None)

    def fail(self, err: ApiError) -> None:
        """End with ``err``: as the answer's status if nothing was sent yet, else as a final error event."""
        if self.sent == 0 and not self.started.done():
            self.started.set_exception(err)
        else:
            self.end([sse_error(err)])

    def agent_gone(self) -> None:
        self.gone = True
        self._left.set()
        if self.reader is not None:
            self.reader.cancel()

    async def left(self) -> None:
        """Return once the agent went away (:meth:`agent_gone`)."""
        await self._left.wait()


class RelayResponse(StreamingResponse):
    """Sends a :class:`LiveRelay`'s events; however the response ends before the relay's last event (the
    agent disconnected, the server stopped), the relay learns the agent is gone."""

    def __init__(self, relay: LiveRelay, **kw: Any):
        super().__init__(self._events(relay), media_type="text/event-stream", **kw)
        self.relay = relay

    @staticmethod
    async def _events(relay: LiveRelay):
        while True:
            event = await relay.queue.get()
            if event is None:
                relay.delivered = True
                return
            yield event

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.relay.delivered:
                self.relay.agent_gone()


#: Longest line of an engine's stream, in bytes: vLLM sends every prompt token id in the first event
#: (~6 bytes an id): aiohttp's default line limit (twice its read buffer) failed long prompts' streams unrecorded.
STREAM_LINE_MAX = 64 * 1024 * 1024
#: Most bytes of one engine stream read (every event's JSON); beyond it the call is a 502.
STREAM_BYTES_MAX = 256 * 1024 * 1024


async def read_stream(st: GatewayState, rollout_id: str, path: str, payload: dict[str, Any],
                      sc: StreamCapture, relay: LiveRelay) -> list[bytes]:
    """Stream ``payload`` from the rollout's engine (:func:`engine_call`), capturing every chunk into
    ``sc`` and relaying it (see the module's rules); returns the events held back for after the record.

    Raises ``ApiError`` as :func:`engine_call` does, and 502 ``upstream_error`` for a malformed stream or
    one that ends without ``[DONE]``.
    """
    held: list[bytes] = []  # before the first token
    tail: list[bytes] | None = None  # from the finish reason on
    done = False
    read = 0
    async with engine_call(st, rollout_id, path, orjson.dumps(payload)) as resp:
        try:
            while raw := await resp.content.readline(max_line_length=STREAM_LINE_MAX):
                read += len(raw)
                if read > STREAM_BYTES_MAX:
                    raise ValueError(f"the stream exceeds {STREAM_BYTES_MAX} bytes")
                line = raw.decode("utf-8").rstrip("\r\n")  # (a complete answer is read strictly too: orjson)
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk, n_ids = sc.feed(orjson.loads(data))
                if chunk is None:
                    continue
                event = b"data: " + orjson.dumps(chunk) + b"\n\n"
                if tail is not None or sc.cap.finish_reason is not None:
                    tail = tail if tail is not None else []
                    tail.append(event)  # (a new list per event was quadratic: 160k empty closing deltas, 46 s)
                elif n_ids or relay.sent:
                    for e in held:
                        relay.send(e)
                    held.clear()
                    relay.send(event)
                else:
                    held.append(event)
        except (ValueError, TypeError, AttributeError, KeyError, HttpProcessingError) as exc:  # JSON errors,
            # MalformedUpstream, a line over STREAM_LINE_MAX (aiohttp's LineTooLong)...
            raise ApiError(502, f"upstream sent a malformed stream ({type(exc).__name__}: {exc})"[:500],
                           "server_error", "upstream_error") from None
    if not done:
        raise ApiError(502, "upstream stream ended before [DONE]", "server_error", "upstream_error")
    return held + (tail or [])
