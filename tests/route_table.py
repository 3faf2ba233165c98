"""The app's own route table, as the tests walk it: every route the server
serves, with the access it declares (server/auth.py) and a concrete request
for it (path parameters filled in). Built from `create_app` without starting
the engine, so a route added anywhere is in it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.routing import APIRoute

from rollout_sidecar.server.auth import Access, route_access

# Routes that take no credential, on purpose: probes, scrapes, the peer
# challenge, FastAPI's own schema and docs pages. A route that is not here
# must declare api, admin or peer access.
OPEN = {"/health", "/ready", "/metrics", "/weights/peer/challenge", "/openapi.json", "/docs",
        "/docs/oauth2-redirect", "/redoc"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # the template, e.g. /weights/staged/{index}
    access: Access | None  # None: declared nothing

    @property
    def url_path(self) -> str:
        return re.sub(r"\{[^}]+\}", "0", self.path)


def served_routes() -> list[Route]:
    from pydantic import SecretStr

    from rollout_sidecar.server.app import create_app
    from rollout_sidecar.server.config import ServerSettings

    app = create_app(ServerSettings(admin_token=SecretStr("route-table-admin"),
                                    api_token=SecretStr("route-table-api")))
    out = []
    for r in app.routes:
        methods = sorted(getattr(r, "methods", None) or ["GET"])
        access = route_access(r) if isinstance(r, APIRoute) else Access.OPEN
        out += [Route(m, r.path, access) for m in methods if m != "HEAD"]
    return out
