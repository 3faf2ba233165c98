"""Warm the engine's request paths before the server reports ready.

The first request of each kind on a fresh engine pays one-time costs on top
of its own work: kernels chosen and buffers laid out for the first sampled
batch, the seeded-sampler and logprobs paths, the first prompt-logprobs
prefill, the output processor's first detokenisation. Left to the trainer,
they land on its first step (its rollouts and the first push's probe, which
scores a sequence with prompt logprobs). Paid here, while /ready still answers
503, the first step costs what later ones do.

Straight to vLLM with the very `SamplingParams` that /generate builds
(generate/request_checks.py), so the shapes are the real ones while the
server's own token counters and version gate see no traffic. A few tokens,
well under a second once the costs are paid. A failure is logged, never
fatal: the server starts as it would have without the warm-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from rollout_sidecar.protocol.schema import GenerateRequest, SamplingConfig
from rollout_sidecar.server.engine.engine_api import Engine
from rollout_sidecar.server.generate import request_checks

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.vllm_surface import Sampler

log = logging.getLogger(__name__)

# As long as the trainer's probe (trainer/probe.py, 64 tokens) where the
# model allows: the first prefill of that length is part of what is paid.
SCORE_TOKENS = 64
SAMPLE_TOKENS = 4


def warmup_requests(vocab_size: int, max_model_len: int) -> dict[str, GenerateRequest]:
    """The request shapes a trainer's first step sends: sampled rollouts with
    logprobs (n > 1, seeded and not) and the probe's prompt-logprobs score."""
    n = max(2, min(SCORE_TOKENS, max_model_len - 1))
    ids = [i % vocab_size for i in range(1, n + 1)]
    short = ids[: max(1, min(8, max_model_len - SAMPLE_TOKENS))]
    rollout = dict(n=2, max_tokens=max(1, min(SAMPLE_TOKENS, max_model_len - len(short))),
                   temperature=1.0, logprobs=True)
    return {
        "rollout_seeded": GenerateRequest(prompt_token_ids=[short],
                                          sampling=SamplingConfig(**rollout, seed=0)),
        "rollout": GenerateRequest(prompt_token_ids=[short], sampling=SamplingConfig(**rollout)),
        "score": GenerateRequest(prompt_token_ids=[ids], sampling=SamplingConfig(
            max_tokens=1, logprobs=False, prompt_logprobs=True)),
    }


async def _run(llm: Sampler, req: GenerateRequest) -> None:
    from vllm.inputs import TokensPrompt

    async def one(i: int, ids: list[int]) -> None:
        params = request_checks.sampling_params(req, i)
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                    f"warmup-{uuid.uuid4().hex}"):
            pass

    await asyncio.gather(*[one(i, ids) for i, ids in enumerate(req.prompt_token_ids or [])])


async def warm_up(engine: Engine) -> dict[str, float]:
    """Run each warm-up request once, in turn; returns seconds per request."""
    assert engine.info is not None, "warm up a started engine"
    timings: dict[str, float] = {}
    try:
        for name, req in warmup_requests(engine.info.vocab_size,
                                         engine.info.max_model_len).items():
            t = time.perf_counter()
            await _run(engine.running(), req)
            timings[name] = round(time.perf_counter() - t, 3)
    except Exception:  # never fatal: the engine works, the first request pays instead
        log.warning("warm-up failed after %s; continuing without it", timings, exc_info=True)
        return timings
    log.info("warm-up: %s", ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return timings
