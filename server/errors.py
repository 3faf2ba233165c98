"""Errors the server answers on purpose, each with its status code. The app
maps them to `{error, field, detail}` (protocol/schema/generate_api.py: ErrorResponse)."""

from __future__ import annotations


class BadRequest(ValueError):
    """400: a request the engine cannot serve, naming the offending field."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


class PushConflict(Exception):
    """409: the push cannot proceed (another push or trainer, a stale version,
    a failed or finished push). `retry_after_s`: when trying again may work."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(Exception):
    """503: the model is in no state to serve (a load failed mid-commit)."""
