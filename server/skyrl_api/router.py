"""The control routes SkyRL's RemoteInferenceClient calls on each server
(SkyRL 0.4.0, `inference_servers/remote_inference_client.py`). Generation
goes through vLLM's token route (openai_api/router.py:
`/inference/v1/generate`) and our `/v1` routes.

SkyRL brackets its weight sync with these calls, to keep half-written
weights from being sampled and to free a GPU it shares with the trainer.
Neither applies here: a push commits between decode steps, all or nothing,
and every token is tagged with its version, and the server's memory is its
own. So `/pause`, `/resume`, `/sleep` and `/wake_up` answer and change
nothing; nor does `/reset_prefix_cache`: every commit resets the prefix
cache already (the only time its contents go stale), and SkyRL's generation
client calls it with no token, so a reset here would let anyone cost every
running request its cache; `/get_world_size` is the engine's.

SkyRL's weight transfer: its delta backend (`weight_sync_backend=delta`:
byte deltas in a shared store, fetched by each server) is a sidecar push
(delta_sync.py): the routes below take the admin token, as every weight
route does (SkyRL's weight client sends it from ~/.netrc, as HTTP Basic:
auth.py). Its NCCL and CUDA IPC transfers are not served: an
`init_weight_transfer_engine` for them answers 501, naming the delta
backend, so a SkyRL run stops at its first weight call with the reason
instead of training on stale weights (docs/skyrl.md). The weight calls run
one at a time under one lock, so a fetch cannot race an update. Bodies
that are not what SkyRL sends get a 400 naming the field.

The control routes take the generate token when the server has one;
SkyRL's generation client sends none, so a SkyRL deployment runs the
generate routes open, on a network of its own. Left out of /openapi.json:
the shapes are SkyRL's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.auth import serve
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.skyrl_api.delta_sync import DeltaSync, push_into

router = APIRouter()
UNCHANGED = "rollout-sidecar commits pushes between decode steps and tags every token with " \
    "its version: nothing to pause, sleep or wake"
NOT_SERVED = ("SkyRL's {backend} weight transfer is not served by rollout-sidecar: use "
              "weight_sync_backend=delta (a shared store), or push from SkyRL's policy "
              "workers with rollout_sidecar.trainer.WeightPusher.push_tensors (docs/skyrl.md)")


@serve(router, routes.SKYRL_WORLD_SIZE)
async def world_size(request: Request) -> JSONResponse:
    return JSONResponse({"world_size": services(request).settings.tensor_parallel_size})


@serve(router, routes.SKYRL_PAUSE)
@serve(router, routes.SKYRL_RESUME)
@serve(router, routes.SKYRL_SLEEP)
@serve(router, routes.SKYRL_WAKE_UP)
async def unchanged(request: Request) -> JSONResponse:
    return JSONResponse({"changed": False, "why": UNCHANGED})


@serve(router, routes.SKYRL_IS_SLEEPING)
async def is_sleeping() -> JSONResponse:
    return JSONResponse({"is_sleeping": False})


@serve(router, routes.SKYRL_RESET_PREFIX_CACHE)
async def reset_prefix_cache() -> JSONResponse:
    return JSONResponse({"reset": False, "why": "every weight commit resets the prefix cache; "
                         "nothing in it is stale"})


def _sync(request: Request) -> DeltaSync:
    state = services(request)
    if state.skyrl is None:
        state.skyrl = DeltaSync(Path(state.started_engine().model_path),
                                state.settings.weight_sync_root)
    return state.skyrl


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError as e:
        raise BadRequest(f"body is not JSON: {e}", None) from e
    return body if isinstance(body, dict) else {}


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...],
           required: bool = False) -> Any:
    """`body[name]` if it is a `kind` (None if absent and not required), else a 400."""
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"{name} must be {want}", name)
    return value


@serve(router, routes.SKYRL_INIT_TRANSFER)
async def init_weight_transfer_engine(request: Request) -> JSONResponse:
    info = _field(await _body(request), "init_info", dict) or {}
    backend = "delta" if "base_model_path" in info or "local_checkpoint_dir" in info \
        else "NCCL" if "master_address" in info else "CUDA IPC" if "ipc" in str(info) \
        else None
    if backend != "delta":
        return JSONResponse({"error": {"message": NOT_SERVED.format(backend=backend or "this"),
                                       "type": "NotImplementedError", "code": 501}},
                            status_code=501)
    sync = _sync(request)
    async with services(request).skyrl_lock:
        try:
            base = await sync.init(services(request).started_weights())
        except NotImplementedError as e:
            return JSONResponse({"error": {"message": str(e), "code": 501}}, status_code=501)
    return JSONResponse({"backend": "delta", "version": sync.version, "base": base})


@serve(router, routes.SKYRL_FETCH)
async def fetch_weights(request: Request) -> JSONResponse:
    body = await _body(request)
    target = _field(body, "target_version", int, required=True)
    sync_dir, uri = _field(body, "sync_dir", str), _field(body, "uri", str)
    sync = _sync(request)
    async with services(request).skyrl_lock:
        stats = await asyncio.to_thread(sync.fetch, target, sync_dir, uri)
    return JSONResponse({"target_version": target, **stats})


@serve(router, routes.SKYRL_START_UPDATE)
async def start_weight_update(request: Request) -> JSONResponse:
    sync = _sync(request)
    async with services(request).skyrl_lock:
        sync.start()
    return JSONResponse({"started": True})


@serve(router, routes.SKYRL_UPDATE)
async def update_weights(request: Request) -> JSONResponse:
    info = _field(await _body(request), "update_info", dict) or {}
    sync = _sync(request)
    async with services(request).skyrl_lock:
        version, tensors = sync.to_push(info.get("target_version", info.get("version")))
        await push_into(services(request).started_weights(), version, tensors)
        sync.pushed()
    return JSONResponse({"weight_version": version})


@serve(router, routes.SKYRL_FINISH_UPDATE)
async def finish_weight_update(request: Request) -> JSONResponse:
    sync = _sync(request)
    async with services(request).skyrl_lock:
        sync.finish()
    return JSONResponse({"finished": True})
