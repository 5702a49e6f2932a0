"""The fake vLLM of the benchmarks: a raw ``asyncio.Protocol`` HTTP/1.1 keep-alive server, never the bottleneck.

Every ``POST /v1/chat/completions`` (and ``/v1/completions``) is answered with one fixed, vLLM-shaped body
(``prompt_token_ids``, ``choices[0].token_ids``, ``choices[0].logprobs.content``, ``usage``, and vLLM 0.x's
null fields), built once at start-up by the tests' fake engine (``tests/fakes.py``: ``chat_answer``,
``completion_answer``, ``models_answer``; only the transport is this file's); ``GET /v1/models`` lists one
model. The request body is consumed by its ``Content-Length`` and not parsed (requests may be pipelined).
A chunked request body is refused with 411.

    python bench/fake_upstream.py --port 8000 [--prompt-tokens 256] [--completion-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes import chat_answer, completion_answer, models_answer  # noqa: E402  (the one fake engine's bodies)

MODEL = "bench-model"
MAX_HEAD = 64 * 1024


def chat_body(prompt_tokens: int, completion_tokens: int) -> bytes:
    """A vLLM 0.x chat completion with ``return_token_ids`` and ``logprobs`` on (no top logprobs)."""
    words = [f" w{k}" for k in range(completion_tokens)]
    body = chat_answer(MODEL, [100 + (13 * k) % 30000 for k in range(prompt_tokens)],
                       [1000 + (7 * k) % 30000 for k in range(completion_tokens)], "".join(words).lstrip(),
                       tokens=words, full=True)
    return json.dumps(body, separators=(",", ":")).encode()


def completion_body(prompt_tokens: int, completion_tokens: int) -> bytes:
    body = completion_answer(MODEL, [100 + k for k in range(prompt_tokens)],
                             [1000 + (7 * k) % 30000 for k in range(completion_tokens)], " x" * completion_tokens,
                             tokens=[" x"] * completion_tokens, full=True)
    return json.dumps(body, separators=(",", ":")).encode()


def response(status: str, body: bytes, close: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            + ("connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + body


class Upstream(asyncio.Protocol):
    """One keep-alive connection: split the byte stream into requests, answer each from a table."""

    answers: ClassVar[dict[tuple[bytes, bytes], bytes]] = {}
    not_found = response("404 Not Found", b'{"error":{"message":"not found"}}')
    served = 0

    def connection_made(self, transport):  # type: ignore[override]
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail(b"431 Request Header Fields Too Large")
                break
            head = bytes(buf[:end]).lower()
            line_end = head.find(b"\r\n")
            request_line = head[:line_end if line_end >= 0 else len(head)].split(b" ")
            length = 0
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17:j if j >= 0 else len(head)])
            elif b"\r\ntransfer-encoding:" in head:
                self._fail(b"411 Length Required")
                return
            total = end + 4 + length
            if len(buf) < total:
                break
            del buf[:total]
            method, path = request_line[0], request_line[1] if len(request_line) > 1 else b"/"
            path = path.split(b"?", 1)[0]
            out.append(self.answers.get((method, path), self.not_found))
            Upstream.served += 1
            if b"\r\nconnection: close" in head:
                self.transport.write(b"".join(out))
                self.transport.close()
                return
        if out:
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _fail(self, status: bytes) -> None:
        self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()


def configure(prompt_tokens: int, completion_tokens: int) -> None:
    models = json.dumps(models_answer(MODEL, full=True)).encode()
    Upstream.answers = {
        (b"post", b"/v1/chat/completions"): response("200 OK", chat_body(prompt_tokens, completion_tokens)),
        (b"post", b"/v1/completions"): response("200 OK", completion_body(prompt_tokens, completion_tokens)),
        (b"get", b"/v1/models"): response("200 OK", models),
        (b"get", b"/health"): response("200 OK", b"{}"),
    }


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, host, port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"fake upstream ready on {host}:{port} (pid {os.getpid()})", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--completion-tokens", type=int, default=32)
    args = ap.parse_args()
    configure(args.prompt_tokens, args.completion_tokens)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.port))
    else:
        uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
