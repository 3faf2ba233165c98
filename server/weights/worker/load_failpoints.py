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

from rollout_sidecar.protocol.failpoints import fire


def _checkpoint_tensor(checkpoint: str, name: str, like: torch.Tensor) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return st.get_tensor(name).to(like.dtype)
    raise KeyError(f"{name} not in {checkpoint}")


def corrupt_arrived(buffer: torch.Tensor, rank: int) -> bool:
    """Flip a staged byte after arrival, so the CRC check refuses it."""
    if not buffer.numel() or fire("check.corrupt", rank) is None:
        return False
    buffer[0] ^= 0xFF
    return True


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
