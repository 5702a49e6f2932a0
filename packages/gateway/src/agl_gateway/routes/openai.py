"""OpenAI-shaped model routes, mounted under ``/v1`` and ``/rollouts/{rid}/attempts/{aid}/v1``."""

from __future__ import annotations

from fastapi import APIRouter, Request
import orjson
from fastapi.responses import Response

from ..proxy import model_call, state_of

router = APIRouter()


def _json(body: dict) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")

#: Fields the gateway forces on upstream so that every call can be trained on.
CHAT_FORCE = {"return_token_ids": True, "logprobs": True}
COMPLETIONS_FORCE = {"return_token_ids": True, "logprobs": 0}


@router.post("/chat/completions")
async def chat_completions(request: Request):
    return _json(await model_call(request, "chat", "/chat/completions", CHAT_FORCE))


@router.post("/completions")
async def completions(request: Request):
    return _json(await model_call(request, "completions", "/completions", COMPLETIONS_FORCE))


@router.get("/models")
async def models(request: Request):
    st = state_of(request)
    names = [st.settings.model or st.policy.model]
    return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "agl"} for n in names]}
