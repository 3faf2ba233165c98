"""Who may call a route. Two tokens: one for generation, one for the admin and
weight routes, so a rollout worker that can sample can never push weights.
A token is also taken as the password of HTTP Basic auth, for clients that
carry credentials only in ~/.netrc (SkyRL's weight-sync client: requests
reads it). A replica catching up from a peer proves it holds the admin token
without sending it (weights/peer_auth.py): the peer routes take that proof
or the admin token.

Every route's `Access` is its row in the shared route table
(protocol/schema/routes.py); `serve(router, ROUTE)` declares the handler
with the dependency below that checks it. The front door (front_door.py)
reads that declaration off the app's routes and checks it before a byte of
the body is read; the dependency checks again for an app served without it
(unit tests). An empty credential never
matches: an empty token is refused at start (config.py), and an empty
Bearer or Basic password is a 401 whatever the server holds.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.routing import APIRoute

from rollout_sidecar.protocol.schema.routes import Access, Route
from rollout_sidecar.server.app_state import services

if TYPE_CHECKING:
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.weights.peer_auth import PeerAnswerer


def credential(headers: Mapping[str, str]) -> tuple[str, str]:
    """(scheme, credential) of the Authorization header, lower-case scheme;
    HTTP Basic gives its password. ("", "") when there is none."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == "basic":  # the password (clients that read ~/.netrc: SkyRL's)
        try:
            value = base64.b64decode(value, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            value = ""
    return scheme, value


def _matches(value: str, expected: str) -> bool:
    # compare_digest: no timing side channel on the token's prefix. An empty
    # credential never matches, whatever the server holds.
    return bool(value) and bool(expected) and secrets.compare_digest(
        value.encode(), expected.encode())


def _unauthorized(what: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED,
                         f"missing or wrong bearer token for {what} routes",
                         headers={"WWW-Authenticate": "Bearer"})


def authorize(access: Access, headers: Mapping[str, str], settings: ServerSettings,
              peers: PeerAnswerer | None = None, method: str = "GET", path: str = "") -> None:
    """Raise the 401 (or 403: weight routes off) `access` calls for."""
    if access is Access.OPEN:
        return
    scheme, value = credential(headers)
    if access is Access.API:
        if settings.api_token is None:
            return
        if scheme in ("bearer", "basic") and _matches(value, settings.api_token.get_secret_value()):
            return
        raise _unauthorized("generate")
    if settings.admin_token is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "weight routes are disabled: set "
                            "ROLLOUT_SIDECAR_ADMIN_TOKEN on the server")
    admin = settings.admin_token.get_secret_value()
    if scheme in ("bearer", "basic") and _matches(value, admin):
        return
    if access is Access.PEER and scheme == "peer" and peers is not None \
            and peers.verify(value, method, path):
        return
    raise _unauthorized("weights")


def _check(request: Request, access: Access) -> None:
    state = services(request)
    authorize(access, request.headers, state.settings, state.peer_answerer,
              request.method, request.url.path)


def require_api_token(request: Request) -> None:
    _check(request, Access.API)


def require_admin_token(request: Request) -> None:
    _check(request, Access.ADMIN)


def require_admin_or_peer(request: Request) -> None:
    _check(request, Access.PEER)


def open_route(request: Request) -> None:
    """Declares a route open on purpose (probes, scrapes, the peer challenge)."""


_DECLARED: dict[Callable[..., Any], Access] = {
    require_api_token: Access.API, require_admin_token: Access.ADMIN,
    require_admin_or_peer: Access.PEER, open_route: Access.OPEN}


def route_access(route: APIRoute) -> Access | None:
    """What the route declared (its own or its router's dependency); None
    if it declared nothing, which the route table test refuses."""
    pending = list(route.dependant.dependencies)
    while pending:
        dep = pending.pop()
        if dep.call in _DECLARED:
            return _DECLARED[dep.call]
        pending.extend(dep.dependencies)
    return None


_CHECK = {access: check for check, access in _DECLARED.items()}


def serve(router: APIRouter, route: Route) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator of `route`'s handler: its method, path, access check,
    answer model and schema listing, all off the route table."""
    kw: dict[str, Any] = {} if route.response is None else {"response_model": route.response}
    return router.api_route(route.path, methods=[route.method],
                            dependencies=[Depends(_CHECK[route.access])],
                            include_in_schema=route.in_schema, **kw)
