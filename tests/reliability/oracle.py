"""Versioned weights and the oracle that tells which version made each token.

Version k's weights are the checkpoint plus a perturbation drawn from seed k,
so any version can be rebuilt on demand and no version drifts far from the
checkpoint however many pushes came before. Served in float32, every token's
logprob fingerprints the weights that produced it: a transformers fp32 forward
of the right version matches it to ~1e-6, any other version is off by orders
of magnitude more.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

STEP = 0.003  # perturbation std, against an init std of 0.02
TOL = 1e-4  # max |dlogp| per token for "this version produced it"


class VersionedWeights:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.base = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load(self, version: int) -> torch.nn.Module:
        """Set the model to `version`'s weights (in place) and return it."""
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                noise = torch.randn(v.shape, generator=g) * STEP if version else 0
                v.copy_(self.base[k] + noise if v.is_floating_point() else self.base[k])
        return self.model


@dataclass
class Sample:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    claimed: list[int]  # versions_used of the response
    response: int = 0  # which response it came in (versions are per response)


@dataclass
class Verdicts:
    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)


def _logprobs(model: torch.nn.Module, samples: list[Sample]) -> list[torch.Tensor]:
    """Per sample, the logprob of each sampled token (batched, right-padded)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(samples), 64):
            chunk = samples[i:i + 64]
            seqs = [s.prompt + s.tokens for s in chunk]
            ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
            for j, seq in enumerate(seqs):
                ids[j, :len(seq)] = torch.tensor(seq)
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
            for j, s in enumerate(chunk):
                start = len(s.prompt)
                pos = torch.arange(start - 1, start - 1 + len(s.tokens))
                out.append(lp[j, pos, torch.tensor(s.tokens)])
    return out


def classify(samples: list[Sample], weights: VersionedWeights, versions: range,
             keep: bool = False) -> Verdicts:
    """honest: every token comes from a version the response listed, in order;
    mislabeled: all tokens from one version it did not list; mixed: otherwise.

    With `keep`, a token sampled after a swap attends to KV computed by the
    old weights, so it matches no clean forward; honest then means no token
    from an unlisted version, and more than one version listed as soon as any
    token is not the start version's, and only then ("nothing published after
    it finished")."""
    samples = [s for s in samples if s.tokens]
    explains: list[list[set[int]]] = [[set() for _ in s.tokens] for s in samples]
    for v in versions:  # which versions reproduce each token
        idx = [i for i, s in enumerate(samples) if min(s.claimed) - 2 <= v <= max(s.claimed) + 2]
        if not idx:
            continue
        ref = _logprobs(weights.load(v), [samples[i] for i in idx])
        for i, r in zip(idx, ref, strict=True):
            d = (r - torch.tensor(samples[i].logprobs)).abs()
            for t in torch.nonzero(d <= TOL).flatten().tolist():
                explains[i][t].add(v)
    verdicts = Verdicts()
    if keep:  # "nothing published after it finished", per response
        from_start: dict[int, bool] = {}
        for s, ex in zip(samples, explains, strict=True):
            from_start[s.response] = from_start.get(s.response, True) and all(
                min(s.claimed) in e for e in ex)
        multi = {s.response for s in samples if len(s.claimed) > 1}
        verdicts.counts["overlisted_responses"] = sum(from_start[r] for r in multi)
    for s, ex in zip(samples, explains, strict=True):
        kind = _verdict_keep(s.claimed, ex) if keep else _verdict(s.claimed, ex)
        verdicts.counts[kind] += 1
        if kind != "honest" and len(verdicts.examples) < 5:
            verdicts.examples.append(f"claimed {s.claimed}, token versions "
                                     f"{[sorted(e) for e in ex]}")
    return verdicts


def _verdict_keep(claimed: list[int], explains: list[set[int]]) -> str:
    listed, start = set(claimed), min(claimed)
    if any(e and not e & listed for e in explains):
        return "mislabeled"  # a token from a version the response does not list
    if len(listed) == 1 and any(start not in e for e in explains):
        return "mixed"  # a swap happened under it, but it lists one version
    return "honest"


def _verdict(claimed: list[int], explains: list[set[int]]) -> str:
    listed = set(claimed)
    last = min(claimed)
    for e in explains:  # tokens in order, each from a listed version, never going back
        ok = sorted(v for v in e & listed if v >= last)
        if not ok:
            break
        last = ok[0]
    else:
        return "honest"
    if all(e for e in explains) and len(set.intersection(*explains)) > 0:
        return "mislabeled"
    return "mixed" if all(e for e in explains) else "unexplained"
