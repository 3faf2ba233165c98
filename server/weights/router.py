"""Admin routes for weight pushes. All need the admin token; the three a
replica catching up reads (status, the staged copy) also take a peer's
proof that it holds it (peer_auth.py), and the challenge that starts that
proof is open."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, HTTPException, Path, Request, Response
from pydantic import BaseModel

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
    routes,
)
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.auth import credential, serve
from rollout_sidecar.server.front_door import BodyTooLarge
from rollout_sidecar.server.weights import self_report
from rollout_sidecar.server.weights.peer_copy import bucket_headers
from rollout_sidecar.server.weights.service import WeightService

router = APIRouter()


def _svc(request: Request) -> WeightService:
    return services(request).started_weights()


def _to_peer(request: Request, body: bytes, headers: dict[str, str] | None = None,
             media_type: str = "application/json") -> Response:
    """`body` as it is sent, tagged for a peer that asked with its proof."""
    scheme, value = credential(request.headers)
    sealed = services(request).peer_answerer.seal(value, request.url.path, body) \
        if scheme == "peer" else {}
    return Response(body, media_type=media_type, headers={**(headers or {}), **sealed})


@serve(router, routes.PEER_CHALLENGE)
async def peer_challenge(request: Request, nonce: str = Body(..., embed=True,
                                                             max_length=64)) -> dict:
    """A replica catching up asks this server to prove it holds the admin
    token (weights/peer_auth.py); nothing is read or changed."""
    answer = services(request).peer_answerer.challenge(nonce)
    if answer is None:
        raise HTTPException(400, "nonce: 64 hex digits, and a server with an admin token")
    return answer


@serve(router, routes.STATUS)
async def status(request: Request) -> Response:
    status = self_report.weight_status(_svc(request))
    return _to_peer(request, status.model_dump_json().encode())


@serve(router, routes.INDEX)
async def index(request: Request) -> WeightIndex:
    return self_report.weight_index(_svc(request))


@serve(router, routes.PROBE)
async def probe(body: ProbeRequest, request: Request) -> ProbeResult:
    """Compare the trainer's logprobs of a probe sequence with the served ones;
    a gap over the tolerance marks the version suspect."""
    return await _svc(request).probe(body)


@serve(router, routes.CONNECT)
async def connect(body: ConnectRequest, request: Request) -> ConnectResponse:
    """Returns once the data-plane group formed. A trainer that dies (or gives
    up) while the server waits for it to join ends the wait at once: its
    request's connection closing is the signal, so the next trainer does not
    wait out the join timeout."""
    return await _svc(request).connect(body, gone=request.is_disconnected)


@serve(router, routes.DISCONNECT)
async def disconnect(body: DisconnectRequest, request: Request) -> DisconnectResponse:
    """Release the data plane now (a trainer done pushing), instead of leaving
    its lease to run out: 409 if another connection owns it or a push is in
    progress over it; 200 again for a connection already released."""
    return await _svc(request).disconnect(body)


@serve(router, routes.BEGIN)
async def begin(body: BeginRequest, request: Request) -> BeginResponse:
    return await _svc(request).begin(body)


@serve(router, routes.BUCKET)
async def bucket(request: Request, index: Annotated[int, Path(ge=0, lt=2**31)],
                 x_push_id: str = Header(..., max_length=128),
                 x_checksum: int = Header(..., ge=0, lt=2**32)) -> dict:
    """One bucket of an HTTP push: refused (413) past its manifest entry's
    size before any more of it is read."""
    svc = _svc(request)
    size = svc.bucket_size(x_push_id, index)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > size:
            raise BodyTooLarge(size, f"push's buckets[{index}].nbytes")
    await svc.stage_bucket(x_push_id, index, data, x_checksum)
    return {"bucket": index, "nbytes": len(data)}


@serve(router, routes.PREPARE)
async def prepare(body: PrepareRequest, request: Request) -> PrepareResponse:
    """Phase 1 of a commit across replicas: every bucket arrived and passed its
    CRC; nothing is loaded. Commit (phase 2) or abort follows."""
    return await _svc(request).prepare(body)


@serve(router, routes.COMMIT)
async def commit(body: CommitRequest, request: Request) -> CommitResponse:
    """Load the push and serve it: after a prepare, or both phases in one call."""
    return await _svc(request).commit(body)


@serve(router, routes.ABORT)
async def abort(body: AbortRequest, request: Request) -> LastPush:
    """End a push that has not started committing; aborting it twice is fine."""
    return await _svc(request).abort(body.push_id, body.reason)


@serve(router, routes.STAGED)
async def staged(request: Request) -> Response:
    """The version this replica's staged copy holds and its buckets: what a
    replica starting with `--peers` catches up from (peer_copy.py)."""
    copy: BaseModel = await _svc(request).peer_copy.manifest()
    return _to_peer(request, copy.model_dump_json().encode())


@serve(router, routes.STAGED_BUCKET)
async def staged_bucket(request: Request,
                        index: Annotated[int, Path(ge=0, lt=2**31)]) -> Response:
    """One bucket of the staged copy, its version and CRC-32 in headers."""
    version, data = await _svc(request).peer_copy.bucket(index)
    return _to_peer(request, data, bucket_headers(version, data), "application/octet-stream")
