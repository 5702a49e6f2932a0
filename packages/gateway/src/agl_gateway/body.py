"""The agent's request body: read with a size bound, parsed as one JSON object of bounded depth."""

from __future__ import annotations

import json
from typing import Any

import orjson
from agl_common.schemas import MAX_JSON_DEPTH, long_integer, no_repeated_keys, too_deep
from fastapi import Request
from starlette.requests import ClientDisconnect

from .errors import ApiError, bad_request

async def read_json(request: Request, max_bytes: int, keyless: bool = False,
                    unique_keys: bool = False) -> dict[str, Any]:
    """The request body as a JSON object. Raises ``ApiError`` 413 (over ``max_bytes`` bytes), 403 (``keyless``: a
    request carrying ``Origin``, which browsers add to every POST and no agent's HTTP client sends: a web page open
    on the machine must not call a gateway that checks no key, cross-site or after a DNS rebinding) or 400 (not a
    JSON object, nested deeper than :data:`MAX_JSON_DEPTH`, holding an integer beyond 64 bits, with ``unique_keys`` a
    key given twice in one object (the small reward and event bodies: ``{"value": 1, "value": 2}`` was a reward of 2,
    which ``rollouts create`` refuses), or the agent went away mid-body)."""
    if keyless and request.headers.get("origin") is not None:
        raise ApiError(403, "a gateway without a key takes no request from a web page (Origin header); give it a key "
                       "(--key) to serve browsers", "permission_error", "browser_request")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error", "body_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise ApiError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error",
                               "body_too_large")
    except ClientDisconnect:  # the agent went away mid-body: nothing to answer, nothing forwarded
        raise bad_request("client disconnected before sending the whole body", "client_disconnected") from None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    # fewer brackets than the limit in the whole text: cannot nest deeper (brackets in strings only add)
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH and too_deep(data):
        raise bad_request(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    if (big := long_integer(body)) is not None:  # (orjson read it as the nearest double: forwarded, recorded bent)
        raise bad_request(f"request body holds the integer {big}, beyond 64 bits: it cannot be read exactly (send "
                          "it as a string)", "invalid_json")
    if unique_keys:
        try:
            json.loads(bytes(body), object_pairs_hook=no_repeated_keys)
        except ValueError as exc:
            raise bad_request(f"request body: {exc}", "invalid_json") from None
    return data
