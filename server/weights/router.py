"""Admin routes for weight pushes. All need the admin token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Request, Response

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
    StagedCopy,
    WeightIndex,
    WeightStatus,
)
from rollout_sidecar.server.auth import require_admin_token
from rollout_sidecar.server.weights.peer_copy import bucket_headers

router = APIRouter(prefix="/weights", dependencies=[Depends(require_admin_token)])


def _svc(request: Request):  # noqa: ANN202
    return request.app.state.weights


@router.get("/status", response_model=WeightStatus)
async def status(request: Request) -> WeightStatus:
    return _svc(request).status()


@router.get("/index", response_model=WeightIndex)
async def index(request: Request) -> WeightIndex:
    return _svc(request).index()


@router.post("/probe", response_model=ProbeResult)
async def probe(body: ProbeRequest, request: Request) -> ProbeResult:
    """Compare the trainer's logprobs of a probe sequence with the served ones;
    a gap over the tolerance marks the version suspect."""
    return await _svc(request).probe(body)


@router.post("/connect", response_model=ConnectResponse)
async def connect(body: ConnectRequest, request: Request) -> ConnectResponse:
    """Returns once the data-plane group formed. A trainer that dies (or gives
    up) while the server waits for it to join ends the wait at once: its
    request's connection closing is the signal, so the next trainer does not
    wait out the join timeout."""
    return await _svc(request).connect(body, gone=request.is_disconnected)


@router.post("/disconnect", response_model=DisconnectResponse)
async def disconnect(body: DisconnectRequest, request: Request) -> DisconnectResponse:
    """Release the data plane now (a trainer done pushing), instead of leaving
    its lease to run out: 409 if another connection owns it or a push is in
    progress over it; 200 again for a connection already released."""
    return await _svc(request).disconnect(body)


@router.post("/begin", response_model=BeginResponse)
async def begin(body: BeginRequest, request: Request) -> BeginResponse:
    return await _svc(request).begin(body)


@router.put("/bucket/{index}")
async def bucket(index: int, request: Request, x_push_id: str = Header(...),
                 x_checksum: int = Header(...)) -> dict:
    data = await request.body()
    await _svc(request).stage_bucket(x_push_id, index, data, x_checksum)
    return {"bucket": index, "nbytes": len(data)}


@router.post("/prepare", response_model=PrepareResponse)
async def prepare(body: PrepareRequest, request: Request) -> PrepareResponse:
    """Phase 1 of a commit across replicas: every bucket arrived and passed its
    CRC; nothing is loaded. Commit (phase 2) or abort follows."""
    return await _svc(request).prepare(body)


@router.post("/commit", response_model=CommitResponse)
async def commit(body: CommitRequest, request: Request) -> CommitResponse:
    """Load the push and serve it: after a prepare, or both phases in one call."""
    return await _svc(request).commit(body)


@router.post("/abort", response_model=LastPush)
async def abort(body: AbortRequest, request: Request) -> LastPush:
    """End a push that has not started committing; aborting it twice is fine."""
    return await _svc(request).abort(body.push_id, body.reason)


@router.get("/staged", response_model=StagedCopy)
async def staged(request: Request) -> StagedCopy:
    """The version this replica's staged copy holds and its buckets: what a
    replica starting with `--peers` catches up from (peer_copy.py)."""
    return await _svc(request).peer_copy.manifest()


@router.get("/staged/{index}")
async def staged_bucket(request: Request,
                        index: Annotated[int, Path(ge=0, lt=2**31)]) -> Response:
    """One bucket of the staged copy, its version and CRC-32 in headers."""
    version, data = await _svc(request).peer_copy.bucket(index)
    return Response(data, media_type="application/octet-stream",
                    headers=bucket_headers(version, data))
