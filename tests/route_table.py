"""The app's routes as it serves them, as the tests walk them: every route,
with the access it declares (server/auth.py) and a concrete request for it
(path parameters filled in). Built from `create_app` without starting the
engine, so a route added anywhere is in it, whether or not the shared table
(protocol/schema/routes.py) lists it: tests/test_route_table_units.py holds
the two to each other."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.routing import APIRoute

from rollout_sidecar.protocol.schema.routes import ROUTES
from rollout_sidecar.server.auth import Access, route_access

# FastAPI's own schema and docs pages: open, and not in the shared table.
FASTAPI_PAGES = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
# Routes that take no credential, on purpose: probes, scrapes, the peer
# challenge (the table's open rows), and FastAPI's pages.
OPEN = {r.path for r in ROUTES if r.access is Access.OPEN} | FASTAPI_PAGES


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
