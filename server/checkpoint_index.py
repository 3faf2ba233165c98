"""What the served checkpoint holds: name -> (shape, dtype), read from the
safetensors headers alone (no tensor is loaded).

Pushes are validated against it before a byte of weight data moves, so a wrong
name or shape is a 400 at `begin`, not a crash halfway through a load.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class CheckpointIndex:
    tensors: dict[str, TensorSpec]
    tie_word_embeddings: bool

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

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
                                           _ST_DTYPES.get(meta["dtype"], meta["dtype"]))
        config = json.loads((path / "config.json").read_text())
        tie = bool(config.get("tie_word_embeddings", False))
        # A tied head is the embedding; pushes may send it under either name.
        tensors.pop("lm_head.weight", None) if tie else None
        return cls(tensors=tensors, tie_word_embeddings=tie)
