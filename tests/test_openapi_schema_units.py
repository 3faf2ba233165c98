"""The published /openapi.json says what the server checks, in JSON Schema's
own words: a constraint pydantic could not place (`Field(ge=0)` on an
optional annotated type renders a raw `ge`) is invisible to clients and
fuzzers, which then send what the server refuses (schemathesis caught
`max_version_lag` that way). Built from the app without an engine."""

from __future__ import annotations

from typing import Any

from rollout_sidecar.server import app
from rollout_sidecar.server.config import ServerSettings

# pydantic's names, which JSON Schema spells minimum, maximum, exclusiveMinimum, ...
RAW = {"ge", "le", "gt", "lt"}


def _raw_keys(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        found = [f"{path}/{k}" for k in node if k in RAW and not isinstance(node[k], dict)]
        for k, v in node.items():
            if k != "properties":
                found += _raw_keys(v, f"{path}/{k}")
            else:  # property names may be anything, "ge" included
                for name, sub in v.items():
                    found += _raw_keys(sub, f"{path}/properties/{name}")
        return found
    if isinstance(node, list):
        return [f for i, v in enumerate(node) for f in _raw_keys(v, f"{path}/{i}")]
    return []


def test_the_published_schema_uses_json_schema_keywords_only():
    schema = app.create_app(ServerSettings(admin_token="a" * 16, api_token="b" * 16)).openapi()
    assert schema["paths"], "no routes"
    assert _raw_keys(schema) == []
