"""A small fake OpenAI/vLLM upstream and a helper that serves ASGI apps over real HTTP in a thread.

Also a stand-in engine for trying the gateway without a model (README, "Pointing any agent at the gateway"):

    .venv/bin/python tests/fakes.py --port 8000

serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on 127.0.0.1 with vLLM's extra fields
(``prompt_token_ids``, ``token_ids``, logprobs): every answer is "the answer is 7", response ids [7, 8, 9, 2].
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """Run an ASGI app with uvicorn on a free loopback port in a background thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def fake_upstream() -> FastAPI:
    """vLLM-shaped answers: prompt ids = one id per message char count, response ids [7, 8, 9, 2].

    Knobs in the request body: ``x_delay`` (seconds, before the answer or after each stream chunk),
    ``x_fail`` (``"garbage"``/``"null"``), ``x_status`` (answer that HTTP status with a vLLM-shaped error),
    ``x_short_ids`` (token ids shorter than ``usage.completion_tokens``, as tool-call parsing can give).
    ``app.state.abort_next``: how many of the next calls end with ``finish_reason: "abort"`` (a weight update).
    """
    app = FastAPI()
    app.state.calls = []
    app.state.abort_next = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        if body.get("x_delay"):
            await asyncio.sleep(float(body["x_delay"]))
        if body.get("x_fail"):
            return {"garbage": True} if body["x_fail"] == "garbage" else None
        if body.get("x_status"):
            status = int(body["x_status"])
            return JSONResponse({"error": {"message": f"engine refused: status {status}", "type": "BadRequestError",
                                           "param": None, "code": status}}, status_code=status)
        prompt = [1] + [len(str(m.get("content", ""))) for m in body.get("messages", [])]
        ids = [7, 8, 9, 2]
        finish = "stop"
        if app.state.abort_next > 0:
            app.state.abort_next -= 1
            finish = "abort"
        if body.get("stream"):
            return StreamingResponse(_stream(body, prompt, ids, finish), media_type="text/event-stream")
        if body.get("tools") and body.get("x_tool"):
            return _tool_answer(body, prompt)
        got = ids[:2] if body.get("x_short_ids") else ids
        return {
            "id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model"),
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "the answer is 7"},
                         "finish_reason": finish, "token_ids": got,
                         "logprobs": {"content": [{"token": str(t), "logprob": -0.1 * (k + 1)}
                                                  for k, t in enumerate(got)]} if body.get("logprobs") else None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + 4},
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        return {"count": 10 * len(body.get("messages", [])) + len(body.get("tools", [])), "tokens": []}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        return {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": " 7", "finish_reason": "stop", "token_ids": [5, 2],
                             "prompt_token_ids": [1, 2, 3],
                             "logprobs": {"tokens": ["5", "2"], "token_logprobs": [-0.5, -0.25]}}]}

    return app


PIECES = ["the ", "answer ", "is 7", ""]


async def _stream(body, prompt, ids, finish="stop"):
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": body.get("model")}
    yield b"data: " + orjson.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}],
                                    "prompt_token_ids": prompt}) + b"\n\n"
    if finish == "abort":  # aborted before its first token (held in the engine's queue by a weight update)
        yield b"data: " + orjson.dumps({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                            "finish_reason": "abort", "token_ids": []}]}) + b"\n\n"
        yield b"data: [DONE]\n\n"
        return
    n = len(ids) - int(bool(body.get("x_drop_ids")))
    for k, (piece, tid) in enumerate(zip(PIECES, ids)):
        yield b"data: " + orjson.dumps({**base, "choices": [{
            "index": 0, "delta": {"content": piece},
            "logprobs": {"content": [{"token": piece, "logprob": -0.1 * (k + 1)}]} if k < n else None,
            "finish_reason": "stop" if k == len(ids) - 1 else None,
            "token_ids": [tid] if k < n else []}]}) + b"\n\n"
        if body.get("x_delay"):
            await asyncio.sleep(float(body["x_delay"]))
    yield b"data: " + orjson.dumps({**base, "choices": [], "usage": {"prompt_tokens": len(prompt),
                                                                    "completion_tokens": len(ids),
                                                                    "total_tokens": len(prompt) + len(ids)}}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _tool_answer(body, prompt):
    name = body["tools"][0]["function"]["name"]
    return {"id": "chatcmpl-tool", "object": "chat.completion", "created": 1, "model": body.get("model"),
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [11, 12, 2],
                         "logprobs": {"content": [{"token": "x", "logprob": -1.0}] * 3},
                         "message": {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": name, "arguments": "{\"a\": 3, \"b\": 4}"}}]}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A stand-in OpenAI/vLLM engine with canned answers (tests/fakes.py).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    a = parser.parse_args()
    uvicorn.run(fake_upstream(), host=a.host, port=a.port, log_level="warning")
