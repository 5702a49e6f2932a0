"""Operations: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..state import state_of
from ..upstream import probe

router = APIRouter()


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request):
    """200 when Redis answers PING and an engine answers ``GET /v1/models``; 503 otherwise. The probe
    only reports: an engine it cannot reach is not taken out of service for live calls."""
    st = state_of(request)
    checks = {}
    try:
        checks["redis"] = await st.store.ping()
    except Exception:
        checks["redis"] = False
    checks["upstream"] = False
    for url in st.engines.urls:  # ready when at least one engine answers
        if await probe(st, url):
            checks["upstream"] = True
            break
    if st.displaced:  # another gateway took this one's id: it forwards nothing
        checks["replica_id"] = False
    ok = all(checks.values())
    body = {"status": "ready" if ok else "not ready", "checks": checks, "paused": st.gate.paused}
    if not ok:
        body["error"] = {"message": "not ready", "type": "server_error", "code": "not_ready"}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    st = state_of(request)
    st.metrics.in_flight.set(st.gate.in_flight)
    st.metrics.held.set(st.gate.held)
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
