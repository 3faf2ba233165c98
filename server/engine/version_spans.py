"""Which weights sampled each token: vLLM's per-step labels, as our versions.

vLLM's engine core stamps every step's outputs with its current weight label
(`EngineCore._attach_weight_version`), and the output processor turns the
label changes into `{version, start, end}` spans on each finished
`CompletionOutput`. The labels are exact for us because of where the commit
sets them (weights/commit.py): inside the engine pause, after the load and
vLLM's `finish_weight_update`, before the resume. A pause ends only once no
step is running or queued (`EngineCoreProc.pause_scheduler` waits for an idle
engine, batch queue included), so every step ran wholly on one set of
weights and carries that set's label: a token's label names the weights
whose logits it was sampled from, never a label published before its load
finished. The first label is set at engine start (lifecycle.py), so no token
is ever "default".

At a `keep` commit the prefix cache is cleared, which makes vLLM preempt every
running request and recompute its KV cache on the new weights when generation
resumes (`Scheduler.reset_prefix_cache(reset_running_requests=True)`). So a
span after a boundary starts with its version prefilling the prompt and every
token before it again (`resumed`): no token attends to a cache that other
weights built. Measured against a transformers replay: a replay that keeps
the old cache instead misses every crossing sample by 0.014 mean |dlogp| or
more (tests/reliability/test_token_versions.py).

Two label changes are not weight changes for a running request, and are
folded into the span before them:
- an adapter-only commit (a LoRA adapter over unchanged base weights) runs
  without a pause, and a request keeps the adapter of the version it was
  admitted under (engine/adapter_table.py);
- under `wait` and `abort` no request runs across a commit at all.
So a label L is the request's version only as far as the versions from its
admission to L were all committed with `keep` (`VersionGate.versions_between`).
"""

from __future__ import annotations

from typing import Any

from rollout_sidecar.protocol.schema import VersionSpan
from rollout_sidecar.server.engine.version_gate import VersionGate


def sample_spans(output: Any, admitted: int, gate: VersionGate) -> list[VersionSpan] | None:
    """The spans of one finished `CompletionOutput` of a request admitted
    under `admitted`; [] without tokens, None if vLLM gave no labels."""
    raw = getattr(output, "weight_versions", None)
    if raw is None:
        return [] if not output.token_ids else None
    spans: list[VersionSpan] = []
    for span in raw:
        if span.end <= span.start:
            continue
        try:
            label = int(span.version)
        except (TypeError, ValueError):  # a label we did not set: no provenance
            return None
        version = gate.versions_between(admitted, label)[-1] if label > admitted else label
        if spans and spans[-1].version == version:
            spans[-1] = VersionSpan(version=version, start=spans[-1].start, end=span.end,
                                    resumed=spans[-1].resumed)
        else:  # a keep commit: the engine prefilled the whole prefix again (commit.py)
            spans.append(VersionSpan(version=version, start=span.start, end=span.end,
                                     resumed=bool(spans)))
    return spans


def versions_used(spans: list[list[VersionSpan] | None], admitted: int) -> list[int] | None:
    """Every version some span names, ascending; None if any sample has no spans."""
    if any(s is None for s in spans):
        return None
    used = {span.version for sample in spans for span in sample}  # type: ignore[union-attr]
    return sorted(used) or [admitted]
