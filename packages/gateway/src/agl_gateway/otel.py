"""OpenTelemetry traces of model calls: one span per recorded call, GenAI semantic conventions.

Off by default; on with ``agl-gateway serve --otel`` (``AGL_OTEL=true``). Everything else is configured by
the standard OpenTelemetry environment variables, read by the SDK itself: ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (default ``http://localhost:4318``, OTLP over HTTP/protobuf),
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME`` (default here ``agl-gateway``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*`` (batching), ``OTEL_TRACES_SAMPLER`` / ``_ARG``; and
``OTEL_SDK_DISABLED=true`` turns it off again.

A span is built from the call's record when the record is written (:func:`agl_gateway.proxy.record`): its
start and end are the record's ``started_at``/``ended_at`` (the upstream call, retries on aborts aside), kind
CLIENT, name ``"{gen_ai.operation.name} {gen_ai.request.model}"``. Attributes, per the GenAI semantic
conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/):

======================================  ===========================================================
``gen_ai.operation.name``               ``chat`` (chat, messages, responses routes), ``text_completion``
``gen_ai.provider.name``, ``gen_ai.system``  ``vllm`` (the engine behind the gateway; both names: the
                                        second is the one older back ends read)
``gen_ai.request.model``                the model the agent asked for
``gen_ai.response.model``               the served model (``policy-vN`` after N updates; the agent's
                                        answer shows the name it asked for instead)
``gen_ai.response.id``                  the engine's answer id, when it has one
``gen_ai.response.finish_reasons``      ``[finish_reason]``
``gen_ai.usage.input_tokens``           prompt token ids recorded
``gen_ai.usage.output_tokens``          response token ids recorded
``gen_ai.request.max_tokens``,          from the request, when set
``.temperature``, ``.top_p``
``error.type``                          the gateway's error code (``upstream_error``...); span status ERROR
``agl.rollout_id``, ``agl.attempt_id``  which rollout attempt made the call
``agl.seq``, ``agl.route``,             the call's number in its attempt, the route, the policy version
``agl.policy_version``
``agl.role``                            the call's role (multi-role policies only)
======================================  ===========================================================

Never a key, a header or a message. Message content only with
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`` (the variable OpenTelemetry's GenAI
instrumentations use): then ``gen_ai.input.messages`` and ``gen_ai.output.messages`` hold the request's
messages and the answer as JSON text (role + ``parts``, as the conventions shape them).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger("agl.gateway")

PROVIDER = "vllm"
OPERATIONS = {"chat": "chat", "messages": "chat", "responses": "chat", "completions": "text_completion"}
CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, dict) and isinstance(p.get("text"), str):
                out.append({"type": "text", "content": p["text"]})
            elif isinstance(p, dict):
                out.append({"type": str(p.get("type", "unknown"))})
        return out
    return [{"type": "text", "content": json.dumps(content)}]


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message in the conventions' shape: ``{"role", "parts": [...]}``."""
    parts = _parts(m.get("content"))
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        parts.append({"type": "tool_call", "id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")})
    if m.get("role") == "tool":
        parts = [{"type": "tool_call_response", "id": m.get("tool_call_id"), "response": m.get("content")}]
    return {"role": m.get("role"), "parts": parts}


def input_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages (chat / messages routes; a ``system`` field or ``instructions`` first)."""
    out = []
    system = request.get("system") or request.get("instructions")
    if system:
        out.append({"role": "system", "parts": _parts(system)})
    msgs = request.get("messages")
    if msgs is None and request.get("input") is not None:  # responses route
        inp = request["input"]
        msgs = inp if isinstance(inp, list) else [{"role": "user", "content": inp}]
    if msgs is None and request.get("prompt") is not None:  # completions route
        msgs = [{"role": "user", "content": request["prompt"]}]
    return out + [_message(m) for m in msgs or [] if isinstance(m, dict)]


def output_messages(response: dict[str, Any] | None, finish: str | None) -> list[dict[str, Any]]:
    """The answer: OpenAI ``choices[].message`` / ``text``, Anthropic ``content`` blocks, Responses ``output``."""
    if not isinstance(response, dict):
        return []
    if isinstance(response.get("choices"), list):
        out = []
        for ch in response["choices"]:
            m = ch.get("message") if isinstance(ch.get("message"), dict) else {"role": "assistant",
                                                                                "content": ch.get("text")}
            out.append({**_message({"role": "assistant", **m}), "finish_reason": ch.get("finish_reason")})
        return out
    content = response.get("content") if isinstance(response.get("content"), list) else response.get("output")
    return [{"role": "assistant", "parts": _parts(content if isinstance(content, list) else None),
             "finish_reason": finish}]


def attributes(rec: dict[str, Any], seq: int, capture_content: bool = False) -> dict[str, Any]:
    """Span attributes of one call record (a :func:`agl_gateway.proxy.new_record` dict, filled in)."""
    request = rec.get("request") or {}
    response = rec.get("response") if isinstance(rec.get("response"), dict) else {}
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATIONS.get(rec["route"], "chat"),
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.system": PROVIDER,
        "gen_ai.request.model": str(request.get("model") or rec.get("model") or ""),
        "gen_ai.response.model": str(rec.get("model") or response.get("model") or ""),  # the served policy
        "gen_ai.usage.input_tokens": len(rec.get("prompt_token_ids") or []),
        "gen_ai.usage.output_tokens": len(rec.get("response_token_ids") or []),
        "agl.rollout_id": rec["rollout_id"],
        "agl.attempt_id": rec["attempt_id"],
        "agl.seq": seq,
        "agl.route": rec["route"],
        "agl.policy_version": int(rec.get("model_version") or 0),
    }
    if rec.get("role"):
        attrs["agl.role"] = str(rec["role"])
    if rec.get("finish_reason"):
        attrs["gen_ai.response.finish_reasons"] = [str(rec["finish_reason"])]
    if isinstance(response.get("id"), str):
        attrs["gen_ai.response.id"] = response["id"]
    for key, name in (("max_tokens", "gen_ai.request.max_tokens"), ("max_output_tokens", "gen_ai.request.max_tokens"),
                      ("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p")):
        value = request.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attrs[name] = value
    if rec.get("status") == "error":
        attrs["error.type"] = _error_type(rec.get("error"))
    if capture_content:
        attrs["gen_ai.input.messages"] = json.dumps(input_messages(request))
        attrs["gen_ai.output.messages"] = json.dumps(output_messages(rec.get("response"), rec.get("finish_reason")))
    return attrs


def _error_type(error: str | None) -> str:
    """``"502 upstream_error: ..."`` (the record's ``error``) → ``upstream_error``."""
    if not error:
        return "_OTHER"
    head = error.split(":", 1)[0].split()
    return head[-1] if head else "_OTHER"


class CallTracer:
    """Turns call records into spans through the OpenTelemetry SDK (a tracer provider of its own, with a
    batch span processor and the OTLP/HTTP exporter: exporting never blocks a call)."""

    def __init__(self, provider, capture_content: bool):
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.provider = provider
        self.tracer = provider.get_tracer("agl_gateway")
        self.capture_content = capture_content
        self._client, self._error = SpanKind.CLIENT, Status(StatusCode.ERROR)

    def emit(self, rec: dict[str, Any], seq: int) -> None:
        """One span for one written record; never raises (tracing must not fail a call)."""
        try:
            attrs = attributes(rec, seq, self.capture_content)
            start = int(rec["started_at"] * 1e9)
            end = max(start, int((rec.get("ended_at") or rec["started_at"]) * 1e9))
            span = self.tracer.start_span(f"{attrs['gen_ai.operation.name']} {attrs['gen_ai.request.model']}".strip(),
                                          kind=self._client, attributes=attrs, start_time=start)
            if rec.get("status") == "error":
                span.set_status(self._error)
            span.end(end_time=end)
        except Exception as exc:  # noqa: BLE001 - a tracing bug must never cost a call
            log.warning("span for %s/%s not emitted: %r", rec.get("rollout_id"), rec.get("attempt_id"), exc)

    def shutdown(self) -> None:
        """Export what is queued and stop (bounded by ``OTEL_BSP_EXPORT_TIMEOUT``)."""
        self.provider.shutdown()


def tracer_from_env(enabled: bool) -> CallTracer | None:
    """A :class:`CallTracer` if ``enabled`` and ``OTEL_SDK_DISABLED`` is not true; None otherwise.

    The exporter, the batch processor and the resource read their ``OTEL_*`` variables themselves.
    Raises ``RuntimeError`` (saying what to install) if the SDK or the exporter is missing.
    """
    if not enabled or _true(os.environ.get("OTEL_SDK_DISABLED")):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(f"--otel needs the OpenTelemetry SDK and OTLP exporter ({exc.name} is missing): "
                           "pip install 'agl-gateway[otel]'") from None

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": "agl-gateway"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return CallTracer(provider, _true(os.environ.get(CAPTURE_ENV)))
