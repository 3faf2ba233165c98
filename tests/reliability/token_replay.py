"""The oracle for per-token weight versions: replay a sample in transformers
under the weights its spans name, with a KV cache, as the engine ran it.

For a sample with prompt P, tokens t and spans [(v0, 0, b0), (v1, b0, b1), ...]:
- the prompt is prefilled under v0 (it yields token 0's logits);
- within a span, the forward that yields token j (fed token j-1) runs under
  the span's version, over the cache the earlier forwards built;
- a `resumed` span starts from an empty cache: its version prefills the
  prompt and every token before the span again (what the engine does to a
  running request at a `keep` commit); a span not marked so keeps the cache
  the spans before it built.
The tokens of one span go through one forward: with causal attention and the
cache, that is the same computation as one token at a time.

Nothing here comes from the server but the sample itself: the weights are
`VersionedWeights` (the test's own), the forward is transformers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tests.reliability.oracle import VersionedWeights


@dataclass
class Span:
    version: int
    start: int
    end: int
    resumed: bool = False  # its version prefilled prompt + tokens before it again


def spans_from_json(raw: Sequence[dict]) -> list[Span]:
    return [Span(s["version"], s["start"], s["end"], s.get("resumed", False)) for s in raw]


class TokenReplay:
    """Replays samples; each version's weights are built once and kept."""

    def __init__(self, weights: VersionedWeights) -> None:
        self.weights = weights
        self._params: dict[int, dict[str, torch.Tensor]] = {}

    def params(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._params:
            model = self.weights.load(version)
            # One copy per storage: a tied head stays tied (functional_call
            # refuses two different tensors for tied names).
            copies: dict[int, torch.Tensor] = {}
            self._params[version] = {
                k: copies.setdefault(v.data_ptr(), v.detach().clone())
                for k, v in model.state_dict().items()}
        return self._params[version]

    @torch.no_grad()
    def logprobs(self, prompt: list[int], tokens: list[int], spans: list[Span]
                 ) -> torch.Tensor:
        """The logprob of each token under the versions `spans` give it."""
        from transformers import DynamicCache

        model = self.weights.model
        seq = prompt + tokens
        p = len(prompt)
        cache = DynamicCache()
        out = []
        for k, span in enumerate(spans):
            if span.resumed:
                cache = DynamicCache()
            # Inputs at positions [first, last) yield tokens span.start .. span.end - 1.
            first = 0 if k == 0 or span.resumed else p + span.start - 1
            last = p + span.end - 1
            ids = torch.tensor([seq[first:last]])
            logits = torch.func.functional_call(
                model, self.params(span.version), (),
                {"input_ids": ids, "past_key_values": cache, "use_cache": True}).logits
            lp = torch.log_softmax(logits[0].float(), -1)
            targets = torch.tensor(seq[first + 1:last + 1])
            rows = torch.arange(len(targets))
            out.append(lp[rows, targets][-(span.end - span.start):])
        return torch.cat(out) if out else torch.zeros(0)

    def gap(self, prompt: list[int], tokens: list[int], logprobs: list[float],
            spans: list[Span]) -> float:
        """Mean |served - replayed| logprob over the sample's tokens."""
        return self.gaps(prompt, tokens, logprobs, spans)[0]

    def gaps(self, prompt: list[int], tokens: list[int], logprobs: list[float],
             spans: list[Span]) -> tuple[float, float]:
        """Mean and max |served - replayed| logprob over the sample's tokens."""
        d = (self.logprobs(prompt, tokens, spans) - torch.tensor(logprobs)).abs()
        return float(d.mean()), float(d.max())


def shifted(spans: list[Span], boundary: int, by: int) -> list[Span]:
    """`spans` with the start of span `boundary` (>= 1) moved by `by` tokens."""
    out = [Span(s.version, s.start, s.end, s.resumed) for s in spans]
    out[boundary].start += by
    out[boundary - 1].end += by
    return out


def valid(spans: list[Span], n_tokens: int) -> bool:
    """Contiguous, half-open, in order, covering every token, none empty."""
    if n_tokens == 0:
        return spans == []
    return (bool(spans) and spans[0].start == 0 and spans[-1].end == n_tokens
            and all(s.start < s.end for s in spans)
            and all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False)))
