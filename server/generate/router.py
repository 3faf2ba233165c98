"""POST /generate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rollout_sidecar.protocol.schema import GenerateRequest, routes
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.auth import serve

router = APIRouter()
DISCONNECT_POLL_S = 0.5


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client goes away: a client that gave up
    must not keep the engine busy (the engine aborts its sequences)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                # Nobody reads this; 499 is the nginx convention for "client closed".
                return JSONResponse({"error": "client disconnected"}, status_code=499)
    finally:
        task.cancel()


@serve(router, routes.GENERATE)
async def generate(body: GenerateRequest, request: Request) -> Any:
    return await until_disconnected(request,
                                    services(request).started_generator().generate(body))
