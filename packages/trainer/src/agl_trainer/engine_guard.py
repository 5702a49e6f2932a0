"""The key on every route of the vLLM engine a run starts (vLLM ``--middleware``; imported in vLLM's process).

vLLM's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm.entrypoints.serve.middleware.authenticate.GUARDED_PREFIX``): the dev-mode routes a run needs to swap merged
weights (``/collective_rpc``, ``/reset_prefix_cache``, ``/sleep``...) answer anyone who reaches the port, so a
harness on the same machine could load weights of its own into the engine. :class:`RequireKey` asks for
``Authorization: Bearer <VLLM_API_KEY>`` on every HTTP route but the liveness probe ``/health``; the trainer, its
gateway and its controller send it (``AGL_UPSTREAM_KEY``: :func:`agl_common.settings.engine_headers`).

This module imports nothing heavy: vLLM imports it at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

#: Routes answered without the key (a liveness probe holds nothing).
OPEN_PATHS = frozenset({"/health"})


class RequireKey:
    """Pure ASGI middleware: a request without ``Authorization: Bearer <VLLM_API_KEY>`` gets 401, on every HTTP and
    websocket route except :data:`OPEN_PATHS`. Raises ``RuntimeError`` at start-up when ``VLLM_API_KEY`` is unset
    or empty (an engine that would answer anyone must not start as if guarded)."""

    def __init__(self, app) -> None:
        key = os.environ.get("VLLM_API_KEY") or ""
        if not key:
            raise RuntimeError("agl_trainer.engine_guard.RequireKey needs VLLM_API_KEY")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope) -> bool:
        if scope.get("path") in OPEN_PATHS:
            return True
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode("latin-1")).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
