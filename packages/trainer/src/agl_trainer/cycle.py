"""The collocated update cycle: pause → drained → update → publish → resume (:func:`backend_cycle`), and the
engine routes a backend publishes through (LoRA hot-load and unload, in-place weight reload).

The engine and the trainer share the same cores (or GPUs): while the policy is updated, the gateway
holds new calls and the engine is idle. After the update the backend makes the engine serve the new policy
(merged weights reloaded in place under the base name, or the adapter hot-loaded as ``policy-v{N}``) and the
gateway is resumed with that name and version, so every call from then on is served (and recorded) by version N.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import httpx
from agl_common.control import new_pause_id, pause_and_drain, resume
from agl_common.schemas import served_names
from agl_common.settings import ENGINE_KEY_ENV, engine_base_urls, engine_headers, printable, redacted_url, url_credentials
from agl_common.store import Store

from . import compute


class EngineError(RuntimeError):
    """The engine refused or failed an adapter load/unload."""


#: serving → the engine routes its policy swaps POST to, and what makes vLLM serve them (docs/deploy.md)
SWAP_ROUTES = {"merged": (("/collective_rpc", "/reset_prefix_cache"), "VLLM_SERVER_DEV_MODE=1"),
               "adapter": (("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
                           "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")}


#: Seconds one engine check may take in all (connect, headers and body), and the most body bytes it reads.
CHECK_TIMEOUT_S = 30.0
CHECK_BYTES_MAX = 4 << 20


async def _engine_request(http: httpx.AsyncClient, method: str, url: str, route: str, json: dict | None = None,
                          timeout_s: float | None = None) -> tuple[int, bytes]:
    """``{method} {url}{route}`` (``json``: the body): its status and up to :data:`CHECK_BYTES_MAX` bytes of its body
    as sent, within ``timeout_s`` seconds in all (default :data:`CHECK_TIMEOUT_S`; httpx's timeout bounds each read:
    an engine that sent its body a byte at a time held a check, or a swap, for ever). Asks for no compression and decodes none (``aiter_raw``: a 32 KiB
    zstd body, or ``gzip, gzip``, decoded to a gigabyte before any size check). Every request the trainer makes to an
    engine goes through here. Raises :class:`EngineError` naming the engine (its URL without secrets)."""
    where, timeout_s = f"engine {redacted_url(url)}", CHECK_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s), \
                http.stream(method, url + route, json=json, headers={"Accept-Encoding": "identity"}) as resp:
            body = bytearray()
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > CHECK_BYTES_MAX:
                    raise EngineError(f"{where} answered {method} {route} with more than {CHECK_BYTES_MAX} bytes")
            return resp.status_code, bytes(body)
    except TimeoutError:
        raise EngineError(f"{where} did not answer {method} {route} in {timeout_s:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # (InvalidURL: a host httpx cannot encode, "http://☃:1")
        raise EngineError(f"{where} cannot be reached: {type(exc).__name__}") from None


async def _engine_get(http: httpx.AsyncClient, url: str, route: str) -> tuple[int, bytes]:
    """:func:`_engine_request` ``GET`` within :data:`CHECK_TIMEOUT_S`: the checks at start."""
    return await _engine_request(http, "GET", url, route)


_JSON_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", '"': '"', "/": "/", "\\": "\\"}


def _json_unescaped(text: str) -> str:
    """``text`` with JSON's string escapes read (``\\u00e4`` in either case, surrogate pairs, ``\\/``, ``\\"``,
    ``\\t``...), in one linear pass: an engine's JSON answer holds a credential as its encoder wrote it (Go escapes
    ``&<>``, Python every non-ASCII letter)."""
    def one(m: re.Match) -> str:
        if m[1]:
            return chr(0x10000 + ((int(m[1], 16) - 0xD800) << 10) + int(m[2], 16) - 0xDC00)
        return chr(int(m[3], 16)) if m[3] else _JSON_ESCAPES[m[4]]
    return re.sub(r'\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|\\u([0-9a-fA-F]{4})|\\(["\\/bfnrt])',
                  one, text)


def _answer_excerpt(body: bytes, url: str) -> str:
    """What an error message shows of engine ``url``'s answer ``body``: its first 300 characters, decoded with
    replacement and JSON's escapes read (:func:`_json_unescaped`), every credential the trainer sent it masked
    wherever the engine echoed it — the engine key (``AGL_UPSTREAM_KEY``); the URL's credentials
    (:func:`agl_common.settings.url_credentials`: its password of 4 characters or more, ``user:password`` and its
    ``Basic`` base64, or its user part alone when it holds no password, a token, ``key:`` included): each as is or URL-encoded, and any run of characters holding 16 or more of one in a row (a
    cut an engine echoed: ``...last 20 characters``) — and any token after ``Basic``/``Bearer``; then control
    characters escaped (:func:`agl_common.settings.printable`: an engine's ESC or OSC-8 sequences reached the
    terminal). A user name beside a password is not masked alone (``admin`` masked every such word)."""
    text = _json_unescaped(body[:1200].decode("utf-8", "replace"))
    password = unquote(urlsplit(url).password or "")
    secrets = [os.environ.get(ENGINE_KEY_ENV) or ""] + url_credentials(url)
    secrets = sorted({x for x in secrets if x and (x != password or len(x) >= 4)}, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, "***").replace(quote(secret, safe=""), "***")
    cuts = {x[i:i + 16] for x in secrets for i in range(len(x) - 15)}
    if cuts:
        text = re.sub(r"[^\s\"'<>]{16,}", lambda m: "***" if any(m[0][i:i + 16] in cuts
                                                                  for i in range(len(m[0]) - 15)) else m[0], text)
    text = re.sub(r"(?i)\b(basic|bearer)(\s+|%20|\+)[A-Za-z0-9._~+/=%-]+", r"\1\2***", text)
    return printable(text)[:300]


async def _engine_post(http: httpx.AsyncClient, engine_url: str, route: str, what: str, timeout_s: float,
                       json: dict | None = None, ok: tuple[int, ...] = (200,)) -> None:
    """``POST {route}`` on every engine of ``engine_url`` (:func:`_engine_request`, ``timeout_s`` in all for each);
    :class:`EngineError` ``"{what} on {engine} failed: {status} {excerpt}"`` unless each answers a status in ``ok``."""
    for url in engine_urls(engine_url):
        status, body = await _engine_request(http, "POST", url, route, json=json, timeout_s=timeout_s)
        if status not in ok:
            raise EngineError(f"{what} on {redacted_url(url)} failed: {status} {_answer_excerpt(body, url)}")


async def check_reachable(engine_url: str, model: str) -> None:
    """Check, before a run or an evaluation starts on an engine it did not start, that every engine of
    ``engine_url`` answers ``GET /v1/models`` with 200 and a models list that names ``model`` (the served name the
    run's calls go to: ``model_name``; :func:`agl_common.schemas.served_names`, the parser the gateway reads it with;
    with this process's ``AGL_UPSTREAM_KEY``, if any): an engine out of reach, a web server at a mistyped port, or an
    engine serving another model made every rollout fail and an evaluation report accuracy 0 with exit 0. Raises
    :class:`EngineError` naming the engine (its URL without secrets) and what it answered, or a malformed
    ``AGL_UPSTREAM_KEY`` (:func:`agl_common.settings.check_engine_key`)."""
    try:
        headers = engine_headers()
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    async with httpx.AsyncClient(timeout=CHECK_TIMEOUT_S, headers=headers) as http:
        for url in engine_urls(engine_url):
            status, body = await _engine_get(http, url, "/v1/models")
            if status != 200:
                hint = " (the engine's key: AGL_UPSTREAM_KEY)" if status in (401, 403) else ""
                raise EngineError(f"engine {redacted_url(url)} answered GET /v1/models with {status}{hint}")
            try:
                names = served_names(body, f"engine {redacted_url(url)} (GET /v1/models)")
            except ValueError as exc:
                raise EngineError(str(exc)) from None
            if model not in names:
                listed = ", ".join(repr(n[:80]) for n in names[:5]) + (", ..." if len(names) > 5 else "")
                raise EngineError(f"engine {redacted_url(url)} does not serve {model!r} (it lists "
                                  f"{listed or 'no usable name'}): set model_name to the name the engine serves its "
                                  f"base model as, or serve it as {model!r} (vLLM: --served-model-name {model})")


async def check_engine(engine_url: str, serving: str) -> None:
    """Check, before a run starts, that every engine of ``engine_url`` serves the routes ``serving`` (``merged``
    or ``adapter``) swaps a policy with, so that an engine this run did not start cannot fail the first swap
    after minutes of training. A ``GET`` answers 405 where the ``POST`` route exists and 404 where it does not.
    Raises :class:`EngineError` naming the missing route and what serves it, or an engine that cannot be reached."""
    routes, needs = SWAP_ROUTES[serving]
    async with httpx.AsyncClient(timeout=CHECK_TIMEOUT_S, headers=engine_headers()) as http:
        for url in engine_urls(engine_url):
            for route in routes:
                status, _ = await _engine_get(http, url, route)
                if status == 404:
                    raise EngineError(f"engine {redacted_url(url)} has no {route}, which policy_serving: {serving} "
                                      f"needs to swap policies: start vLLM with {needs} (docs/deploy.md)")


def engine_urls(engine_url: str) -> list[str]:
    """Engine base URLs (no ``/v1``) from a comma-separated list."""
    return engine_base_urls(engine_url)


async def load_adapter(engine_url: str, name: str, path: Path) -> None:
    """``POST {engine}/v1/load_lora_adapter`` on every engine (in place: a name loaded before is replaced), 300 s at
    most for each. ``engine_url`` may be comma-separated. Raises :class:`EngineError` unless each engine answers 200.
    """
    async with httpx.AsyncClient(timeout=300, headers=engine_headers()) as http:
        await _engine_post(http, engine_url, "/v1/load_lora_adapter", f"loading adapter {name}", 300,
                           json={"lora_name": name, "lora_path": str(path), "load_inplace": True})


async def reload_weights(engine_url: str, path: Path) -> None:
    """Load the full weights in ``path`` (safetensors) into every engine in place, then drop its prefix cache
    (KV computed by the old weights must not be reused): vLLM's ``reload_weights`` through
    ``POST /collective_rpc`` and ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``), 600 s at most for each.
    The served model name stays. Raises :class:`EngineError` unless each engine answers 200."""
    async with httpx.AsyncClient(timeout=600, headers=engine_headers()) as http:
        for url in engine_urls(engine_url):
            await _engine_post(http, url, "/collective_rpc", f"reloading weights {path}", 600,
                               json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await _engine_post(http, url, "/reset_prefix_cache", "resetting the prefix cache", 600)


async def unload_adapter(engine_url: str, name: str) -> None:
    """``POST {engine}/v1/unload_lora_adapter`` on every engine, 60 s at most for each; an adapter already gone is
    not an error."""
    async with httpx.AsyncClient(timeout=60, headers=engine_headers()) as http:
        await _engine_post(http, engine_url, "/v1/unload_lora_adapter", f"unloading adapter {name}", 60,
                           json={"lora_name": name}, ok=(200, 404, 400))


async def backend_cycle(store: Store, backend, version: int, rows: list, row_advantages: list[float],
                        drain_timeout_s: float = 120.0, owned: Callable[[], Awaitable[None]] | None = None) -> dict:
    """One collocated cycle against any backend (:class:`agl_trainer.backends.Backend`); returns timings
    (seconds) merged with the update's stats, and ``cycle_events`` (``[name, unix time]``, in order).

    Order: pause the gateway and wait until drained → ``backend.update(rows, row_advantages)`` (in a worker
    thread; the backend frees the engine's memory first if it shares it) → ``backend.publish(version)``
    (the engine serves the new policy; returns the :class:`Policy` that routes to it) → gateway resumed on
    that policy, so every call from then on is recorded with it. If anything fails after the pause, the
    gateway is resumed on the *old* policy before re-raising: agents are never left held by a crashed trainer.
    ``owned`` (:meth:`agl_trainer.lease.TrainerLease.confirm`) is awaited before the pause and before the publish:
    it raises once another trainer holds the prefix, and this one then neither pauses its gateway nor publishes.
    """
    if owned is not None:
        await owned()
    events: list[list] = []
    t0 = time.perf_counter()
    events.append(["pause", time.time()])
    pause = new_pause_id()
    replicas = await pause_and_drain(store, pause, timeout_s=drain_timeout_s)
    events.append(["drained", time.time()])
    t_drained = time.perf_counter()
    try:
        stats = await compute.run(backend.update, rows, row_advantages)  # the run's one torch thread
        t_update = time.perf_counter()
        if owned is not None:
            await owned()
        policy = await backend.publish(version)
    except BaseException:
        await resume(store, release=pause)
        raise
    t_published = time.perf_counter()
    await resume(store, policy=policy, release=pause)
    events.append(["resume", time.time()])
    await backend.retire(version - 1)
    return {**stats, "drain_s": t_drained - t0, "weight_load_s": t_published - t_update,
            "cycle_s": time.perf_counter() - t0, "replicas": len(replicas),
            "in_flight_at_pause": sum(r.in_flight for r in replicas), "cycle_events": events}
