"""Bearer-token checks. Two tokens: one for generation, one for the admin and
weight routes, so a rollout worker that can sample can never push weights.
A token is also taken as the password of HTTP Basic auth, for clients that
carry credentials only in ~/.netrc (SkyRL's weight-sync client: requests
reads it)."""

from __future__ import annotations

import base64
import secrets

from fastapi import HTTPException, Request, status
from pydantic import SecretStr


def _check(request: Request, expected: SecretStr | None, *, required: bool, what: str) -> None:
    if expected is None:
        if required:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"{what} routes are disabled: set ROLLOUT_SIDECAR_ADMIN_TOKEN on the server",
            )
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "basic":  # the password (clients that read ~/.netrc: SkyRL's)
        try:
            token = base64.b64decode(token, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            token = ""
    # compare_digest: no timing side channel on the token's prefix.
    if scheme.lower() not in ("bearer", "basic") or not secrets.compare_digest(
        token.encode(), expected.get_secret_value().encode()
    ):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            f"missing or wrong bearer token for {what} routes",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_api_token(request: Request) -> None:
    _check(request, request.app.state.settings.api_token, required=False, what="generate")


def require_admin_token(request: Request) -> None:
    _check(request, request.app.state.settings.admin_token, required=True, what="weights")
