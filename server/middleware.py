"""Drain and measure every request, as plain ASGI middleware.

Not Starlette's `BaseHTTPMiddleware`: that one wraps the receive channel, so
an endpoint never sees `http.disconnect` and could not cancel the work of a
client that went away (generate/router.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

# Probes and scrapes keep answering while draining; everything else gets 503.
ALWAYS_OPEN = {"/health", "/ready", "/metrics"}
ROUTES = {"/generate", "/health", "/ready", "/info", "/metrics", "/weights/connect",
          "/weights/disconnect", "/weights/begin", "/weights/prepare", "/weights/commit",
          "/weights/abort", "/weights/status", "/weights/index", "/weights/probe",
          "/v1/completions", "/v1/chat/completions", "/v1/models"}


class DrainAndMeasure:
    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state  # the FastAPI app's state: draining flag, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.state.draining and path not in ALWAYS_OPEN:
            return await _refuse(send)
        metrics = self.state.metrics
        route = path if path in ROUTES else "other"
        status = {"code": 500}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_note)
        finally:  # counted even when the app raised (Starlette answers 500)
            metrics.latency.labels(route).observe(time.perf_counter() - t0)
            metrics.requests.labels(route, str(status["code"])).inc()


async def _refuse(send: Any) -> None:
    body = json.dumps({"error": "server is shutting down", "field": None,
                       "detail": None}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"retry-after", b"5"),
        (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
