"""Anthropic Messages API (what Claude Code-style harnesses call), translated to chat completions.

``ANTHROPIC_BASE_URL={gateway}/rollouts/{r}/attempts/{a}``: the SDK appends ``/v1/messages``.
Streams are synthesized from one non-streamed upstream call (so ids and logprobs are complete).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import translate
from ..errors import ApiError, bad_request
from ..identity import caller_and_body, check_callable, header
from ..pipeline import RouteSpec, check_not_displaced, enter_gate, model_call, route
from ..state import state_of
from ..translate import anthropic_sse, anthropic_to_chat, chat_to_anthropic
from ..upstream import call_json, current_policy

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
    # a model call's rules (the key before the body, a finished rollout gets 409, a model name of no known role
    # gets 400, the pause gate, a displaced replica's 503), but counting never creates a rollout (--open)
    ident, body = await caller_and_body(request, st, create=False)
    check_callable(ident)
    if not isinstance(body.get("model", ""), str):
        raise bad_request("'model' must be a string")
    await translate.ready()
    chat = anthropic_to_chat({"max_tokens": 1, **body})
    if st.policy is not None:
        route(st.policy, body, header(request, "x-agl-role"))  # refused now, not after a pause
    who = f"{ident.rollout_id}/{ident.attempt_id}"
    await enter_gate(st, who)  # (the engine may be mid-update while paused; a drain counts this call)
    try:
        check_not_displaced(st)
        policy = await current_policy(st)
        if policy.roles:
            route(policy, body, header(request, "x-agl-role"))
        payload = {"model": policy.model, "messages": chat["messages"],
                   **({"tools": chat["tools"]} if chat.get("tools") else {}),
                   **{k: chat[k] for k in ("continue_final_message", "add_generation_prompt") if k in chat}}
        count = (await call_json(st, ident.rollout_id, "/tokenize", payload, under_v1=False)).get("count")
    finally:
        st.gate.leave(who)
    if type(count) is not int or count < 0:
        raise ApiError(502, "upstream engine could not count tokens", "server_error", "upstream_error")
    return {"input_tokens": count}
