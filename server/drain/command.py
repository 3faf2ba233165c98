"""`rollout-sidecar drain`: a replica's leave from inside its pod (a
Kubernetes preStop hook), before the SIGTERM that stops it.

It asks the server to drain (`POST /drain`: no new work, what it holds
finished, a push begun run to its end; drain/router.py), waits for the
answer, and then at least `min_s` from its start, the time a Service's
endpoints need to drop the pod (the chart's `preStopSleepSeconds`). Always
exits 0: a preStop that fails gets the container killed, and a server that
does not answer has nothing left to drain.
"""

from __future__ import annotations

import os
import time

import httpx
import typer

from rollout_sidecar.protocol.calls.tls import shared_tls
from rollout_sidecar.protocol.schema import DrainRequest, DrainResponse, routes
from rollout_sidecar.protocol.schema.endpoints import auth_headers

ANSWER_MARGIN_S = 30.0  # beyond the server's own wait, for its answer to come


def drain_replica(url: str, timeout_s: float, min_s: float) -> DrainResponse | None:
    """Drain the server at `url` (token: $ROLLOUT_SIDECAR_ADMIN_TOKEN); its
    answer, or None if it did not give one."""
    t0 = time.monotonic()
    answer = None
    try:
        r = httpx.post(url.rstrip("/") + routes.DRAIN.path,
                       json=routes.DRAIN.body(DrainRequest(timeout_s=timeout_s)),
                       headers=auth_headers(os.environ.get("ROLLOUT_SIDECAR_ADMIN_TOKEN")),
                       timeout=timeout_s + ANSWER_MARGIN_S, verify=shared_tls())
        if r.is_success:
            answer = DrainResponse.model_validate(r.json())
            typer.echo(f"drain: {answer.model_dump_json()}")
        else:
            typer.echo(f"drain: {url} answered {r.status_code}: {r.text[:300]}", err=True)
    except httpx.HTTPError as e:
        typer.echo(f"drain: {url} did not answer ({type(e).__name__}: {e}): nothing to drain",
                   err=True)
    time.sleep(max(0.0, min_s - (time.monotonic() - t0)))
    return answer
