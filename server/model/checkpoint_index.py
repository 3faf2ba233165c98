"""What the served checkpoint holds: name -> (shape, dtype), read from the
safetensors headers alone (no tensor is loaded).

Pushes are validated against it before a byte of weight data moves, so a wrong
name or shape is a 400 at `begin`, not a crash halfway through a load.

Tensors that vLLM itself drops at load (`rotary_emb.inv_freq` and friends,
which older checkpoints carry) are set aside as `ignored`: a trainer whose model
keeps them as non-persistent buffers cannot push them, and need not.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from rollout_sidecar.protocol.precisions import FLOATING, dtype_itemsize, from_safetensors
from rollout_sidecar.protocol.schema import DRAFT_PREFIX

# vLLM's AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER drops these.
IGNORED_SUFFIXES = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached",
                    "rotary_emb.sin_cached")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class CheckpointIndex:
    tensors: dict[str, TensorSpec]
    tie_word_embeddings: bool
    ignored: frozenset[str] = frozenset()
    # A speculative drafter's tensors, also in `tensors` under their `draft.`
    # names (protocol/schema/drafter_api.py): a push carries all or none.
    draft: frozenset[str] = frozenset()

    def with_draft(self, draft: CheckpointIndex | None) -> CheckpointIndex:
        """This index and a drafter's checkpoint, its names prefixed."""
        if draft is None:
            return self
        named = {DRAFT_PREFIX + n: t for n, t in draft.tensors.items()}
        return CheckpointIndex(tensors={**self.tensors, **named},
                               tie_word_embeddings=self.tie_word_embeddings,
                               ignored=self.ignored | {DRAFT_PREFIX + n for n in draft.ignored},
                               draft=frozenset(named))

    @cached_property
    def bulk_dtype(self) -> str | None:
        """The floating dtype holding most of the checkpoint's elements."""
        by_dtype: dict[str, int] = {}
        for t in self.tensors.values():
            if t.dtype in FLOATING:
                by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel
        return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None

    def push_dtype(self, spec: TensorSpec, serve_dtype: str) -> str:
        """The dtype a push carries `spec` in: floating tensors in the serving
        dtype, except those the checkpoint deliberately keeps wider than its
        bulk (e.g. the fp32 `e_score_correction_bias` of DeepSeek-V3 and
        GLM-4.5 routers inside a bf16 checkpoint; rounding it can flip expert
        choices); integer and bool tensors in their own dtype."""
        if spec.dtype not in FLOATING:
            return spec.dtype
        bulk = self.bulk_dtype
        width = dtype_itemsize
        if bulk is not None and width(spec.dtype) > max(width(bulk), width(serve_dtype)):
            return spec.dtype
        return serve_dtype

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def push_bytes(self, serve_dtype: str) -> int:
        """The bytes a dense push carries: every tensor in its push dtype."""
        return sum(t.numel * dtype_itemsize(self.push_dtype(t, serve_dtype))
                   for t in self.tensors.values())

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> CheckpointIndex:
        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}: not an HF checkpoint dir")
        tensors: dict[str, TensorSpec] = {}
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                tensors[name] = TensorSpec(tuple(meta["shape"]),
                                           from_safetensors(meta["dtype"]))
        config = json.loads((path / "config.json").read_text())
        tie = bool(config.get("tie_word_embeddings", False))
        # A tied head is the embedding; pushes may send it under either name.
        tensors.pop("lm_head.weight", None) if tie else None
        ignored = frozenset(n for n in tensors if n.endswith(IGNORED_SUFFIXES))
        for n in ignored:
            del tensors[n]
        return cls(tensors=tensors, tie_word_embeddings=tie, ignored=ignored)
