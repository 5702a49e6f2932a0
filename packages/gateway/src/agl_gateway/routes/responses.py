"""OpenAI Responses API (what Codex-style harnesses and the Agents SDK's default model call).

Translated to chat completions with LiteLLM so token ids and logprobs are kept; streams are
synthesized from one non-streamed upstream call. ``previous_response_id`` is not supported (the
gateway stores no conversation state): send the full ``input``. Nothing is stored: every answer says
``"store": false``, and a ``background`` run is refused (400).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..pipeline import RouteSpec, model_call
from ..translate import chat_to_responses, responses_sse, responses_to_chat

router = APIRouter()

RESPONSES = RouteSpec("responses", "/chat/completions", {"return_token_ids": True, "logprobs": True},
                      to_upstream=responses_to_chat, to_agent=chat_to_responses, sse=responses_sse)


@router.post("/responses")
async def responses(request: Request):
    return await model_call(request, RESPONSES)
