"""GET /metrics in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m, engine = request.app.state.metrics, request.app.state.engine
    if engine is not None and engine.llm is not None:
        m.gate_waiting.set(engine.gate.gated)
        m.in_flight.set(engine.gate.in_flight)
        m.engine_unfinished.set(engine.llm.output_processor.get_num_unfinished_requests())
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
