"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and
vLLM's token route POST /inference/v1/generate.

vLLM's own OpenAI handlers (state built in compat.py) behind our API
token and version gate. Every response carries `weight_version`,
`versions_used` and
`weight_suspect` (in the JSON body; in every chunk of a stream) and an
`X-Weight-Version` header; each finished choice carries its per-token
`weight_versions` spans (in a stream: its last chunk). Requests accept
`min_weight_version` and `return_weight_versions` as extra body fields.

Errors: ours (401, 409 min_weight_version, 400 from our checks, 422 schema,
503) have our `{error, field, detail}` shape, as on /generate; errors from
inside vLLM's layer keep vLLM's OpenAI shape `{"error": {"message", "type",
"param", "code"}}`, which is what OpenAI clients parse. The routes are left
out of /openapi.json: their schemas are vLLM's (and OpenAI's), not ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.server.app_state import services
from rollout_sidecar.server.auth import serve
from rollout_sidecar.server.errors import BadRequest, ServiceUnavailable
from rollout_sidecar.server.generate.router import until_disconnected
from rollout_sidecar.server.openai_api.compat import RequestTag, tagged_chunks

log = logging.getLogger(__name__)
router = APIRouter()
VERSION_HEADER = "X-Weight-Version"


class _LeasedStream(StreamingResponse):
    """A stream that frees its request's lease when it ends, however it ends
    (finished, client gone, send failed)."""

    def __init__(self, tag: RequestTag, content: Any, headers: dict[str, str]) -> None:
        super().__init__(tagged_chunks(content, tag), media_type="text/event-stream",
                         headers=headers)
        self.tag = tag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.tag.release()


def _vllm_state(request: Request) -> Any:
    state = services(request).openai
    if state is None:  # built once the engine started (app.py's lifespan)
        raise ServiceUnavailable("the engine is still loading")
    return state


def _min_version(body: BaseModel) -> int | None:
    value = (body.model_extra or {}).get("min_weight_version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest("min_weight_version must be a non-negative integer",
                         "min_weight_version")
    return value


def _return_spans(body: BaseModel) -> bool:
    """`return_weight_versions`: each finished choice's per-token version
    spans; on unless false. An extra body field on vLLM 0.32; a declared one,
    default false, on 0.33 (chat_completion/protocol.py), where our default
    applies unless the client sent it."""
    if "return_weight_versions" in type(body).model_fields:
        sent = "return_weight_versions" in body.model_fields_set
        value = body.return_weight_versions if sent else True  # type: ignore[attr-defined]
    else:
        value = (body.model_extra or {}).get("return_weight_versions", True)
    if not isinstance(value, bool):
        raise BadRequest("return_weight_versions must be a boolean", "return_weight_versions")
    return value


def _choices_per_prompt(body: Any) -> int:
    """`n`: the OpenAI routes' field, the token route's in `sampling_params`."""
    n = getattr(body, "n", None) or getattr(getattr(body, "sampling_params", None), "n", None)
    return n or 1


def _check(body: Any, cap: int) -> None:
    if "max_version_lag" in (body.model_extra or {}):
        # A restart drops a run's tokens, and a stream has sent them already.
        raise BadRequest("max_version_lag is served on POST /generate only: a restarted "
                         "run drops its tokens, which a stream has already sent",
                         "max_version_lag")
    if getattr(body, "use_beam_search", False):
        # Beam search submits once per step, past the submit hold: untaggable.
        raise BadRequest("use_beam_search is not served here", "use_beam_search")
    prompt = getattr(body, "prompt", None)
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(
        prompt[0], int) else 1
    n = _choices_per_prompt(body)
    if n * prompts > cap:
        raise BadRequest(f"prompts x n = {n * prompts} is over this server's "
                         f"max_sequences_per_request ({cap})", "n")


def _vllm_error(exc: Exception) -> JSONResponse:
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )

    err = create_error_response(exc)
    if err.error.code >= 500:
        log.exception("/v1 request failed", exc_info=exc)
    return JSONResponse(err.model_dump(), status_code=err.error.code)


async def _serve(body: Any, request: Request,
                 create: Callable[[Any, Request], Awaitable[Any]]) -> Response:
    """Admit, let vLLM's handler run under the lease, tag what it answers."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    state = services(request)
    engine, settings = state.started_engine(), state.settings
    _check(body, settings.max_sequences_per_request)
    want_spans = _return_spans(body)
    lease = await engine.gate.admit(_min_version(body), settings.min_version_wait_s)
    tag = RequestTag(engine, lease, n=_choices_per_prompt(body), spans=want_spans)
    streaming = False
    try:
        with tag.current():
            result = await create(body, request)
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        headers = {VERSION_HEADER: str(lease.version)}
        if isinstance(result, BaseModel):
            data = result.model_dump()
            tag.add_spans(data.get("choices") or [])
            return JSONResponse({**data, **tag.fields()}, headers=headers)
        streaming = True  # from here the stream owns the lease
        return _LeasedStream(tag, result, headers)
    except Exception as e:  # raised inside vLLM's layer: its OpenAI error shape
        return _vllm_error(e)
    finally:
        if not streaming:
            await tag.release()


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """The body as vLLM's request model. Parsed here, not in the signature,
    so that importing the app does not import vLLM (it loads at startup).
    vLLM's own validators raise its `VLLMValidationError` (not pydantic's):
    a 400 naming the parameter, not a 500."""
    from vllm.exceptions import VLLMError

    try:
        data = json.loads(await request.body())
    except ValueError as e:
        raise BadRequest(f"body is not JSON: {e}", None) from e
    try:
        return model.model_validate(data)
    except VLLMError as e:
        raise BadRequest(str(e), getattr(e, "parameter", None)) from e
    except ValidationError as e:
        # Drop pydantic's wrapper markers from `loc` (they name no field).
        raise RequestValidationError([
            {"loc": ("body", *(p for p in err["loc"] if not any(c in str(p) for c in "[(")),),
             "msg": err["msg"], "type": err["type"]} for err in e.errors()]) from e


@serve(router, routes.CHAT_COMPLETIONS)
async def chat_completions(request: Request) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = await _parse(request, ChatCompletionRequest)
    handler = _vllm_state(request).openai_serving_chat
    return await until_disconnected(request, _serve(body, request,
                                                    handler.create_chat_completion))


@serve(router, routes.COMPLETIONS)
async def completions(request: Request) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    body = await _parse(request, CompletionRequest)
    handler = _vllm_state(request).openai_serving_completion
    return await until_disconnected(request, _serve(body, request, handler.create_completion))


@serve(router, routes.TOKENS_GENERATE)
async def generate_tokens(request: Request) -> Any:
    """vLLM's token-in, token-out route (SkyRL's RemoteInferenceClient
    generates through it): token ids in, token ids and logprobs out, with
    our version fields and each choice's spans. Its body forbids extra
    fields, so `min_weight_version` is not taken here."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    body = await _parse(request, GenerateRequest)
    handler = _vllm_state(request).serving_tokens
    return await until_disconnected(request, _serve(body, request, handler.serve_tokens))


@serve(router, routes.MODELS)
async def models(request: Request) -> JSONResponse:
    listed = await _vllm_state(request).openai_serving_models.show_available_models()
    version = services(request).started_engine().gate.version
    return JSONResponse({**listed.model_dump(), "weight_version": version},
                        headers={VERSION_HEADER: str(version)})
