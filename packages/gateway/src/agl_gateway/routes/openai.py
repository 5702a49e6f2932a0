"""OpenAI-shaped model routes, mounted under ``/v1`` and ``/rollouts/{rid}/attempts/{aid}/v1``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..identity import authorize
from ..pipeline import RouteSpec, model_call
from ..state import state_of
from ..translate import chat_sse
from ..upstream import current_policy

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
    """The served model name (with roles: the model names the harness gives each role). With a key configured: the admin key, or the scoped key of the rollout
    attempt named by the path or the ``X-AGL-Rollout-Id`` (and optional ``X-AGL-Attempt-Id``) headers,
    checked as a model call's key is. Unknown until an engine answers: 502."""
    st = state_of(request)
    await authorize(request, st)
    policy = await current_policy(st)
    # with roles, the names a call may ask for are the roles' model names (any other gets 400 unknown_role)
    names = sorted(policy.role_models) if policy.roles else [st.settings.model or policy.model]
    return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "agl"} for n in names]}
