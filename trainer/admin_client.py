"""The pusher's HTTP control plane: the /weights/* admin routes."""

from __future__ import annotations

import os
from typing import Any

import httpx

from rollout_sidecar.client.http import auth_headers
from rollout_sidecar.client.schema import (
    BeginResponse,
    CommitResponse,
    ConnectResponse,
    ProbeRequest,
    ProbeResult,
    WeightIndex,
    WeightStatus,
)


class WeightPushError(RuntimeError):
    """A push failed; the server keeps serving its previous weights."""


class NonFiniteWeightsError(WeightPushError):
    """A tensor held NaN or infinity; nothing was sent, the old weights serve."""


class WeightMismatchError(WeightPushError):
    """The push committed, but the server's logprobs for the probe sequence
    differ from the trainer's own forward pass by more than the tolerance. The
    server marks the version suspect until a later push passes."""


class WeightAdminClient:
    """Token from the argument or $ROLLOUT_SIDECAR_ADMIN_TOKEN (never logged)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 600.0) -> None:
        token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_ADMIN_TOKEN")
        self.base_url = base_url
        self._http = httpx.Client(base_url=base_url, headers=auth_headers(token),
                                  timeout=timeout)

    def _call(self, method: str, path: str, **kw: Any) -> dict:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise WeightPushError(f"{method} {path}: server unreachable: {e}") from e
        if r.is_error:
            try:
                msg = r.json().get("error", r.text)
            except ValueError:
                msg = r.text[:500]
            raise WeightPushError(f"{method} {path} -> HTTP {r.status_code}: {msg}")
        return r.json()

    def status(self) -> WeightStatus:
        return WeightStatus.model_validate(self._call("GET", "/weights/status"))

    def index(self) -> WeightIndex:
        return WeightIndex.model_validate(self._call("GET", "/weights/index"))

    def verify(self, req: ProbeRequest) -> ProbeResult:
        return ProbeResult.model_validate(self._call(
            "POST", "/weights/verify", content=req.model_dump_json(),
            headers={"Content-Type": "application/json"}))

    def connect(self, connection_id: str, backend: str, timeout_s: float) -> ConnectResponse:
        return ConnectResponse.model_validate(self._call("POST", "/weights/connect", json={
            "connection_id": connection_id, "backend": backend, "timeout_s": timeout_s}))

    def begin(self, version: int, transport: str, buckets: list[dict]) -> BeginResponse:
        return BeginResponse.model_validate(self._call("POST", "/weights/begin", json={
            "version": version, "transport": transport, "buckets": buckets}))

    def put_bucket(self, push_id: str, index: int, data: bytes, checksum: int) -> None:
        self._call("PUT", f"/weights/bucket/{index}", content=data, headers={
            "X-Push-Id": push_id, "X-Checksum": str(checksum),
            "Content-Type": "application/octet-stream"})

    def commit(self, push_id: str, checksums: list[int]) -> CommitResponse:
        return CommitResponse.model_validate(self._call("POST", "/weights/commit", json={
            "push_id": push_id, "checksums": checksums}))

    def abort(self, push_id: str, reason: str) -> None:
        self._call("POST", "/weights/abort", json={"push_id": push_id, "reason": reason})

    def close(self) -> None:
        self._http.close()
