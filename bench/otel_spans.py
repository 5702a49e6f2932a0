"""CPU cost of the gateway's OpenTelemetry spans alone (issue 17): ``agl_gateway.otel.CallTracer.emit`` on a
record shaped like ``bench/gateway.py``'s (256 prompt + 32 response tokens), exported over OTLP/HTTP to
``bench/otlp_sink.py`` (its own process), exactly as ``agl-gateway serve --otel`` sets it up.

Prints, per repeat: CPU µs per span in the calling thread (what a call's request handler pays) and for the
whole process (plus the batch processor's thread: protobuf encoding and the HTTP export), and checks that
the sink received every span. Nothing is asserted.

    .venv/bin/python bench/otel_spans.py [--spans 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gateway import free_port, stop, wait_http  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=20000, help="spans per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    sink = subprocess.Popen([sys.executable, str(HERE / "otlp_sink.py"), "--port", str(port)])
    try:
        wait_http(f"http://127.0.0.1:{port}/count", sink, 30)
        os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_SDK_DISABLED="false",
                          OTEL_BSP_MAX_QUEUE_SIZE=str(args.spans))  # a burst this size is queued, not dropped
        from agl_gateway.otel import tracer_from_env

        tracer = tracer_from_env(True)
        now = time.time()
        rec = {"rollout_id": "r0001", "attempt_id": "0", "seq": -1, "route": "chat",
               "request": {"model": "bench-model", "max_tokens": 32, "temperature": 1.0,
                           "messages": [{"role": "user", "content": "x" * 400}]},
               "response": {"id": "chatcmpl-1", "model": "bench-model",
                            "choices": [{"message": {"role": "assistant", "content": "y"}, "finish_reason": "stop"}]},
               "prompt_token_ids": list(range(256)), "response_token_ids": list(range(32)),
               "response_logprobs": [-0.1] * 32, "finish_reason": "stop", "model_version": 0, "model": "bench-model",
               "latency_ms": 1.0, "status": "ok", "error": None, "started_at": now, "ended_at": now + 0.001}
        for rep in range(args.repeats):
            c0, t0 = time.process_time(), time.thread_time()
            for i in range(args.spans):
                tracer.emit(rec, i)
            t1 = time.thread_time()
            tracer.provider.force_flush()
            c1 = time.process_time()
            print(f"repeat {rep + 1}: {(t1 - t0) / args.spans * 1e6:6.1f} µs CPU per span in the calling thread, "
                  f"{(c1 - c0) / args.spans * 1e6:6.1f} µs for the process (with batching and export); "
                  f"load avg {os.getloadavg()[0]:.1f}")
        tracer.shutdown()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=5) as resp:
            got = orjson.loads(resp.read())
        print(f"sink received {got['spans']} spans of {args.spans * args.repeats} in {got['requests']} requests")
    finally:
        stop(sink)


if __name__ == "__main__":
    main()
