"""Run the app under uvicorn, with a SIGTERM that drains before exiting."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.main import STARTUP_FAILURE

from rollout_sidecar.server.app import create_app
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.listeners import open_listeners
from rollout_sidecar.server.model.model_source import check_max_model_len, resolve_model

log = logging.getLogger("rollout_sidecar.server")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: new requests get 503 at once, in-flight ones finish
    (up to `drain_timeout_s`), then the engine shuts down."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = services(self._app)
        if not state.draining:
            log.info("signal %s: draining in-flight requests", sig)
        state.draining = True
        super().handle_exit(sig, frame)


def run_server(settings: ServerSettings) -> None:
    """Hold both ports and resolve and check the model first (errors name the
    flag, before any engine starts), then serve."""
    listeners = open_listeners(settings)
    path = resolve_model(settings)
    check_max_model_len(path, settings)
    app = create_app(settings, model_path=path, listeners=listeners)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s), access_log=False,
    )
    # asyncio listens on the bound socket when uvicorn starts serving.
    server = DrainingServer(config, app)
    server.run(sockets=[listeners.http])
    if not server.started:  # the app's startup failed (logged): as uvicorn.run exits
        raise SystemExit(STARTUP_FAILURE)
