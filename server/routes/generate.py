"""POST /generate."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from rollout_sidecar.client.schema import GenerateRequest, GenerateResponse
from rollout_sidecar.server.auth import require_api_token

router = APIRouter()


@router.post("/generate", response_model=GenerateResponse,
             dependencies=[Depends(require_api_token)])
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    return await request.app.state.engine.generate(body)
