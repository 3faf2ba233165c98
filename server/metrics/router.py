"""GET /metrics in the Prometheus text format: ours (`rollout_sidecar_*`) and
vLLM's own (`vllm:*`, from its stat loggers), so vLLM's Grafana dashboards
work unchanged."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m, engine = request.app.state.metrics, request.app.state.engine
    if engine is not None and engine.llm is not None:
        m.gate_waiting.set(engine.gate.gated)
        m.in_flight.set(engine.gate.in_flight)
        m.engine_unfinished.set(engine.llm.output_processor.get_num_unfinished_requests())
    # vLLM registers its metrics in prometheus_client's global registry (or a
    # multiprocess one under PROMETHEUS_MULTIPROC_DIR, which it reads itself).
    body = generate_latest(m.registry) + generate_latest(_vllm_registry())
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _vllm_registry() -> CollectorRegistry:
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()
