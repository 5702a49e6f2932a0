"""OpenTelemetry GenAI spans from the gateway (issue 17), received by a local OTLP/HTTP receiver that decodes
the protobuf export requests with OpenTelemetry's own proto classes."""

from __future__ import annotations

import time

import httpx
import pytest
from agl_common.auth import scoped_key
from agl_common.schemas import Rollout, RolloutStatus
from agl_gateway import GatewaySettings, create_app
from fastapi import FastAPI, Request, Response

from fakes import Served, fake_upstream

pytestmark = pytest.mark.integrations

KEY = "admin-secret-key-123"
QUESTION = "what is 3+4? secret-question-text"


def receiver() -> FastAPI:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with ``application/x-protobuf`` bodies."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                           ExportTraceServiceResponse)

    app = FastAPI()
    app.state.spans, app.state.resources, app.state.content_types = [], [], []

    @app.post("/v1/traces")
    async def traces(request: Request):
        app.state.content_types.append(request.headers.get("content-type"))
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.body())
        for rs in req.resource_spans:
            app.state.resources.append({a.key: value(a.value) for a in rs.resource.attributes})
            for ss in rs.scope_spans:
                for span in ss.spans:
                    app.state.spans.append({"name": span.name, "kind": span.kind, "status": span.status.code,
                                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                                            "attrs": {a.key: value(a.value) for a in span.attributes}})
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    return app


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture
def otlp(monkeypatch):
    app = receiver()
    with Served(app) as s:
        for var in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER",
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", s.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        s.app = app
        yield s


@pytest.fixture
def upstream():
    with Served(fake_upstream()) as s:
        yield s


async def run_calls(store, redis_url, prefix, upstream, **kw) -> None:
    await store.create_rollout(Rollout(rollout_id="r1", attempt_id="0", status=RolloutStatus.running), enqueue=False)
    settings = GatewaySettings(upstream=upstream.url, redis_url=redis_url, prefix=prefix, model="policy-v3",
                               heartbeat_s=0.2, key=KEY, **kw)
    auth = {"Authorization": f"Bearer {scoped_key(KEY, 'r1', '0')}"}
    base = "/rollouts/r1/attempts/0/v1"
    msg = {"model": "agent-model", "max_tokens": 16, "temperature": 0.7,
           "messages": [{"role": "user", "content": QUESTION}]}
    with Served(create_app(settings)) as gw:  # leaving it shuts the tracer down: every span exported
        async with httpx.AsyncClient(base_url=gw.url, headers=auth, timeout=30) as c:
            assert (await c.post(base + "/chat/completions", json=msg)).status_code == 200
            assert (await c.post(base + "/completions", json={"model": "m", "prompt": QUESTION})).status_code == 200
            assert (await c.post(base + "/chat/completions", json={**msg, "stream": True})).status_code == 200
            assert (await c.post(base + "/chat/completions", json={**msg, "x_fail": "null"})).status_code == 502


async def test_one_genai_span_per_call_without_keys_or_content(store, redis_url, prefix, upstream, otlp):
    await run_calls(store, redis_url, prefix, upstream, otel=True)
    spans = sorted(otlp.app.state.spans, key=lambda s: s["attrs"]["agl.seq"])
    calls = await store.read_calls("r1")
    assert len(spans) == len(calls) == 4
    assert set(otlp.app.state.content_types) == {"application/x-protobuf"}
    assert all(r.get("service.name") == "agl-gateway" for r in otlp.app.state.resources)
    chat, completion, streamed, failed = spans
    assert chat["name"] == "chat agent-model" and chat["kind"] == 3  # SPAN_KIND_CLIENT
    a = chat["attrs"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "vllm" and a["gen_ai.system"] == "vllm"
    assert a["gen_ai.request.model"] == "agent-model" and a["gen_ai.response.model"] == "policy-v3"
    assert a["gen_ai.response.finish_reasons"] == ["stop"] and a["gen_ai.response.id"] == "chatcmpl-fake"
    assert a["gen_ai.usage.input_tokens"] == len(calls[0].prompt_token_ids) == 2
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.request.max_tokens"] == 16 and a["gen_ai.request.temperature"] == 0.7
    assert a["agl.rollout_id"] == "r1" and a["agl.attempt_id"] == "0" and a["agl.route"] == "chat"
    assert (chat["start"], chat["end"]) == (int(calls[0].started_at * 1e9), int(calls[0].ended_at * 1e9))
    assert completion["attrs"]["gen_ai.operation.name"] == "text_completion"
    assert completion["attrs"]["gen_ai.usage.output_tokens"] == 2
    assert streamed["attrs"]["gen_ai.usage.output_tokens"] == 4 and streamed["attrs"]["agl.seq"] == 2
    assert failed["status"] == 2 and failed["attrs"]["error.type"] == "upstream_error"  # STATUS_CODE_ERROR
    # never a key, never the conversation
    text = repr([s["attrs"] for s in spans])
    assert KEY not in text and "Bearer" not in text and "secret-question-text" not in text
    assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for s in spans for k in s["attrs"])


async def test_message_content_only_when_asked(store, redis_url, prefix, upstream, otlp, monkeypatch):
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-gateway")
    await run_calls(store, redis_url, prefix, upstream, otel=True)
    spans = sorted(otlp.app.state.spans, key=lambda s: s["attrs"]["agl.seq"])
    import json

    inp = json.loads(spans[0]["attrs"]["gen_ai.input.messages"])
    out = json.loads(spans[0]["attrs"]["gen_ai.output.messages"])
    assert inp == [{"role": "user", "parts": [{"type": "text", "content": QUESTION}]}]
    assert out == [{"role": "assistant", "parts": [{"type": "text", "content": "the answer is 7"}],
                    "finish_reason": "stop"}]
    assert KEY not in repr(spans)
    assert {r.get("service.name") for r in otlp.app.state.resources} == {"my-gateway"}


@pytest.mark.parametrize("enabled,env", [(False, {}), (True, {"OTEL_SDK_DISABLED": "true"})])
async def test_off_by_default_and_when_disabled(store, redis_url, prefix, upstream, otlp, monkeypatch, enabled, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    await run_calls(store, redis_url, prefix, upstream, otel=enabled)
    time.sleep(0.3)
    assert len(await store.read_calls("r1")) == 4 and otlp.app.state.spans == []


def test_missing_sdk_says_what_to_install(monkeypatch):
    import sys

    from agl_gateway.otel import tracer_from_env

    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(RuntimeError, match=r"--otel needs the OpenTelemetry SDK .*pip install 'agl-gateway\[otel\]'"):
        tracer_from_env(True)
    assert tracer_from_env(False) is None
