"""Real, unchanged clients against the gateway (fake upstream): openai (sync, async, streaming),
anthropic (streaming and not), the OpenAI Agents SDK's Responses model. Every call is recorded with ids."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from agl_gateway import GatewaySettings, create_app

from fakes import Served, fake_upstream


@pytest.fixture
def gw(redis_url, prefix):
    up_app = fake_upstream()
    with Served(up_app) as up:
        settings = GatewaySettings(upstream=up.url, redis_url=redis_url, prefix=prefix, model="agent-model",
                                   open=True)
        with Served(create_app(settings)) as g:
            g.upstream_calls = up_app.state.calls
            yield g


def base(gw, rid="r1"):
    return f"{gw.url}/rollouts/{rid}/attempts/0"


async def test_openai_sdk_sync_async_and_stream(gw, store):
    client = openai.OpenAI(base_url=base(gw) + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "3+4?"}]
    out = client.chat.completions.create(model="agent-model", messages=msgs)
    assert out.choices[0].message.content == "the answer is 7"
    chunks = list(client.chat.completions.create(model="agent-model", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "the answer is 7" and chunks[-1].usage.completion_tokens == 4
    aclient = openai.AsyncOpenAI(base_url=base(gw) + "/v1", api_key="x")
    out = await aclient.chat.completions.create(model="agent-model", messages=msgs)
    stream = await aclient.chat.completions.create(model="agent-model", messages=msgs, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "the answer is 7"
    calls = await store.read_calls("r1")
    assert len(calls) == 4 and all(c.status == "ok" for c in calls)
    streamed = calls[1]
    assert streamed.prompt_token_ids == calls[0].prompt_token_ids == [1, 4]
    assert streamed.response_token_ids == calls[0].response_token_ids == [7, 8, 9, 2]
    assert streamed.response_logprobs == pytest.approx(calls[0].response_logprobs)
    assert streamed.response["choices"][0]["message"]["content"] == "the answer is 7"


async def test_stream_with_missing_ids_is_recorded_as_incomplete(gw, store):
    r = httpx.post(base(gw) + "/v1/chat/completions", json={"model": "m", "stream": True, "x_drop_ids": True,
                                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")  # the agent still gets its answer
    (call,) = await store.read_calls("r1")
    assert call.status == "error" and "incomplete: 3 of 4" in call.error


async def test_chat_stream_with_tools_is_synthesized_from_one_call(gw, store):
    client = openai.OpenAI(base_url=base(gw) + "/v1", api_key="x")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+4"}],
                                                 tools=tools, stream=True, extra_body={"x_tool": True}))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert calls[0].function.name == "add" and calls[0].function.arguments == '{"a": 3, "b": 4}'
    assert "stream" not in gw.upstream_calls[-1]
    (rec,) = await store.read_calls("r1")
    assert rec.response_token_ids == [11, 12, 2]


async def test_anthropic_sdk_messages_plain_stream_and_count(gw, store):
    client = anthropic.Anthropic(base_url=base(gw), api_key="x")
    msg = client.messages.create(model="claude-x", max_tokens=20, system="be brief",
                                 messages=[{"role": "user", "content": "3+4?"}])
    assert msg.content[0].text == "the answer is 7" and msg.model == "claude-x" and msg.stop_reason == "end_turn"
    with client.messages.stream(model="claude-x", max_tokens=20,
                                messages=[{"role": "user", "content": "3+4?"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "the answer is 7" and final.usage.output_tokens == 4
    tool_msg = client.messages.create(
        model="claude-x", max_tokens=20, messages=[{"role": "user", "content": "add"}],
        tools=[{"name": "add", "description": "add", "input_schema": {"type": "object"}}], extra_body={"x_tool": True})
    tool_use = [b for b in tool_msg.content if b.type == "tool_use"][0]
    assert tool_use.name == "add" and tool_use.input == {"a": 3, "b": 4} and tool_msg.stop_reason == "tool_use"
    count = client.messages.count_tokens(model="claude-x", system="s", messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens == 20  # the fake counts 10 per message: system + user
    up = gw.upstream_calls[0]
    assert up["messages"][0] == {"role": "system", "content": "be brief"} and up["return_token_ids"] is True
    calls = await store.read_calls("r1")
    assert [c.route for c in calls] == ["messages"] * 3
    assert calls[0].response_token_ids == [7, 8, 9, 2] and calls[0].response["type"] == "message"
    bad = httpx.post(base(gw) + "/v1/messages", json={"model": "claude-x", "max_tokens": 5})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"


async def test_responses_api_plain_and_stream(gw, store):
    client = openai.OpenAI(base_url=base(gw) + "/v1", api_key="x")
    resp = client.responses.create(model="agent-model", input="3+4?", instructions="be brief")
    assert resp.output_text == "the answer is 7"
    events = list(client.responses.create(model="agent-model", input="3+4?", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "the answer is 7"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "the answer is 7"
    calls = await store.read_calls("r1")
    assert [c.route for c in calls] == ["responses", "responses"]
    assert calls[0].prompt_token_ids and calls[0].response_token_ids == [7, 8, 9, 2]
    assert gw.upstream_calls[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert httpx.post(base(gw) + "/v1/responses", json={"model": "m"}).status_code == 400


async def test_agents_sdk_default_responses_model(gw, store, monkeypatch):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base(gw, "agents") + "/v1", api_key="x")
    agent = Agent(name="a", instructions="solve", model=OpenAIResponsesModel(model="agent-model", openai_client=client),
                  model_settings=ModelSettings(max_tokens=16))
    result = await Runner.run(agent, "3+4?")
    assert result.final_output == "the answer is 7"
    (call,) = await store.read_calls("agents")
    assert call.route == "responses" and call.response_token_ids == [7, 8, 9, 2]
