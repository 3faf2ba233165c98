"""The pusher's HTTP control plane: the /weights/* admin routes."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import httpx

from rollout_sidecar.client.protocol import (
    BeginResponse,
    CommitResponse,
    ConnectResponse,
    DisconnectResponse,
    LastPush,
    PrepareResponse,
    ProbeRequest,
    ProbeResult,
    WeightIndex,
    WeightStatus,
)
from rollout_sidecar.client.protocol.endpoints import auth_headers
from rollout_sidecar.trainer.errors import WeightPushError


class WeightAdminClient:
    """Token from the argument or $ROLLOUT_SIDECAR_ADMIN_TOKEN (never logged)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0) -> None:
        token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_ADMIN_TOKEN")
        self.base_url = base_url
        self._http = httpx.Client(base_url=base_url, headers=auth_headers(token),
                                  timeout=timeout)

    def _call(self, method: str, path: str, **kw: Any) -> dict:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise WeightPushError(f"{method} {path}: server unreachable: {e}") from e
        return self._check(r, method, path)

    @staticmethod
    def _check(r: httpx.Response, method: str, path: str) -> dict:
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

    def probe(self, req: ProbeRequest) -> ProbeResult:
        """Have the server score the probe tokens under the version just
        committed and compare them with the trainer's logprobs."""
        return ProbeResult.model_validate(self._call(
            "POST", "/weights/probe", content=req.model_dump_json(),
            headers={"Content-Type": "application/json"}))

    def verify(self, req: ProbeRequest) -> ProbeResult:
        """Deprecated name of `probe` (kept for one minor version)."""
        warnings.warn("WeightAdminClient.verify() is deprecated, use probe()",
                      DeprecationWarning, stacklevel=2)
        return self.probe(req)

    def connect(self, connection_id: str, backend: str, timeout_s: float,
                takeover: bool = False, lease_wait_s: float = 60.0, *,
                trainer_id: str | None = None, world_size: int = 2, rank_offset: int = 1,
                store: tuple[str, int] | None = None,
                fanout: str = "broadcast") -> ConnectResponse:
        """While another connection's lease runs (a trainer that just restarted
        finds its old self there), wait as the server's Retry-After says, up to
        `lease_wait_s`; a trainer that is really pushing keeps renewing it, and
        then this raises with the server's reason."""
        body = {"connection_id": connection_id, "backend": backend, "timeout_s": timeout_s,
                "takeover": takeover, "trainer_id": trainer_id, "world_size": world_size,
                "rank_offset": rank_offset, "fanout": fanout}
        if store is not None:
            body.update(store_host=store[0], store_port=store[1])
        deadline = time.monotonic() + lease_wait_s
        while True:
            try:
                r = self._http.post("/weights/connect", json=body, timeout=timeout_s + 30)
            except httpx.TransportError as e:
                raise WeightPushError(f"POST /weights/connect: server unreachable: {e}") from e
            retry = r.headers.get("Retry-After")
            if r.status_code == 409 and retry and time.monotonic() + float(retry) < deadline:
                time.sleep(float(retry))
                continue
            return ConnectResponse.model_validate(self._check(r, "POST", "/weights/connect"))

    def disconnect(self, connection_id: str, trainer_id: str | None = None,
                   timeout_s: float = 5.0) -> DisconnectResponse:
        """Release the data plane now (the pusher closes), so the next trainer
        connects without waiting out the lease. 200 also when it was already
        released; WeightPushError on a 409 (another connection owns it, or a
        push is in progress over it) or an unreachable server."""
        return DisconnectResponse.model_validate(self._call(
            "POST", "/weights/disconnect", json={"connection_id": connection_id,
                                                 "trainer_id": trainer_id},
            timeout=timeout_s))

    def begin(self, version: int, transport: str, buckets: list[dict],
              connection_id: str | None, commit_policy: str | None) -> BeginResponse:
        return BeginResponse.model_validate(self._call("POST", "/weights/begin", json={
            "version": version, "transport": transport, "connection_id": connection_id,
            "commit_policy": commit_policy, "buckets": buckets}))

    def put_bucket(self, push_id: str, index: int, data: bytes, checksum: int) -> None:
        self._call("PUT", f"/weights/bucket/{index}", content=data, headers={
            "X-Push-Id": push_id, "X-Checksum": str(checksum),
            "Content-Type": "application/octet-stream"})

    def prepare(self, push_id: str, checksums: list[int], timeout_s: float) -> PrepareResponse:
        """Phase 1: waits until every bucket arrived and passed its CRC."""
        return PrepareResponse.model_validate(self._call("POST", "/weights/prepare", json={
            "push_id": push_id, "checksums": checksums}, timeout=timeout_s))

    def commit(self, push_id: str, checksums: list[int] | None, timeout_s: float
               ) -> CommitResponse:
        """Phase 2 (or both phases, given `checksums`): waits for the server's
        (check +) drain + load; `timeout_s` covers them."""
        return CommitResponse.model_validate(self._call("POST", "/weights/commit", json={
            "push_id": push_id, "checksums": checksums}, timeout=timeout_s))

    def abort(self, push_id: str, reason: str) -> LastPush:
        return LastPush.model_validate(self._call("POST", "/weights/abort", json={
            "push_id": push_id, "reason": reason}))

    def close(self) -> None:
        self._http.close()
