"""A `GenerateRequest` into token ids and vLLM `SamplingParams`, or a 400
naming the field.

Nothing here scales with the input before it is bounded: prompt bytes are
counted before tokenising, tokenising runs off the event loop, and prompts x n
is capped. vLLM's own validation errors (`VLLMValidationError` is not a
`ValueError`) become 400s too, instead of 500s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_sidecar.protocol.schema import GenerateRequest
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.errors import BadRequest


def _encodable(text: str, field: str) -> int:
    """UTF-8 length of `text`; a lone surrogate (valid JSON, not text) is a 400."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field} is not valid text: unpaired surrogate at position "
                         f"{e.start}", field) from e


def check_request(req: GenerateRequest, settings: ServerSettings, max_model_len: int,
                  vocab_size: int) -> None:
    """Every value bounded before anything reaches vLLM: an integer it would
    overflow on (max_tokens 2**64, top_k 10**30) failed inside the engine
    with a 500 and left the request there."""
    if (err := req.sampling.range_error()) is not None:
        raise BadRequest(err[1], err[0])
    if req.sampling.max_tokens > max_model_len:
        raise BadRequest(f"sampling.max_tokens={req.sampling.max_tokens} is over max_model_len "
                         f"{max_model_len}", "sampling.max_tokens")
    if req.sampling.top_k > vocab_size:
        raise BadRequest(f"sampling.top_k={req.sampling.top_k} is over the vocabulary "
                         f"({vocab_size}); 0 disables it", "sampling.top_k")
    if req.min_weight_version is not None and req.min_weight_version < 0:
        raise BadRequest("min_weight_version must be >= 0", "min_weight_version")

    sequences = req.num_prompts * req.sampling.n
    if sequences > settings.max_sequences_per_request:
        raise BadRequest(f"{req.num_prompts} prompts x n={req.sampling.n} = {sequences} "
                         f"sequences; this server takes at most "
                         f"{settings.max_sequences_per_request} per request "
                         "(ROLLOUT_SIDECAR_MAX_SEQUENCES_PER_REQUEST)", "sampling.n")
    for i, s in enumerate(req.sampling.stop):
        _encodable(s, f"sampling.stop[{i}]")


async def prompt_token_ids(req: GenerateRequest, tokenizer: Any, max_model_len: int,
                           vocab_size: int, max_prompt_bytes: int) -> list[list[int]]:
    if req.prompts is not None:
        field = "prompts"
        for i, p in enumerate(req.prompts):
            if (n := _encodable(p, f"prompts[{i}]")) > max_prompt_bytes:
                raise BadRequest(f"prompts[{i}] is {n} bytes; at most {max_prompt_bytes} "
                                 f"(max_model_len {max_model_len} tokens)", f"prompts[{i}]")
        # Off the event loop: a long prompt takes seconds to tokenise.
        prompts = req.prompts or []
        ids = await asyncio.to_thread(lambda: [tokenizer(p).input_ids for p in prompts])
    else:
        field, ids = "prompt_token_ids", req.prompt_token_ids or []
    for i, p in enumerate(ids):
        if len(p) == 0:
            raise BadRequest(f"{field}[{i}] is empty after tokenization", f"{field}[{i}]")
        if len(p) >= max_model_len:
            raise BadRequest(f"{field}[{i}] has {len(p)} tokens; max_model_len is "
                             f"{max_model_len} (prompt plus at least one new token)",
                             f"{field}[{i}]")
        if bad := [t for t in p if not 0 <= t < vocab_size]:
            raise BadRequest(f"{field}[{i}] has token id {bad[0]} outside the vocabulary "
                             f"[0, {vocab_size})", f"{field}[{i}]")
    return ids


def sampling_params(req: GenerateRequest, prompt_index: int) -> Any:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMError
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    # One seed per prompt: the same request replays exactly, yet prompts of one
    # request do not share their random draws.
    seed = None if s.seed is None else (s.seed + prompt_index * 1_000_003) % (2**63)
    try:
        return SamplingParams(
            n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k, seed=seed, stop=s.stop or None,
            logprobs=0 if s.logprobs else None,
            prompt_logprobs=0 if s.prompt_logprobs else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    except (ValueError, VLLMError) as e:  # vLLM's own checks
        raise as_bad_request(e) from e


def as_bad_request(e: Exception) -> BadRequest:
    parameter = getattr(e, "parameter", None)
    return BadRequest(str(e), f"sampling.{parameter}" if parameter else "sampling")
