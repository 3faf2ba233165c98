"""GET /metrics in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = request.app.state.metrics
    m.gate_waiting.set(request.app.state.engine.gate.gated if request.app.state.engine else 0)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
