"""GET /metrics in the Prometheus text format: ours (`rollout_sidecar_*`) and
vLLM's own (`vllm:*`, from its stat loggers), so vLLM's Grafana dashboards
work unchanged."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.auth import serve

router = APIRouter()


@serve(router, routes.METRICS)
async def metrics(request: Request) -> Response:
    state = services(request)
    m, engine = state.metrics, state.engine
    llm = engine.llm if engine is not None else None
    if engine is not None and llm is not None:
        m.gate_waiting.set(engine.gate.gated)
        m.in_flight.set(engine.gate.in_flight)
        m.engine_unfinished.set(llm.output_processor.get_num_unfinished_requests())
    # vLLM registers its metrics in prometheus_client's global registry (or a
    # multiprocess one under PROMETHEUS_MULTIPROC_DIR, which it reads itself).
    body = generate_latest(m.registry) + generate_latest(_vllm_registry())
    if engine is not None:  # /metrics is open: vLLM's model_name label is our path
        body = body.replace(f'"{engine.model_path}"'.encode(),
                            f'"{public_name(state.settings.model, engine.model_path)}"'
                            .encode())
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def public_name(given: str | None, path: Path) -> str:
    """What /metrics calls the model: the hub id as given, else the
    checkpoint folder's name (the path stays behind /info's token)."""
    if given and not Path(given).exists():
        return given
    return path.name


def _vllm_registry() -> CollectorRegistry:
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()
