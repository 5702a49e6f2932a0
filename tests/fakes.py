"""A small fake OpenAI/vLLM upstream and a helper that serves ASGI apps over real HTTP in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """Run an ASGI app with uvicorn on a free loopback port in a background thread."""

    def __init__(self, app):
        self.port = free_port()
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
    """vLLM-shaped answers: prompt ids = one id per message char count, response ids [7, 8, 9, 2]."""
    app = FastAPI()
    app.state.calls = []

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
        prompt = [1] + [len(str(m.get("content", ""))) for m in body.get("messages", [])]
        ids = [7, 8, 9, 2]
        return {
            "id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model"),
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "the answer is 7"},
                         "finish_reason": "stop", "token_ids": ids,
                         "logprobs": {"content": [{"token": str(t), "logprob": -0.1 * (k + 1)}
                                                  for k, t in enumerate(ids)]} if body.get("logprobs") else None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + 4},
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        return {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": " 7", "finish_reason": "stop", "token_ids": [5, 2],
                             "prompt_token_ids": [1, 2, 3],
                             "logprobs": {"tokens": ["5", "2"], "token_logprobs": [-0.5, -0.25]}}]}

    return app
