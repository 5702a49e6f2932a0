"""Errors the gateway answers with, in the OpenAI shape (or Anthropic's on ``/messages`` routes).

Each error maps to what the caller can do: fix the request (400/413), fix the key (401), stop using
this rollout (404) or attempt (409), retry later (502/503/504).
"""

from __future__ import annotations

from agl_common.store import UnreadableRecord
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    """An error answered to the agent as JSON with ``status``; ``headers`` are added (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code)


STORE_DOWN = "the gateway's store (Redis) is unavailable; retry later"


def store_down() -> ApiError:
    """503: Redis did not answer (nothing was recorded; retry)."""
    return ApiError(503, STORE_DOWN, "server_error", "store_unavailable", {"Retry-After": "1"})


def engine_error(status: int, message: str) -> ApiError:
    """An engine's non-2xx answer, mapped so that the agent can tell it from the gateway's own errors.

    The engine's 400/413/422 (the request is wrong for the engine, e.g. a context that is too long) is
    answered 400 ``upstream_rejected`` with the engine's message; its 429 is 503 ``upstream_busy`` (retry);
    anything else (404 for an unknown model or adapter, 401, 5xx) is 502 ``upstream_error`` naming the
    engine's status. The gateway's own 404 (unknown rollout) and 401 (key) never come from the engine.
    """
    if status in (400, 413, 422):
        return ApiError(400, f"the engine rejected the request: {message}", "invalid_request_error",
                        "upstream_rejected")
    if status == 429:
        return ApiError(503, f"the engine is busy: {message}", "server_error", "upstream_busy", {"Retry-After": "1"})
    return ApiError(502, f"the engine answered {status}: {message}", "server_error", "upstream_error")


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                    502: "api_error", 503: "overloaded_error", 504: "api_error"}


def error_body(request: Request, status: int, message: str, type_: str, code: str | None) -> dict:
    """OpenAI ``{"error": {...}}`` or, for Anthropic routes, ``{"type": "error", "error": {...}}``."""
    if request.url.path.endswith(("/messages", "/messages/count_tokens")):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                           "message": message}}
    return {"error": {"message": message, "type": type_, "code": code}}


def install_handlers(app) -> None:
    """Register handlers so that no error leaves the gateway as HTML or an unshaped body."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(request, exc.status, exc.message, exc.type, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(UnreadableRecord)  # (another version's rollout record: one answer, no traceback per call)
    async def _unreadable(request: Request, exc: UnreadableRecord):
        return JSONResponse(error_body(request, 409, str(exc), "invalid_request_error", "rollout_unreadable"),
                            status_code=409)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5])
        return JSONResponse(error_body(request, 400, msg or "invalid request", "invalid_request_error",
                                       "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(request, exc.status_code, str(exc.detail), "invalid_request_error",
                                       code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return JSONResponse(error_body(request, 500, f"internal error: {type(exc).__name__}", "server_error",
                                       "internal_error"), status_code=500)
