"""vLLM's outputs of one /generate request as a `GenerateResponse`.

The shaping is kept apart from the orchestration (service.py) because it is
where the honesty of a response is decided: the versions it names come from
the gate, between the version it was admitted under and the last version any
of its prompts finished on (see engine/version_gate.py).
"""

from __future__ import annotations

from typing import Any

from rollout_sidecar.client.protocol import (
    GenerateRequest,
    GenerateResponse,
    PromptResult,
    Sample,
    Usage,
)
from rollout_sidecar.server.engine.request_tracking import Track
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.metrics.collectors import ServerMetrics


def build_response(req: GenerateRequest, start: int, prompt_ids: list[list[int]],
                   outputs: list[Any], tracks: list[Track], gate: VersionGate,
                   metrics: ServerMetrics, boot_id: str) -> GenerateResponse:
    """`start`: the version the request was admitted under; `tracks` carry the
    version each prompt finished on."""
    results, prompt_tokens, completion_tokens = [], 0, 0
    for ids, out in zip(prompt_ids, outputs, strict=True):
        samples = [sample(c, req.sampling.logprobs) for c in out.outputs]
        prompt_tokens += len(ids)
        completion_tokens += sum(len(s.token_ids) for s in samples)
        results.append(PromptResult(
            prompt_token_ids=list(ids), samples=samples,
            prompt_logprobs=prompt_logprobs(ids, out.prompt_logprobs)
            if req.sampling.prompt_logprobs else None))
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.generated_tokens.inc(completion_tokens)
    end = max((t.finish_version or start) for t in tracks)
    versions = gate.versions_between(start, end)
    return GenerateResponse(
        results=results, weight_version=start, weight_versions=versions,
        weight_suspect=any(v in gate.suspect for v in versions),
        boot_id=boot_id,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens),
    )


def prompt_logprobs(ids: list[int], plps: Any) -> list[float | None]:
    # vLLM: one dict per position (None for the first), keyed by token id.
    return [None if d is None else float(d[t].logprob) for t, d in zip(ids, plps, strict=True)]


def sample(c: Any, want_logprobs: bool) -> Sample:
    """One vLLM `CompletionOutput` as a `Sample`."""
    token_ids = list(c.token_ids)
    logprobs = None
    if want_logprobs:
        logprobs = [float(step[t].logprob) for t, step in zip(token_ids, c.logprobs,
                                                              strict=True)]
    # Anything but a natural stop or the length limit (e.g. an abort) is "abort".
    reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
    return Sample(text=c.text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason)
