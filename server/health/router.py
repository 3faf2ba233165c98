"""Liveness, readiness and model info."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request

from rollout_sidecar.protocol.schema import HealthResponse, InfoResponse, routes
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.auth import serve
from rollout_sidecar.server.weights.self_report import transports

router = APIRouter()

# /health: 503 until the engine started, or once vLLM's `check_health` says its
# engine core died (exited, a fatal error, or its output handler ended). That
# is a flag read in this process, no call to the engine core, so a wedged
# engine core that still runs passes; bounded anyway, so a liveness probe never
# hangs on it. /ready checks other things: loaded, not draining, not suspect,
# not broken.
HEALTH_TIMEOUT_S = 10.0


@serve(router, routes.HEALTH)
async def health(request: Request) -> HealthResponse:
    engine = services(request).engine
    if engine is None or engine.llm is None:
        raise HTTPException(503, "engine not started")
    try:
        await asyncio.wait_for(engine.check_health(), HEALTH_TIMEOUT_S)
    except Exception as e:
        raise HTTPException(503, f"engine not answering: {type(e).__name__}") from e
    return HealthResponse(status="ok")


@serve(router, routes.READY)
async def ready(request: Request) -> HealthResponse:
    state = services(request)
    if state.draining:
        raise HTTPException(503, "shutting down")
    if not state.ready:
        raise HTTPException(503, state.not_ready_reason)
    gate = state.started_engine().gate
    if gate.broken is not None:  # a load failed mid-commit: unusable until a push succeeds
        raise HTTPException(503, gate.broken)
    if gate.version in gate.suspect:  # out of rotation until a push passes its probe
        raise HTTPException(503, gate.suspect[gate.version])
    return HealthResponse(status="ok")


@serve(router, routes.INFO)
async def info(request: Request) -> InfoResponse:
    engine = services(request).engine
    if engine is None or engine.info is None:
        raise HTTPException(503, "engine not started")
    return InfoResponse(
        model=engine.info.model,
        dtype=engine.info.dtype,
        lm_head_dtype=engine.info.lm_head_dtype,
        max_model_len=engine.info.max_model_len,
        vocab_size=engine.info.vocab_size,
        weight_version=engine.gate.version,
        boot_id=engine.boot_id,
        num_parameters=engine.index.num_parameters,
        commit_policy=services(request).settings.commit_policy,
        transports=transports(),
        logprobs_mode=engine.info.logprobs_mode,
        quantization=engine.info.quantization,
        drafter=engine.drafter.status(engine.gate.version) if engine.drafter else None,
    )
