"""vLLM's outputs of one /generate request as a `GenerateResponse`.

The shaping is kept apart from the orchestration (service.py) because it is
where the honesty of a response is decided: each sample's per-token spans
come from the engine's step labels (engine/version_spans.py), and the
response's `versions_used` are the versions those spans name.
"""

from __future__ import annotations

from typing import Any

from rollout_sidecar.protocol.schema import (
    GenerateRequest,
    GenerateResponse,
    PromptResult,
    Sample,
    Usage,
    VersionSpan,
)
from rollout_sidecar.server.engine.request_tracking import Track
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.engine.version_spans import sample_spans, versions_used
from rollout_sidecar.server.metrics.collectors import ServerMetrics


def build_response(req: GenerateRequest, start: int, prompt_ids: list[list[int]],
                   outputs: list[Any], tracks: list[Track], gate: VersionGate,
                   metrics: ServerMetrics, boot_id: str) -> GenerateResponse:
    """`start`: the version the request was admitted under; `tracks` carry the
    version each prompt finished on."""
    results, prompt_tokens, completion_tokens = [], 0, 0
    spans = []
    for ids, out, track in zip(prompt_ids, outputs, tracks, strict=True):
        samples = [sample(c, req.sampling.logprobs, sample_spans(c, start, gate))
                   for c in out.outputs]
        spans += [s.weight_versions for s in samples]
        for s in samples:  # how far behind the served version each token is, delivered
            for span in s.weight_versions or []:
                metrics.token_lag.add(gate.version - span.version, span.end - span.start)
        prompt_tokens += len(ids)
        completion_tokens += sum(len(s.token_ids) for s in samples)
        results.append(PromptResult(
            prompt_token_ids=list(ids), samples=samples, restarts=track.restarts,
            prompt_logprobs=prompt_logprobs(ids, out.prompt_logprobs)
            if req.sampling.prompt_logprobs else None))
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.generated_tokens.inc(completion_tokens)
    versions = versions_used(spans, start)
    if versions is None:  # no labels from the engine: what the gate saw
        end = max((t.finish_version or start) for t in tracks)
        versions = gate.versions_between(start, end)
    return GenerateResponse(
        results=results, weight_version=start, versions_used=versions,
        weight_suspect=any(v in gate.suspect for v in versions),
        boot_id=boot_id,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens),
    )


def prompt_logprobs(ids: list[int], plps: Any) -> list[float | None]:
    # vLLM: one dict per position (None for the first), keyed by token id.
    return [None if d is None else float(d[t].logprob) for t, d in zip(ids, plps, strict=True)]


def sample(c: Any, want_logprobs: bool, spans: list[VersionSpan] | None = None) -> Sample:
    """One vLLM `CompletionOutput` as a `Sample`, with its version spans."""
    token_ids = list(c.token_ids)
    logprobs = None
    if want_logprobs:
        logprobs = [float(step[t].logprob) for t, step in zip(token_ids, c.logprobs,
                                                              strict=True)]
    # Anything but a natural stop or the length limit (e.g. an abort) is "abort".
    reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
    return Sample(text=c.text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                  weight_versions=spans)
