"""The one fake OpenAI/vLLM engine of the tests and benchmarks, and a helper that serves ASGI apps over real
HTTP in a thread.

Also a stand-in engine for trying the gateway without a model (README, "Pointing any agent at the gateway"):

    .venv/bin/python tests/fakes.py --port 8000

serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and ``/tokenize`` on 127.0.0.1 with vLLM's
extra fields (``prompt_token_ids``, ``token_ids``, logprobs): every answer is "the answer is 7", response ids
[7, 8, 9, 2].

Every vLLM-shaped body a fake sends is built here, once: :func:`chat_answer`, :func:`chat_chunks`,
:func:`completion_answer`, :func:`models_answer`, :func:`tokenize_answer`. :func:`fake_upstream` serves them
(FastAPI; its knobs are in its docstring); ``bench/fake_upstream.py`` serves the same bodies, built once at
start-up, from a raw asyncio server fast enough never to be a benchmark's bottleneck. Tests that need other
behaviour use a knob of :func:`fake_upstream` rather than a server of their own.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Callable

import orjson
import uvicorn
from agl_trainer.services import free_port  # noqa: F401 (tests import it from here)
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

#: the default answer: its text and token ids (2 is the end of sequence); a tool call's ids
TEXT = "the answer is 7"
IDS = [7, 8, 9, 2]
TOOL_IDS = [11, 12, 2]
DONE = b"data: [DONE]\n\n"
#: vLLM 0.x's fields that a plain fake leaves out (``full=True`` adds them, as a real engine sends them)
_VLLM_MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
                       "reasoning_content": None}
_VLLM_BODY_NULLS = {"service_tier": None, "system_fingerprint": None, "prompt_logprobs": None,
                    "kv_transfer_params": None}




class Served:
    """Run an ASGI app with uvicorn on a free loopback port in a background thread (``.app`` is the app).

    Entering waits until it serves (up to :attr:`START_S` s; a start-up that failed raises ``RuntimeError`` with
    the thread's exception: uvicorn's ``SystemExit(3)`` is a lifespan that raised, its traceback in the captured
    log). Leaving waits until it has stopped, lifespan shutdown included: a server still alive after :attr:`STOP_S`
    s raises ``RuntimeError`` there, naming its unfinished tasks, rather than leaving a thread that still serves,
    and still holds what it claimed in Redis (a gateway's replica id), to the next test or server (it had waited
    10 s, then gone on: a gateway that never stopped made a later test fail far from the cause)."""

    START_S = 40.0
    STOP_S = 40.0

    def __init__(self, app, port: int | None = None):
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"served-{self.port}")

    def _run(self) -> None:
        try:  # (uvicorn's Server.run, keeping the loop: a server that does not stop shows its tasks)
            with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
                self.loop = runner.get_loop()
                runner.run(self.server.serve())
        except BaseException as exc:  # SystemExit(3): the app's lifespan raised (uvicorn logged its traceback)
            self.error = exc

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + self.START_S
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start: {self.error!r} (uvicorn's log, in "
                                   "the captured stderr, has the cause)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start in {self.START_S:.0f} s")
            time.sleep(0.02)
        return self

    def __exit__(self, exc_type, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=self.STOP_S)
        if self.thread.is_alive() and exc_type is None:
            raise RuntimeError(f"server on port {self.port} did not stop in {self.STOP_S:.0f} s; its tasks:\n"
                               + self._tasks())

    def _tasks(self) -> str:
        """Each unfinished task of the server's loop and where it waits (read from another thread: a diagnosis)."""
        try:
            tasks = list(asyncio.all_tasks(self.loop))
        except RuntimeError as exc:  # the set changed while read
            return f"(unreadable: {exc})"
        return "\n".join(f"{t.get_name()} {t.get_coro()!r}: " + " <- ".join(
            f"{f.f_code.co_name} ({Path(f.f_code.co_filename).name}:{f.f_lineno})" for f in t.get_stack(limit=4))
            for t in tasks)


# ----------------------------------------------------------------------------------------- the bodies
def chat_logprob(k: int) -> float:
    """The logprob of the k-th sampled token of a chat answer."""
    return -0.1 * (k + 1)


def completion_logprob(k: int) -> float:
    """The logprob of the k-th sampled token of a completion answer."""
    return -0.5 / 2 ** k


def chat_answer(model, prompt: list[int], ids: list[int], message: dict | str = TEXT, finish: str | None = None,
                logprobs: bool = True, completion_tokens: int | None = None, tokens: list[str] | None = None,
                full: bool = False) -> dict:
    """A vLLM chat completion with ``return_token_ids`` on: ``prompt_token_ids``, ``choices[0].token_ids``,
    ``choices[0].logprobs.content`` (one entry per id, :func:`chat_logprob`; ``None`` without ``logprobs``) and
    ``usage``. ``message``: the answer's text, or the assistant message itself (e.g. with ``tool_calls``);
    ``finish``: ``"tool_calls"`` for a tool call, else ``"stop"``, unless given; ``completion_tokens``: what
    ``usage`` says (default ``len(ids)``); ``tokens``: the logprob entries' token texts (default ``str(id)``);
    ``full``: also vLLM 0.x's null and empty fields, ``created`` and each entry's ``bytes``/``top_logprobs``."""
    if isinstance(message, str):
        message = {"role": "assistant", "content": message}
    finish = finish or ("tool_calls" if message.get("tool_calls") else "stop")
    tokens = tokens or [str(t) for t in ids]
    content = [{"token": tok, "logprob": chat_logprob(k)} for k, tok in enumerate(tokens)]
    if full:
        message = {"role": "assistant", **_VLLM_MESSAGE_NULLS, **message}
        content = [{**c, "bytes": list(c["token"].encode()), "top_logprobs": []} for c in content]
    n = len(ids) if completion_tokens is None else completion_tokens
    choice = {"index": 0, "message": message, "logprobs": {"content": content} if logprobs else None,
              "finish_reason": finish, "token_ids": ids}
    body = {"id": "chatcmpl-fake", "object": "chat.completion", "model": model, "prompt_token_ids": prompt,
            "choices": [{**choice, "stop_reason": None} if full else choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}}
    if full:
        body["usage"]["prompt_tokens_details"] = None
        return {**body, "created": 1, **_VLLM_BODY_NULLS}
    return body


def stream_pieces(text: str, n: int) -> list[str]:
    """The text each of ``n`` streamed token ids carries: one word each, the rest of the text on the last but
    one, nothing on the last (the end of sequence). ``"the answer is 7"`` in 4: the, answer, is 7, ""."""
    if n < 2:
        return [text][:n]
    words = re.findall(r"\s*\S+\s*", text)
    head = words[:n - 2]
    return head + [""] * (n - 2 - len(head)) + ["".join(words[n - 2:]), ""]


def chat_chunks(model, prompt: list[int], ids: list[int], text: str = TEXT, finish: str = "stop",
                drop_ids: int = 0) -> list[bytes]:
    """A vLLM chat stream's ``data:`` events, ``[DONE]`` left out: the role chunk (with ``prompt_token_ids``),
    one chunk per token id (its :func:`stream_pieces` text, ``token_ids`` and logprob), a usage chunk.
    ``finish="abort"``: aborted before its first token (held in the engine's queue by a weight update).
    ``drop_ids``: that many last token chunks come without ``token_ids`` and logprobs."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": model}

    def event(obj) -> bytes:
        return b"data: " + orjson.dumps({**base, **obj}) + b"\n\n"

    out = [event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], "prompt_token_ids": prompt})]
    if finish == "abort":
        return out + [event({"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort",
                                          "token_ids": []}]})]
    n = len(ids) - drop_ids
    for k, (piece, tid) in enumerate(zip(stream_pieces(text, len(ids)), ids)):
        out.append(event({"choices": [{
            "index": 0, "delta": {"content": piece},
            "logprobs": {"content": [{"token": piece, "logprob": chat_logprob(k)}]} if k < n else None,
            "finish_reason": finish if k == len(ids) - 1 else None, "token_ids": [tid] if k < n else []}]}))
    return out + [event({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                                  "total_tokens": len(prompt) + len(ids)}})]


def completion_answer(model, prompt: list[int] = (1, 2, 3), ids: list[int] = (5, 2), text: str = " 7",
                      tokens: list[str] | None = None, full: bool = False) -> dict:
    """A vLLM text completion with token ids: ``choices[0].token_ids``/``prompt_token_ids``, logprobs
    (:func:`completion_logprob`) and ``usage``; ``full``: also ``created``."""
    ids, prompt = list(ids), list(prompt)
    body = {"id": "cmpl-fake", "object": "text_completion", "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
                         "prompt_token_ids": prompt,
                         "logprobs": {"tokens": tokens or [str(t) for t in ids],
                                      "token_logprobs": [completion_logprob(k) for k in range(len(ids))]}}]}
    body["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    if full:
        body.update(created=1)
    return body


def models_answer(model: str, full: bool = False) -> dict:
    """``GET /v1/models``: one model (``full``: with vLLM's ``owned_by`` and ``max_model_len``)."""
    entry = {"id": model, "object": "model"}
    return {"object": "list", "data": [{**entry, "owned_by": "vllm", "max_model_len": 32768} if full else entry]}


def tokenize_answer(body: dict) -> dict:
    """vLLM's ``POST /tokenize``: a count of 10 per message plus 1 per tool."""
    return {"count": 10 * len(body.get("messages", [])) + len(body.get("tools", [])), "tokens": []}


def error_answer(status: int) -> JSONResponse:
    """A vLLM-shaped error answer with that HTTP status."""
    return JSONResponse({"error": {"message": f"engine refused: status {status}", "type": "BadRequestError",
                                   "param": None, "code": status}}, status_code=status)


# ----------------------------------------------------------------------------------------- the engine
def prompt_lengths(body: dict) -> list[int]:
    """The default prompt ids: 1, then one id per message, the length of its content as text."""
    return [1] + [len(str(m.get("content", ""))) for m in body.get("messages", [])]


def default_ids(message: dict) -> list[int]:
    """The default answer ids: [11, 12, 2] for a tool call, else [7, 8, 9, 2]."""
    return TOOL_IDS if message.get("tool_calls") else IDS


def tool_call(name: str, arguments: dict, call_id: str = "call_1") -> dict:
    """An assistant message that calls tool ``name`` with ``arguments`` (for a ``reply`` function; the arguments
    as ``json.dumps`` writes them: ``{"a": 3, "b": 4}``)."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def default_reply(body: dict) -> dict | str:
    """"the answer is 7"; with ``x_tool`` and tools in a non-streamed request, a call of the first tool with
    ``{"a": 3, "b": 4}``."""
    if body.get("tools") and body.get("x_tool") and not body.get("stream"):
        return tool_call(body["tools"][0]["function"]["name"], {"a": 3, "b": 4})
    return TEXT


def fake_upstream(reply: str | Callable[[dict], dict | str] = default_reply,
                  prompt_ids: Callable[[dict], list[int]] = prompt_lengths,
                  reply_ids: Callable[[dict], list[int]] = default_ids, model: str = "fake-model") -> FastAPI:
    """A vLLM-shaped engine: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/tokenize``.

    What it answers (arguments):

    - ``reply``: the chat answer: a text, or a function of the request body that returns the text or the
      assistant message (a tool call: :func:`tool_call`; then ``finish_reason`` is ``"tool_calls"``).
      Default :func:`default_reply`.
    - ``prompt_ids``: the request body -> ``prompt_token_ids`` (default :func:`prompt_lengths`).
    - ``reply_ids``: the assistant message -> the answer's ``token_ids`` (default :func:`default_ids`).
    - ``model``: the model ``GET /v1/models`` lists.

    Knobs in a chat request body: ``x_delay`` (seconds, before the answer or after each stream chunk),
    ``x_fail`` (``"garbage"``/``"null"``), ``x_status`` (answer that HTTP status with a vLLM-shaped error),
    ``x_short_ids`` (token ids shorter than ``usage.completion_tokens``, as tool-call parsing can give),
    ``x_drop_ids`` (a stream's last chunk comes without its token id), ``x_stall`` (seconds before a stream
    starts), ``x_tool`` (see :func:`default_reply`).

    State, on ``app.state`` (set it, or read it):

    - ``abort_next``: how many of the next chat calls end with ``finish_reason: "abort"`` (a weight update);
    - ``plan``: while set, answers are scripted: ``("body", status, bytes)``: every model route and
      ``/tokenize`` answer these bytes with that status; ``("stream", [sse bytes], end)``: a streamed chat
      call sends these events, then ends per ``end``: ``"done"`` (``data: [DONE]``), ``"eof"`` (a clean end
      without it) or ``"cut"`` (the connection dropped);
    - ``calls``: the body of every model call (chat and completions), in arrival order;
    - ``arrivals`` / ``active``: each model call's arrival time (``time.time()``, before its body is read) and
      how many are in progress (until the answer is built: for a stream, until it starts); also over HTTP, as
      ``GET /x/arrivals`` and ``GET /x/active``, for a fake in a process of its own;
    - ``requests``: every request's headers (a list of pairs) and raw body, on every route.
    """
    app = FastAPI()
    st = app.state
    st.calls, st.arrivals, st.requests = [], [], []
    st.abort_next, st.active, st.plan = 0, 0, None

    async def read(request: Request) -> dict:
        raw = await request.body()
        st.requests.append((list(request.headers.items()), raw))
        return json.loads(raw) if raw else {}  # (stdlib: orjson refuses ints over 64 bits, which an agent may send)

    def planned() -> Response | None:
        plan = st.plan
        if plan and plan[0] == "body":
            return Response(plan[2], status_code=plan[1], media_type="application/json")
        return None

    @app.get("/v1/models")
    async def models(request: Request):
        await read(request)
        return models_answer(model)

    async def model_call(request: Request, answer):
        """Log the call's arrival, count it in progress, keep its body; ``answer(body)`` answers it."""
        st.arrivals.append(time.time())
        st.active += 1
        try:
            body = await read(request)
            st.calls.append(body)
            return await answer(body)
        finally:
            st.active -= 1

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await model_call(request, chat_reply)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await model_call(request, completion_reply)

    async def completion_reply(body: dict):
        return planned() or completion_answer(body.get("model"))

    async def chat_reply(body: dict):
        if (scripted := planned()) is not None:
            return scripted
        plan = st.plan
        if plan and plan[0] == "stream" and body.get("stream"):
            return StreamingResponse(_scripted_stream(*plan[1:]), media_type="text/event-stream")
        if body.get("x_delay"):
            await asyncio.sleep(float(body["x_delay"]))
        if body.get("x_fail"):
            return {"garbage": True} if body["x_fail"] == "garbage" else None
        if body.get("x_status"):
            return error_answer(int(body["x_status"]))
        prompt = prompt_ids(body)
        message = reply(body) if callable(reply) else reply
        if isinstance(message, str):
            message = {"role": "assistant", "content": message}
        ids = reply_ids(message)
        finish = None
        if st.abort_next > 0:
            st.abort_next -= 1
            finish = "abort"
        if body.get("stream"):
            if body.get("x_stall"):  # nothing at all for this long (a queue, a long prefill), then the stream
                await asyncio.sleep(float(body["x_stall"]))
            chunks = chat_chunks(body.get("model"), prompt, ids, message.get("content") or "", finish or "stop",
                                 drop_ids=int(bool(body.get("x_drop_ids"))))
            return StreamingResponse(_paced(chunks, float(body.get("x_delay") or 0)), media_type="text/event-stream")
        got = ids[:2] if body.get("x_short_ids") else ids
        return chat_answer(body.get("model"), prompt, got, message, finish, logprobs=bool(body.get("logprobs")),
                           completion_tokens=len(ids))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read(request)
        return planned() or tokenize_answer(body)

    @app.get("/x/arrivals")
    async def arrivals():
        return st.arrivals

    @app.get("/x/active")
    async def active():
        return st.active

    return app


async def _paced(chunks: list[bytes], delay: float):
    """The chunks, a pause of ``delay`` s after each token chunk, then ``[DONE]``."""
    for k, chunk in enumerate(chunks):
        yield chunk
        if delay and 0 < k < len(chunks) - 1:
            await asyncio.sleep(delay)
    yield DONE


async def _scripted_stream(chunks: list[bytes], end: str):
    for chunk in chunks:
        yield chunk
        await asyncio.sleep(0)
    if end == "done":
        yield DONE
    elif end == "cut":
        raise ConnectionResetError("upstream died mid-stream")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A stand-in OpenAI/vLLM engine with canned answers (tests/fakes.py).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    a = parser.parse_args()
    # keep-alive longer than a client's idle pool (uvicorn's 5 s default can close a connection being reused)
    uvicorn.run(fake_upstream(), host=a.host, port=a.port, log_level="warning", timeout_keep_alive=30)
