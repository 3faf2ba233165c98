"""Every request passes here before the app reads a byte of its body: find
the route, authenticate, bound the body, refuse new work while draining or
catching up; then measure it. Plain ASGI
middleware.

Why here and not in FastAPI's dependencies: FastAPI reads and parses a body
before a route's dependencies run, so a 256 MiB body with no token was read
and parsed before its 401 (the API process grew 1.5 GiB and /health stalled
for seconds). Here the Authorization header is checked first and the body
is counted as it arrives: over its route's limit it is a 413, from the
Content-Length before anything is read, or from the byte that crosses it.

Not Starlette's `BaseHTTPMiddleware`: that one wraps the receive channel, so
an endpoint never sees `http.disconnect` and could not cancel the work of a
client that went away (generate/router.py).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from fastapi import HTTPException
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.server.auth import Access, authorize, route_access

if TYPE_CHECKING:
    from rollout_sidecar.server.app_state import Services

# Draining (SIGTERM, or POST /drain: drain/router.py), a replica takes no new
# work: generation and the peers' and trainers' status reads (a trainer's next
# push starts there, and goes on without it) get 503. A push already begun
# (the other admin routes), probes and scrapes go on.
CLOSED_WHILE_DRAINING = {Access.API, Access.PEER}
# Catching up from a peer (weights/peer_copy.py), a replica serves no
# generation: what it holds is older than the fleet's version.
CLOSED_WHILE_CATCHING_UP = {Access.API}
# Routes that bound their own body (the bucket route: its manifest entry's
# size, weights/router.py). Open routes take a small one at most (probes
# send none; the peer challenge, a nonce): no credential buys a large read.
OWN_LIMIT = {routes.BUCKET.path}
SMALL_BODY = 4096


class BodyTooLarge(HTTPException):
    """413; the connection closes after it, so the rest is never read."""

    def __init__(self, limit: int, setting: str = "max_request_bytes") -> None:
        super().__init__(413, f"request body over {limit} bytes (the server's {setting})",
                         headers={"connection": "close"})


def route_of(routes: list[BaseRoute], scope: Scope) -> BaseRoute | None:
    """The route that serves `scope` (a full match: path and method), else None."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
    return None


def body_limit(route: BaseRoute, default: int) -> int | None:
    """The most bytes a request body may carry on `route` (None: the route
    bounds its own)."""
    if getattr(route, "path", None) in OWN_LIMIT:
        return None
    if not isinstance(route, APIRoute) or route_access(route) is Access.OPEN:
        return SMALL_BODY
    return default


class FrontDoor:
    def __init__(self, app: ASGIApp, state: Services, routes: list[BaseRoute]) -> None:
        self.app = app
        self.state = state  # the app's services: settings, draining flag, metrics
        self.routes = routes  # the app's own route table (app.router.routes)
        # id(route) -> (its access, its body limit): read off the route once.
        self._rules: dict[int, tuple[Access, int | None]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_of(self.routes, scope)
        access, limit = self._rules_of(route) if route is not None else (None, None)
        state = self.state
        label = getattr(route, "path", "other") if route is not None else "other"
        metrics = self.state.metrics
        status = {"code": 500}

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        t0 = time.perf_counter()
        try:
            if access is not None:  # a 404 or 405 reads no body
                refused = self._refusal(access, limit, scope)
                if refused is not None:
                    status["code"] = refused.status_code
                    return await _answer(send, refused.status_code, str(refused.detail),
                                         refused.headers)
                if access is Access.ADMIN:
                    state.last_push_call = time.monotonic()
            closed = self._closed(access)  # after the credential: a 401 stays a 401
            if closed is not None:
                status["code"] = 503
                return await _answer(send, 503, *closed)
            await self.app(scope, receive if limit is None else _bounded(receive, limit),
                           send_and_note)
        finally:  # counted even when the app raised (Starlette answers 500)
            metrics.latency.labels(label).observe(time.perf_counter() - t0)
            metrics.requests.labels(label, str(status["code"])).inc()

    def _closed(self, access: Access | None) -> tuple[str, dict[str, str]] | None:
        """Why this request is refused as new work, and its Retry-After: the
        replica drains, or it does not serve yet (module constants)."""
        state = self.state
        if state.draining and (access is None or access in CLOSED_WHILE_DRAINING):
            return "server is shutting down", {"retry-after": "5"}
        if state.serving_held is not None and access in CLOSED_WHILE_CATCHING_UP:
            return f"not serving yet: {state.serving_held}", {"retry-after": "1"}
        return None

    def _rules_of(self, route: BaseRoute) -> tuple[Access, int | None]:
        rules = self._rules.get(id(route))
        if rules is None:  # undeclared: closed, as an admin route
            access = (route_access(route) or Access.ADMIN) if isinstance(route, APIRoute) \
                else Access.OPEN
            rules = self._rules[id(route)] = (
                access, body_limit(route, self.state.settings.max_request_bytes))
        return rules

    def _refusal(self, access: Access, limit: int | None, scope: Scope) -> HTTPException | None:
        """The 401/403/413 this request gets before its body is read, if any."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        try:
            authorize(access, headers, self.state.settings,
                      self.state.peer_answerer, scope["method"],
                      scope["path"])
        except HTTPException as e:
            return e
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            return HTTPException(400, "Content-Length is not a number")
        if limit is not None and declared > limit:
            return BodyTooLarge(limit)
        return None


def _bounded(receive: Receive, limit: int) -> Receive:
    """`receive`, refusing the body once more than `limit` bytes came
    (a chunked body, or one longer than it said)."""
    seen = 0

    async def receive_bounded() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return receive_bounded


async def _answer(send: Send, code: int, error: str, headers: dict[str, str] | None = None
                  ) -> None:
    """A refusal before the body was read. `Connection: close`: the unread
    body is still on the connection, so the client must not reuse it."""
    body = json.dumps({"error": error, "field": None, "detail": None}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": code, "headers": [
        (b"content-type", b"application/json"), (b"connection", b"close"),
        (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})
