"""`POST /drain`: a replica's leave, before its process stops.

A replica leaving a fleet (a Kubernetes preStop, `rollout-sidecar drain`;
docs/replicas.md, "A fleet that changes") must not take new work, must finish
what it holds, and must not break a push. From the call on, the front door
refuses generation (503 with Retry-After: clients retry another replica) and
`/weights/status` (503: a trainer's next push goes on without this replica,
trainer/control/serving_state.py), while a push already begun runs to its
end: its buckets, prepare, commit and probe still pass. The call returns once
nothing is in flight (no request, no push) and no push call came for
`QUIET_S` (the probe follows a commit at once), or when its wait runs out;
SIGTERM then stops the process with nothing left to cut. Draining cannot be
undone: a drained replica is restarted, not resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request

from rollout_sidecar.protocol.schema import DrainRequest, DrainResponse, routes
from rollout_sidecar.server.app_state import Services, services
from rollout_sidecar.server.auth import serve

router = APIRouter()
log = logging.getLogger(__name__)

QUIET_S = 1.0
POLL_S = 0.05


@serve(router, routes.DRAIN)
async def drain(req: DrainRequest, request: Request) -> DrainResponse:
    state = services(request)
    if not state.draining:
        log.info("drain: this replica takes no new work and finishes what it holds")
    state.draining = True
    t0 = time.monotonic()
    busy_at = t0  # the last moment work was in flight or a push call came
    while True:
        requests, push = in_flight(state)
        now = time.monotonic()
        if requests or push:
            busy_at = now
        busy_at = max(busy_at, state.last_push_call)
        if now - busy_at >= QUIET_S:
            break
        if now - t0 >= req.timeout_s:
            log.warning("drain: %.0fs passed with %d requests and push %s in flight",
                        req.timeout_s, requests, push)
            return DrainResponse(drained=False, waited_s=round(now - t0, 3),
                                 requests_in_flight=requests, push_in_flight=push)
        await asyncio.sleep(POLL_S)
    waited = round(time.monotonic() - t0, 3)
    log.info("drain: nothing in flight after %.1fs", waited)
    return DrainResponse(drained=True, waited_s=waited, requests_in_flight=0)


def in_flight(state: Services) -> tuple[int, str | None]:
    """Generation requests admitted and not finished, and the push running."""
    engine, weights = state.engine, state.weights
    requests = engine.gate.in_flight if engine is not None else 0
    current = weights.session.current if weights is not None else None
    return requests, current.push_id if current is not None else None
