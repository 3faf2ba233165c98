"""The pusher's HTTP control plane: the /weights/* admin routes.

Every call is bounded by the push's deadlines (deadlines.py): a quick call by
the stall bound, a long one (connect, begin, prepare, commit, probe) by its
phase's budget and a liveness watch. A failure raises `ReplicaError` naming
the replica, the phase and what happened, in one of four words: unreachable,
frozen, refused (with the server's reason) or failed (a load that failed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel

from rollout_sidecar.protocol.calls.failures import NEVER_SENT  # the request never reached it
from rollout_sidecar.protocol.calls.tls import shared_tls
from rollout_sidecar.protocol.failpoints import fire
from rollout_sidecar.protocol.schema import (
    AbortRequest,
    BeginRequest,
    BeginResponse,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    DisconnectRequest,
    DisconnectResponse,
    LastPush,
    PrepareRequest,
    PrepareResponse,
    ProbeRequest,
    ProbeResult,
    WeightIndex,
    WeightStatus,
    routes,
)
from rollout_sidecar.protocol.schema.endpoints import auth_headers
from rollout_sidecar.protocol.schema.routes import Route
from rollout_sidecar.trainer.control.deadlines import Deadlines, Stalled, watched
from rollout_sidecar.trainer.errors import ReplicaError

# A liveness or quick call that timed out once connected: the server is frozen.
SILENT = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


class WeightAdminClient:
    """Token from the argument or $ROLLOUT_SIDECAR_ADMIN_TOKEN (never logged)."""

    def __init__(self, base_url: str, token: str | None = None,
                 deadlines: Deadlines | None = None) -> None:
        token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_ADMIN_TOKEN")
        self.base_url = base_url
        self.deadlines = deadlines or Deadlines()
        self._http = httpx.Client(base_url=base_url, headers=auth_headers(token),
                                  timeout=self.deadlines.quick, verify=shared_tls())

    def _call(self, route: Route, phase: str, budget_s: float | None = None,
              body: BaseModel | None = None, path: str | None = None, **kw: Any) -> Any:
        """One request to `route` (its body built from `body`, its answer read
        as the route's response type); `budget_s`: a long call, watched (see
        deadlines.py)."""
        path = path or route.path
        fire("push.call", phase=phase, url=self.base_url)
        if body is not None:
            kw["json"] = route.body(body)
        r = self._check(self._send(route.method, path, phase, budget_s, **kw), route.method,
                        path, phase)
        return r if route.response is None else route.response.model_validate(r)

    def _send(self, method: str, path: str, phase: str, budget_s: float | None,
              **kw: Any) -> httpx.Response:
        d = self.deadlines
        try:
            if budget_s is None:
                return self._http.request(method, path, **kw)
            return watched(lambda: self._http.request(method, path, timeout=d.long(budget_s),
                                                      **kw), self.alive, d)
        except Stalled as e:
            what = "unreachable" if isinstance(e.cause, NEVER_SENT) else "frozen"
            raise ReplicaError(self.base_url, phase, what, str(e)) from e
        except httpx.TransportError as e:
            raise self._transport_error(e, phase, budget_s) from e

    def _transport_error(self, e: httpx.TransportError, phase: str, budget_s: float | None
                         ) -> ReplicaError:
        if isinstance(e, NEVER_SENT):
            return ReplicaError(self.base_url, phase, "unreachable",
                                f"no connection ({type(e).__name__}: {e})")
        if isinstance(e, SILENT) and budget_s is None:
            return ReplicaError(self.base_url, phase, "frozen",
                                f"connected, then silent for {self.deadlines.stall_s:g}s")
        if isinstance(e, SILENT):  # /ready kept answering: the HTTP side lives, the work not
            return ReplicaError(self.base_url, phase, "frozen", "no answer within the phase's "
                                f"budget of {budget_s:g}s while its HTTP process answered (a "
                                "wedged engine?)")
        return ReplicaError(self.base_url, phase, "unreachable", "connection lost mid-call "
                            f"(the server died or restarted: {type(e).__name__}: {e})")

    def alive(self) -> None:
        """Raise httpx's error unless the server's HTTP process answers
        anything (GET /ready: no engine round trip) within the stall bound."""
        self._http.get(routes.READY.path, timeout=self.deadlines.quick)

    def _check(self, r: httpx.Response, method: str, path: str, phase: str) -> dict:
        if r.is_error:
            try:
                msg = r.json().get("error", r.text)
            except ValueError:
                msg = r.text[:500]
            # A commit answered 5xx: the load failed (the server says how).
            what = "failed" if phase == "commit" and r.status_code >= 500 else "refused"
            raise ReplicaError(self.base_url, phase, what,
                               f"{method} {path} -> HTTP {r.status_code}: {msg}", r.status_code)
        return r.json()

    def status(self) -> WeightStatus:
        return self._call(routes.STATUS, "status")

    def index(self) -> WeightIndex:
        return self._call(routes.INDEX, "index")

    def probe(self, req: ProbeRequest, budget_s: float = 300.0) -> ProbeResult:
        """Have the server score the probe tokens under the version just
        committed and compare them with the trainer's logprobs."""
        return self._call(routes.PROBE, "probe", budget_s, req)

    def connect(self, connection_id: str, backend: str, timeout_s: float,
                takeover: bool = False, lease_wait_s: float = 60.0, *,
                trainer_id: str | None = None, world_size: int = 2, rank_offset: int = 1,
                store: tuple[str, int] | None = None,
                fanout: str = "broadcast", secret: bytes | None = None,
                bucket_macs: bool = True, op_timeout_s: float | None = None,
                senders: int = 1, ring_starts: Sequence[int] | None = None,
                slot_pieces: bool = False) -> ConnectResponse:
        """While another connection's lease runs (a trainer that just restarted
        finds its old self there), wait as the server's Retry-After says, up to
        `lease_wait_s`; a trainer that is really pushing keeps renewing it, and
        then this raises with the server's reason."""
        # `senders`, `ring_starts` and `slot_pieces` are sent only when not at their default,
        # which a server that predates them refuses (the route's body()).
        req = ConnectRequest.model_validate({
            "connection_id": connection_id, "backend": backend, "timeout_s": timeout_s,
            "takeover": takeover, "trainer_id": trainer_id, "world_size": world_size,
            "rank_offset": rank_offset, "fanout": fanout, "op_timeout_s": op_timeout_s,
            "senders": senders, "ring_starts": None if ring_starts is None else list(ring_starts),
            "slot_pieces": slot_pieces,
            "store_host": store and store[0], "store_port": store and store[1],
            "secret": secret and secret.hex(), "bucket_macs": bucket_macs if secret else True})
        route = routes.CONNECT
        deadline = time.monotonic() + lease_wait_s
        while True:
            # The server answers once the whole group formed: its join's bound, plus slack.
            r = self._send(route.method, route.path, "connect",
                           timeout_s + self.deadlines.stall_s, json=route.body(req))
            retry = r.headers.get("Retry-After")
            if r.status_code == 409 and retry and time.monotonic() + float(retry) < deadline:
                time.sleep(float(retry))
                continue
            return ConnectResponse.model_validate(self._check(r, route.method, route.path,
                                                              "connect"))

    def disconnect(self, connection_id: str, trainer_id: str | None = None,
                   timeout_s: float = 5.0) -> DisconnectResponse:
        """Release the data plane now (the pusher closes), so the next trainer
        connects without waiting out the lease. 200 also when it was already
        released; WeightPushError on a 409 (another connection owns it, or a
        push is in progress over it) or an unreachable server."""
        return self._call(routes.DISCONNECT, "disconnect",
                          body=DisconnectRequest(connection_id=connection_id,
                                                 trainer_id=trainer_id),
                          timeout=min(timeout_s, self.deadlines.stall_s))

    def begin(self, version: int, transport: str, buckets: list[dict],
              connection_id: str | None, commit_policy: str | None,
              budget_s: float = 300.0, delta_base: int | None = None,
              adapter: dict | None = None, check: str = "crc32") -> BeginResponse:
        """Checks the manifest and allocates staging: watched, since a large
        model's staging takes a while."""
        req = BeginRequest.model_validate({
            "version": version, "transport": transport, "connection_id": connection_id,
            "commit_policy": commit_policy, "buckets": buckets, "delta_base": delta_base,
            "adapter": adapter, "check": check})
        return self._call(routes.BEGIN, "begin", budget_s, req)

    def put_bucket(self, push_id: str, index: int, data: bytes, checksum: int,
                   budget_s: float = 300.0) -> None:
        self._call(routes.BUCKET, "transfer", budget_s, path=routes.BUCKET.url(index=index),
                   content=data, headers={"X-Push-Id": push_id, "X-Checksum": str(checksum),
                                          "Content-Type": "application/octet-stream"})

    def prepare(self, push_id: str, checksums: list[int], timeout_s: float,
                macs: list[str] | None = None) -> PrepareResponse:
        """Phase 1: waits until every bucket arrived and passed its CRC."""
        return self._call(routes.PREPARE, "prepare", timeout_s, PrepareRequest.model_validate(
            {"push_id": push_id, "checksums": checksums, "macs": macs}))

    def commit(self, push_id: str, checksums: list[int] | None, timeout_s: float,
               macs: list[str] | None = None) -> CommitResponse:
        """Phase 2 (or both phases, given `checksums`, and `macs` with a
        secret): waits for the server's (check +) drain + load; `timeout_s`
        covers them."""
        return self._call(routes.COMMIT, "commit", timeout_s, CommitRequest.model_validate(
            {"push_id": push_id, "checksums": checksums, "macs": macs}))

    def abort(self, push_id: str, reason: str) -> LastPush:
        return self._call(routes.ABORT, "abort", body=AbortRequest(push_id=push_id,
                                                                  reason=reason))

    def close(self) -> None:
        self._http.close()
