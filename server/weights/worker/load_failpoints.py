"""The worker's failpoints that change what a load sees (protocol/failpoints.py
says what each one is and how a test arms it): `load.drop` and `load.stale`
filter the staged tensors on their way into the model; `check.corrupt`
damages a staged bucket after it arrived. The others fire where they act
(transfer_engine.py: `load.crash`; adapter_loading.py: `adapter.scaling_twice`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rollout_sidecar.protocol.data_plane.bucket_check import checksum
from rollout_sidecar.protocol.failpoints import fire
from rollout_sidecar.protocol.schema import Check
from rollout_sidecar.server.weights.worker.staging import Staging


def _checkpoint_tensor(checkpoint: str, name: str, like: torch.Tensor) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return st.get_tensor(name).to(like.dtype)
    raise KeyError(f"{name} not in {checkpoint}")


def corrupt_arrived(staging: Staging, rank: int, check: Check) -> None:
    """Flip a staged byte of the first bucket after arrival (where it is
    staged: its buffer, or its first slot's place) and compute its check
    value again from what is staged, so the check refuses it."""
    if not staging.buckets or not staging.buckets[0].params or \
            fire("check.corrupt", rank) is None:
        return
    b, p = staging.buckets[0], staging.buckets[0].params[0]
    if b.scattered:
        staging.places.buffers[p.name][p.chunk_offset or 0] ^= 0xFF
    else:
        b.buffer[p.offset] ^= 0xFF
    b.checksum = checksum(staging.bucket_bytes(0), check)


def loaded_with_failpoints(weights: Iterable[tuple[str, torch.Tensor]], checkpoint: str,
                           rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The staged tensors as the armed load failpoints leave them."""
    drop, stale = fire("load.drop", rank), fire("load.stale", rank)
    for name, tensor in weights:
        if name == drop:
            continue
        if name == stale:
            tensor = _checkpoint_tensor(checkpoint, name, tensor)
        yield name, tensor
