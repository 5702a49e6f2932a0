"""OpenAI-shaped model routes, mounted under ``/v1`` and ``/rollouts/{rid}/attempts/{aid}/v1``."""

from __future__ import annotations

from agl_common.auth import key_allows
from fastapi import APIRouter, Request

from ..errors import ApiError
from ..proxy import RouteSpec, model_call, presented_key, state_of
from ..translate import chat_sse

router = APIRouter()

#: Fields the gateway forces on upstream so that every call can be trained on.
CHAT = RouteSpec("chat", "/chat/completions", {"return_token_ids": True, "logprobs": True}, sse=chat_sse,
                 live_stream=True)
COMPLETIONS = RouteSpec("completions", "/completions", {"return_token_ids": True, "logprobs": 0})


@router.post("/chat/completions")
async def chat_completions(request: Request):
    """Chat Completions; ``stream: true`` is relayed live (with tools: synthesized from one upstream call)."""
    return await model_call(request, CHAT)


@router.post("/completions")
async def completions(request: Request):
    """Completions (``stream: true`` is refused with 400: not supported on this route)."""
    return await model_call(request, COMPLETIONS)


@router.get("/models")
async def models(request: Request):
    """The served model name. With a key configured: the admin key, or the scoped key of the rollout
    attempt named by the path (or the ``X-AGL-Rollout-Id`` / ``X-AGL-Attempt-Id`` headers)."""
    st = state_of(request)
    if st.settings.key:
        rid = request.path_params.get("rollout_id") or request.headers.get("x-agl-rollout-id")
        aid = request.path_params.get("attempt_id") or request.headers.get("x-agl-attempt-id")
        if not key_allows(st.settings.key, presented_key(request), rid, aid):
            raise ApiError(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
    names = [st.settings.model or st.policy.model]
    return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "agl"} for n in names]}
