"""What the app holds, typed. Routers and the front door reach the server's
services through `services(request)` (or the app's), never by reading
attributes off Starlette's untyped `app.state` bag: a reader and a type
checker see what each route uses, and a service that is not started yet
is a 503 named in one place.

Built by `create_app` (settings, metrics, the peer answerer, the boot id);
the engine and the features on it are set by the lifespan once the engine
started; `ready`, `not_ready_reason` and `draining` change while it serves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from rollout_sidecar.server.errors import ServiceUnavailable

if TYPE_CHECKING:
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.engine.lifecycle import GenerationEngine
    from rollout_sidecar.server.generate.service import GenerateService
    from rollout_sidecar.server.metrics.collectors import ServerMetrics
    from rollout_sidecar.server.skyrl_api.delta_sync import DeltaSync
    from rollout_sidecar.server.weights.peer_auth import PeerAnswerer
    from rollout_sidecar.server.weights.service import WeightService

LOADING = "the engine is still loading"


@dataclass
class Services:
    settings: ServerSettings
    metrics: ServerMetrics
    peer_answerer: PeerAnswerer
    boot_id: str
    # Set once the engine started (app.py's lifespan).
    engine: GenerationEngine | None = None
    generator: GenerateService | None = None
    weights: WeightService | None = None
    openai: Any = None  # vLLM's OpenAI serving state (openai_api/compat.py)
    # SkyRL's delta sync, made at its first weight call; its calls run one at a time.
    skyrl: DeltaSync | None = None
    skyrl_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ready: bool = False
    not_ready_reason: str = "model loading"
    draining: bool = False
    # Why generation is refused though the engine serves (the front door's
    # 503): catching up from a peer, or a catch-up that failed while a peer
    # served a newer version, until a push commits (weights/peer_copy.py).
    serving_held: str | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)  # held until they end
    # When the front door last passed an admin call (time.monotonic()): a
    # drain waits for a quiet second (drain/router.py).
    last_push_call: float = 0.0

    def started_engine(self) -> GenerationEngine:
        if self.engine is None:
            raise ServiceUnavailable(LOADING)
        return self.engine

    def started_generator(self) -> GenerateService:
        if self.generator is None:
            raise ServiceUnavailable(LOADING)
        return self.generator

    def started_weights(self) -> WeightService:
        if self.weights is None:
            raise ServiceUnavailable(LOADING)
        return self.weights


def services(of: Request | FastAPI) -> Services:
    """The app's services, from a request or the app itself."""
    app = of.app if isinstance(of, Request) else of
    return app.state.services
