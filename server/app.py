"""The FastAPI app: lifespan (engine start/stop), error shapes, metrics, drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_sidecar.server.app_state import Services, services
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.drain import router as drain
from rollout_sidecar.server.engine.lifecycle import GenerationEngine
from rollout_sidecar.server.engine.version_gate import MinVersionTimeout
from rollout_sidecar.server.errors import BadRequest, PushConflict, ServiceUnavailable
from rollout_sidecar.server.front_door import FrontDoor
from rollout_sidecar.server.generate import router as generate
from rollout_sidecar.server.generate.service import GenerateService
from rollout_sidecar.server.generate.warmup import warm_up
from rollout_sidecar.server.health import router as health
from rollout_sidecar.server.listeners import Listeners
from rollout_sidecar.server.metrics import router as metrics
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.model.model_source import resolve_model
from rollout_sidecar.server.openai_api import router as openai_api
from rollout_sidecar.server.openai_api.compat import build_state
from rollout_sidecar.server.openapi import install_openapi
from rollout_sidecar.server.skyrl_api import router as skyrl_api
from rollout_sidecar.server.weights import router as weights
from rollout_sidecar.server.weights.peer_auth import PeerAnswerer
from rollout_sidecar.server.weights.service import WeightService

log = logging.getLogger("rollout_sidecar.server")


def _error(status: int, message: str, field: str | None = None, detail: list | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field, "detail": detail},
                        status_code=status, headers=headers)


CATCHING_UP = "catching up from a peer"


def _after_catch_up(app: FastAPI, engine: GenerationEngine, held: str | None) -> None:
    """Ready once the catch-up ended, unless it failed behind the fleet
    (`held`, peer_copy.py): then once a push commits."""
    state = services(app)
    if held is None:
        state.ready, state.serving_held = True, None
        log.info("ready: weight_version=%d (after the catch-up from a peer)",
                 engine.gate.version)
        return
    state.serving_held = state.not_ready_reason = held
    log.warning("not ready: %s", held)

    async def serve_after_push(published: int) -> None:
        await engine.gate.wait_published(published)
        state.ready, state.serving_held = True, None
        log.info("ready: weight_version=%d (after a push)", engine.gate.version)

    state.tasks.add(task := asyncio.get_running_loop().create_task(
        serve_after_push(engine.gate.published)))
    task.add_done_callback(state.tasks.discard)


def create_app(settings: ServerSettings, model_path: Path | None = None,
               listeners: Listeners | None = None) -> FastAPI:
    """`model_path`: the checkpoint, if the caller resolved it already (see
    model_source.py). `listeners`: the ports `serve` holds (listeners.py); the
    data plane binds its own without.

    The composition root: the engine first, then each feature on it (engine
    <- generate, engine <- weights; the probe's scorer is handed over here)."""
    app_metrics = ServerMetrics()
    boot_id = uuid.uuid4().hex[:12]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        path = model_path or resolve_model(settings)
        log.info("loading %s (boot %s)", path, boot_id)
        engine = GenerationEngine(settings, path, app_metrics, boot_id)
        state = services(app)
        # Every error path below releases what was started: engine processes, port.
        with contextlib.ExitStack() as stack:
            stack.callback(engine.shutdown)
            await engine.start()
            state.openai = await build_state(engine, settings.openai_args)
            # First-request costs paid now, not by a trainer's first step.
            await warm_up(engine)
            state.engine = engine
            state.generator = generator = GenerateService(engine)
            state.weights = weights = WeightService(engine, generator, settings, app_metrics,
                                                    boot_id)
            await weights.start(listeners.take_data_plane_fd() if listeners else None)
            stack.callback(weights.plane.stop)
            catching_up = weights.peer_copy.start()  # --peers: once serving
            if catching_up is None:
                state.ready = True
                log.info("ready: weight_version=%d", engine.gate.version)
            else:
                state.not_ready_reason = state.serving_held = CATCHING_UP
                catching_up.add_done_callback(lambda _: _after_catch_up(
                    app, engine, weights.peer_copy.held))
            try:
                yield
            finally:
                state.ready = False
                for task in state.tasks:
                    task.cancel()
                await weights.stop()

    app = FastAPI(title="rollout-sidecar", version="0.1.0", lifespan=lifespan)
    app.state.services = Services(settings, app_metrics, PeerAnswerer(
        settings.admin_token.get_secret_value() if settings.admin_token else None), boot_id)
    for module in (generate, openai_api, skyrl_api, health, drain, metrics, weights):
        app.include_router(module.router)
    install_openapi(app)

    app.add_middleware(FrontDoor, state=services(app), routes=app.router.routes)

    @app.exception_handler(RequestValidationError)
    async def on_malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(422, f"{field or 'body'}: {first.get('msg', 'invalid')}", field,
                      [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                       for e in errors])

    @app.exception_handler(BadRequest)
    async def on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), exc.field)

    @app.exception_handler(MinVersionTimeout)
    async def on_version_timeout(_: Request, exc: MinVersionTimeout) -> JSONResponse:
        # Retry-After: when this replica may hold the version; the client asks another now.
        return _error(409, str(exc), "min_weight_version",
                      headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(PushConflict)
    async def on_push_conflict(_: Request, exc: PushConflict) -> JSONResponse:
        retry = exc.retry_after_s
        return _error(409, str(exc), headers=None if retry is None else
                      {"Retry-After": str(max(1, math.ceil(retry)))})

    @app.exception_handler(ServiceUnavailable)
    async def on_unavailable(_: Request, exc: ServiceUnavailable) -> JSONResponse:
        return _error(503, str(exc), headers={"Retry-After": "5"})

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    return app
