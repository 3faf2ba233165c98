"""The OpenAPI document, describing what the server really answers: the error
shape `{error, field, detail}` (not FastAPI's default 422 body), every status
a route can give, `/metrics` as Prometheus text, and the two bearer tokens,
each route's as it declares its access (server/auth.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from rollout_sidecar.protocol.schema import ErrorResponse, routes
from rollout_sidecar.server.auth import Access, route_access

_WHY = {
    "400": "The request is well-formed but cannot be served; `field` names the culprit "
           "(a value out of range, a prompt longer than max_model_len, a bad manifest).",
    "401": "Missing or wrong bearer token.",
    "403": "Weight routes are disabled: the server has no admin token.",
    "409": "Conflicts with the server's state: min_weight_version not reached in time, "
           "another push or trainer, a stale version, a finished push.",
    "413": "The body is over the server's max_request_bytes (a bucket: over its manifest "
           "entry); refused before it is read.",
    "422": "The body does not match the schema; `detail` lists every error.",
    "503": "Not ready: starting, shutting down (Retry-After), or the weights are unusable "
           "after a failed load until a push succeeds.",
}
_PROBES = {routes.HEALTH.path, routes.READY.path}
_ERRORS = {routes.GENERATE.path: ["400", "401", "409", "413", "422", "503"],
           routes.INFO.path: ["401", "503"], routes.PEER_CHALLENGE.path: ["400", "413", "422"]}
_ADMIN_ERRORS = ["400", "401", "403", "409", "413", "422", "503"]
_SECURITY: dict[Access, list[dict[str, list]]] = {
    Access.API: [{"apiToken": []}, {}], Access.ADMIN: [{"adminToken": []}],
    Access.PEER: [{"adminToken": []}]}


def _errors(path: str) -> list[str]:
    if path in _PROBES:
        return ["503"]
    if path in _ERRORS:
        return _ERRORS[path]
    if path.startswith("/weights/"):
        return _ADMIN_ERRORS
    return []


def build(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="A vLLM generation server for RL post-training.")
    comps = schema.setdefault("components", {})
    models = comps.setdefault("schemas", {})
    error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    models.update(error.pop("$defs", {}))
    models["ErrorResponse"] = error
    for unused in ("HTTPValidationError", "ValidationError"):
        models.pop(unused, None)
    comps["securitySchemes"] = {
        "apiToken": {"type": "http", "scheme": "bearer", "description":
                     "ROLLOUT_SIDECAR_API_TOKEN, for generation (open when the server has "
                     "none)."},
        "adminToken": {"type": "http", "scheme": "bearer", "description":
                       "ROLLOUT_SIDECAR_ADMIN_TOKEN, for the weight routes."},
    }
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    access = {r.path: route_access(r) for r in app.routes if isinstance(r, APIRoute)}
    for path, ops in schema["paths"].items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code in _errors(path):
                responses[code] = {"description": _WHY[code], "content": ref}
            if (security := _SECURITY.get(access.get(path))) is not None:  # type: ignore[arg-type]
                op["security"] = security
    schema["paths"][routes.METRICS.path]["get"]["responses"]["200"] = {
        "description": "Prometheus text exposition format.",
        "content": {"text/plain": {"schema": {"type": "string"}}}}
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
