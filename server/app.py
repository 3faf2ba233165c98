"""The FastAPI app: lifespan (engine start/stop), error shapes, metrics, drain."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.engine import BadRequest, GenerationEngine
from rollout_sidecar.server.metrics import ServerMetrics
from rollout_sidecar.server.routes import generate, health, metrics, weights
from rollout_sidecar.server.version_gate import MinVersionTimeout
from rollout_sidecar.server.weights.service import TRANSPORTS, PushConflict, WeightService

log = logging.getLogger("rollout_sidecar.server")

# Probes and scrapes keep answering while draining; everything else gets 503.
_ALWAYS_OPEN = {"/health", "/ready", "/metrics"}


def resolve_model(settings: ServerSettings) -> Path:
    if settings.model:
        path = Path(settings.model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"--model {path}: no config.json; give a local HF checkpoint")
        return path
    from rollout_sidecar.server.default_model import ensure_default_model

    return ensure_default_model(settings.cache_dir)


EngineFactory = Callable[[ServerSettings, Path, ServerMetrics], Any]


def create_app(settings: ServerSettings, engine_factory: EngineFactory | None = None) -> FastAPI:
    """`engine_factory` exists for unit tests that say they use a fake engine."""
    factory = engine_factory or GenerationEngine
    app_metrics = ServerMetrics()

    def mark_broken(reason: str) -> None:
        app.state.ready = False
        app.state.not_ready_reason = reason

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model_path = resolve_model(settings)
        log.info("loading %s", model_path)
        engine = factory(settings, model_path, app_metrics)
        await engine.start()
        app.state.engine = engine
        app.state.weights = WeightService(engine, settings, app_metrics, mark_broken)
        await app.state.weights.start()
        app.state.ready = True
        log.info("ready: weight_version=%d", engine.gate.version)
        try:
            yield
        finally:
            app.state.ready = False
            await app.state.weights.stop()
            engine.shutdown()

    app = FastAPI(title="rollout-sidecar", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = app_metrics
    app.state.engine = None
    app.state.ready = False
    app.state.not_ready_reason = "model loading"
    app.state.draining = False
    app.state.transports = TRANSPORTS
    for module in (generate, health, metrics, weights):
        app.include_router(module.router)

    @app.middleware("http")
    async def drain_and_measure(request: Request, call_next: Callable) -> Any:
        path = request.url.path
        if app.state.draining and path not in _ALWAYS_OPEN:
            return JSONResponse({"error": "server is shutting down"}, status_code=503,
                                headers={"Retry-After": "5"})
        route = path if path in _ROUTES else "other"
        t0 = time.perf_counter()
        response = await call_next(request)
        app_metrics.latency.labels(route).observe(time.perf_counter() - t0)
        app_metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def on_malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(
            {"error": f"{field or 'body'}: {first.get('msg', 'invalid')}", "field": field,
             "detail": [{"loc": list(e["loc"]), "msg": e["msg"]} for e in errors]},
            status_code=422,
        )

    @app.exception_handler(BadRequest)
    async def on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=400)

    @app.exception_handler(MinVersionTimeout)
    async def on_version_timeout(_: Request, exc: MinVersionTimeout) -> JSONResponse:
        return JSONResponse({"error": str(exc), "field": "min_weight_version"}, status_code=409)

    @app.exception_handler(PushConflict)
    async def on_push_conflict(_: Request, exc: PushConflict) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=409)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    return app


_ROUTES = {"/generate", "/health", "/ready", "/info", "/metrics", "/weights/connect",
           "/weights/begin", "/weights/commit", "/weights/abort", "/weights/status",
           "/weights/index", "/weights/verify"}
