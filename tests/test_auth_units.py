"""The bearer checks (server/auth.py): a token as a Bearer token, or as the
password of HTTP Basic auth (clients that carry credentials only in
~/.netrc, as SkyRL's weight client); anything else is a 401."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from pydantic import SecretStr
from starlette.requests import Request

from rollout_sidecar.server.auth import require_admin_token

TOKEN = "admin-secret"


def request(authorization: str | None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    app = SimpleNamespace(state=SimpleNamespace(settings=SimpleNamespace(
        admin_token=SecretStr(TOKEN))))
    return Request({"type": "http", "headers": headers, "app": app})


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", basic("skyrl", TOKEN),
                                    basic("", TOKEN)])
def test_the_token_as_bearer_or_basic_password_passes(header):
    require_admin_token(request(header))


@pytest.mark.parametrize("header", [None, "Bearer nope", basic(TOKEN, "nope"),
                                    "Basic !!notbase64", f"Token {TOKEN}"])
def test_anything_else_is_a_401(header):
    with pytest.raises(HTTPException) as e:
        require_admin_token(request(header))
    assert e.value.status_code == 401
