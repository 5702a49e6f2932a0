"""The one way the gateway calls an engine, and the one mapping of what can go wrong.

:func:`engine_call` picks the rollout's engine (:class:`Engines`: pinned, healthy ones only), fails over
to the next one when a connection cannot be made (nothing was sent), and maps every failure to an
:class:`ApiError`: 504 on a timeout, 502 when no engine can be reached or a connection breaks, the
engine's own non-2xx answers through :func:`engine_error`. Model discovery and the readiness probe are
here too, and neither takes engines out of service for live traffic.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from agl_common.schemas import Policy, first_listed_model
from agl_common.settings import engine_base_urls, redacted_url, url_credentials

from .engines import NoEngine
from .errors import ApiError, engine_error
from .state import GatewayState

log = logging.getLogger("agl.gateway")

JSON_HEADERS = {"content-type": "application/json"}
DISCOVERY_TIMEOUT_S = 5.0
#: Largest complete engine answer read, in bytes (after decompression: an engine's gzip is inflated): beyond it the
#: call is a 502 and nothing of the answer is kept. vLLM's answer for 32k tokens with logprobs is a few MB.
ANSWER_BYTES_MAX = 64 * 1024 * 1024
#: Most of an engine's error body read (its message is cut to 1000 characters anyway).
ERROR_BYTES_MAX = 64 * 1024


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The response body, or ``None`` once it passes ``limit`` bytes (the rest is not read)."""
    body = bytearray()
    async for piece in resp.content.iter_chunked(1 << 16):
        body += piece
        if len(body) > limit:
            return None
    return bytes(body)


#: The shortest prefix of the engine's key :func:`mask_key` masks (also the shortest key the gateway takes: a short
#: one, ``a`` or ``assistant-9f8e``, masked the letters and words of every answer).
KEY_PREFIX_MASKED = 16


#: What a credential must be made of to be masked in a JSON body byte for byte (``*``): characters no JSON encoder
#: escapes and none of its syntax, with one that is no part of a JSON number (a masked number breaks an answer).
_MASKABLE = re.compile(rb"(?=[A-Za-z0-9._~+/=:-]*[A-DF-Za-df-z_~/=:])[A-Za-z0-9._~+/=:-]+")  # (":": user:password;
# outside a string JSON's colon follows a quote, which no credential masked here holds)


def engine_credentials(key: str | None, upstream: str) -> tuple[bytes, ...]:
    """What the gateway sends its engines that an engine (or a proxy before it) echoing the request would show: the
    engine's ``key`` (``Authorization: Bearer``), and each engine URL's credentials
    (:func:`agl_common.settings.url_credentials`: the ``Basic`` value aiohttp sends, ``user:password``, the
    password, a token user) of 8 characters or more (a shorter one would mask the words of every answer), each only
    where :data:`_MASKABLE` (a password of other characters is masked as its base64, the form a header echo shows).
    Round 23: the URL's credentials reached the agent and the call record; only the key was masked."""
    out = [key.encode()] if key else []
    for url in engine_base_urls(upstream):
        out += [form.encode() for form in url_credentials(url) if len(form) >= 8]
    return tuple(sorted({x for x in out if _MASKABLE.fullmatch(x)}, key=len, reverse=True))


def mask_credentials(data: bytes, credentials: tuple[bytes, ...]) -> bytes:
    """``data`` with each of ``credentials`` (:func:`engine_credentials`) masked by :func:`mask_key`."""
    for secret in credentials:
        data = mask_key(data, secret)
    return data


def mask_key(data: bytes, key: bytes) -> bytes:
    """``data`` with every occurrence of the engine's ``key``, or of a prefix of it :data:`KEY_PREFIX_MASKED`
    characters long or more, turned into as many ``*`` (the length kept: a ``Content-Length`` stays right). Used on
    every body the gateway answers (``app.HideEngineKey``) and every call record's error (``recording.write``):
    an engine that echoes ``Authorization`` in its messages, whole or where the gateway cut them (round 20)."""
    head = key[:KEY_PREFIX_MASKED]
    start = data.find(head)
    if start < 0:
        return data
    out = bytearray(data)
    while start >= 0:
        end = start + len(head)
        while end < len(data) and end - start < len(key) and data[end] == key[end - start]:
            end += 1
        before = start
        while before > 0 and data[before - 1] == 0x5C:  # (backslashes right before the match)
            before -= 1
        slashes = start - before
        if slashes % 2 == 0:  # (after an odd run of backslashes the first byte is an escape's: "\\n" + "ightowl",
            out[start:end] = b"*" * (end - start)  # not the secret; masked, the answer was no JSON; round 23)
        start = data.find(head, start + 1 if slashes % 2 else end)
    return bytes(out)


def _engine_message(status: int, content: bytes) -> str:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        msg = (err.get("message") if isinstance(err, dict) else err) or data.get("message") or data.get("detail")
        if msg:
            return str(msg)[:1000]
    return f"status {status}"


@asynccontextmanager
async def engine_call(st: GatewayState, rollout_id: str, path: str, payload: bytes,
                      under_v1: bool = True) -> AsyncIterator[aiohttp.ClientResponse]:
    """POST ``payload`` (JSON bytes) to ``{engine}/v1{path}`` (``under_v1=False``: ``{engine}{path}``) and
    yield the engine's 200 response, body unread; released on exit.

    Raises ``ApiError`` (also for failures while the caller reads the body inside the ``with``): 502
    ``upstream_unreachable`` (no engine could be connected to, or a connection broke), 504
    ``upstream_timeout``, or :func:`engine_error` for any other status (a 201 or 206 too).
    """
    tried: set[str] = set()
    try:
        while True:
            try:
                base = st.engines.pick(rollout_id, tried)
            except NoEngine:
                raise ApiError(502, "no upstream engine reachable", "server_error", "upstream_unreachable") from None
            tried.add(base)
            url = base + path if under_v1 else base.removesuffix("/v1") + path
            try:
                # never redirected: a 3xx is the engine's error (followed, it re-sent the agent's conversation to
                # wherever it pointed, and a dead target there marked a working engine down)
                resp = await st.http.post(url, data=payload, headers=JSON_HEADERS, allow_redirects=False)
                break
            except aiohttp.ClientConnectorError:  # nothing was sent: the next engine may take it
                st.engines.mark_down(base)
        try:
            if resp.status != 200:  # vLLM answers 200: a 201 or a 206 (a partial body, a proxy's) is not its answer
                raise engine_error(resp.status, _engine_message(
                    resp.status, (await resp.content.read(ERROR_BYTES_MAX)) or b""))
            yield resp
        finally:
            resp.release()
    except TimeoutError:
        raise ApiError(504, "upstream engine timed out", "server_error", "upstream_timeout") from None
    except aiohttp.ClientError as exc:
        raise ApiError(502, f"upstream engine failed: {type(exc).__name__}", "server_error",
                       "upstream_unreachable") from None


async def call_json(st: GatewayState, rollout_id: str, path: str, body: dict[str, Any],
                    under_v1: bool = True) -> dict[str, Any]:
    """:func:`engine_call` for a complete JSON answer; returns it parsed. Raises ``ApiError`` as
    :func:`engine_call` does, and 502 ``upstream_error`` for an answer that is not a JSON object or is over
    :data:`ANSWER_BYTES_MAX` bytes."""
    async with engine_call(st, rollout_id, path, orjson.dumps(body), under_v1) as resp:
        status, content = resp.status, await read_bounded(resp, ANSWER_BYTES_MAX)
    if content is None:
        raise ApiError(502, f"upstream engine's answer exceeds {ANSWER_BYTES_MAX} bytes", "server_error",
                       "upstream_error")
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise ApiError(502, f"upstream engine answered {status} without a JSON object", "server_error",
                       "upstream_error")
    return data


async def served_model(st: GatewayState, url: str, timeout_s: float) -> str:
    """The first model id of ``GET {url}/models`` (``url`` ends in ``/v1``). Raises ``aiohttp.ClientError``,
    ``TimeoutError``, ``ValueError`` (no model listed)."""
    async with st.http.get(url + "/models", timeout=aiohttp.ClientTimeout(total=timeout_s),
                           allow_redirects=False) as resp:
        raw = await read_bounded(resp, ANSWER_BYTES_MAX) if resp.status == 200 else None
    # (a name no policy can have, "", was: every call and /v1/models a 500, the discovery task dead)
    return first_listed_model(raw, f"GET {redacted_url(url)}/models")


async def current_policy(st: GatewayState) -> Policy:
    """The policy new calls are served by. Until one is known (no ``--model``, no stored policy, no resume
    with a model), the engines are asked for their served model (one asker at a time); the first answer
    is kept. Raises ``ApiError`` 502 ``upstream_unreachable`` if no engine answers (the call is not sent
    under a made-up model name)."""
    policy = st.policy
    if policy is not None:
        return policy
    async with st.discovery:
        if st.policy is None:
            for url in st.engines.urls:
                try:
                    name = await served_model(st, url, DISCOVERY_TIMEOUT_S)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    log.warning("model discovery at %s failed: %r", redacted_url(url), exc)
                    continue
                if st.policy is None:  # (a resume may have set one meanwhile)
                    st.policy = Policy(model=name)
                break
        if st.policy is None:
            raise ApiError(502, "no engine answered GET /v1/models: the served model is unknown (start the "
                           "engine, or give the gateway --model)", "server_error", "upstream_unreachable")
        return st.policy


async def probe(st: GatewayState, url: str, timeout_s: float = 2.0) -> bool:
    """True if ``GET {url}/models`` answers 200 (readiness). Reports only: the engine is not marked down."""
    try:
        async with st.http.get(url + "/models", timeout=aiohttp.ClientTimeout(total=timeout_s),
                               allow_redirects=False) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
