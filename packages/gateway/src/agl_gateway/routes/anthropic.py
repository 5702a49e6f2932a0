"""Anthropic Messages API (what Claude Code-style harnesses call), translated to chat completions.

``ANTHROPIC_BASE_URL={gateway}/rollouts/{r}/attempts/{a}``: the SDK appends ``/v1/messages``.
Streams are synthesized from one non-streamed upstream call (so ids and logprobs are complete).
"""

from __future__ import annotations

import aiohttp
import orjson
from fastapi import APIRouter, Request

from ..engines import NoEngine
from ..errors import ApiError
from ..proxy import RouteSpec, model_call, read_json, resolve_identity, state_of
from ..translate import anthropic_sse, anthropic_to_chat, chat_to_anthropic

router = APIRouter()

MESSAGES = RouteSpec("messages", "/chat/completions", {"return_token_ids": True, "logprobs": True},
                     to_upstream=anthropic_to_chat, to_agent=chat_to_anthropic, sse=anthropic_sse)


@router.post("/messages")
async def messages(request: Request):
    return await model_call(request, MESSAGES)


@router.post("/messages/count_tokens")
async def count_tokens(request: Request):
    """``{"input_tokens": N}`` from the engine's own tokenizer and chat template (vLLM ``/tokenize``)."""
    st = state_of(request)
    body = await read_json(request, st.settings.max_body_bytes)
    ident = await resolve_identity(request, st)
    chat = anthropic_to_chat({"max_tokens": 1, **body})
    try:
        url = st.engines.pick(ident.rollout_id).removesuffix("/v1") + "/tokenize"
        payload = {"model": st.policy.model, "messages": chat["messages"],
                   **({"tools": chat["tools"]} if chat.get("tools") else {})}
        async with st.http.post(url, data=orjson.dumps(payload), headers={"content-type": "application/json"}) as resp:
            status, content = resp.status, await resp.read()
        count = orjson.loads(content)["count"]
        if status != 200 or type(count) is not int:
            raise ValueError("no token count")
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, NoEngine):  # TypeError: not an object
        raise ApiError(502, "upstream engine could not count tokens", "server_error", "upstream_error") from None
    return {"input_tokens": count}
