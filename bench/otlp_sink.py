"""An OTLP/HTTP trace sink for benchmarks: ``POST /v1/traces`` (protobuf) is decoded with OpenTelemetry's own
proto classes and its spans counted; ``GET /count`` answers ``{"spans": N, "requests": M}``.

    python bench/otlp_sink.py --port 4318

It runs in its own process, so the CPU it spends decoding is never counted as the gateway's.
"""

from __future__ import annotations

import argparse

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

COUNT = {"spans": 0, "requests": 0}
OK = ExportTraceServiceResponse().SerializeToString()


async def traces(request: web.Request) -> web.Response:
    req = ExportTraceServiceRequest()
    req.ParseFromString(await request.read())
    COUNT["requests"] += 1
    COUNT["spans"] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return web.Response(body=OK, content_type="application/x-protobuf")


async def count(request: web.Request) -> web.Response:
    return web.json_response(COUNT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/count", count)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
