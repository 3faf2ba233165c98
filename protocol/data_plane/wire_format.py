"""The torch side of the manifest: dtype names and views of a slot (a
bucket's check is bucket_check.py).

Trainer and server both import it (they have torch); the client never does.
One table maps the manifest's dtype names to torch dtypes, so both sides read
the same bytes the same way.
"""

from __future__ import annotations

import functools

import torch

from rollout_sidecar.protocol.schema.manifest_api import TensorSlot


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; a ValueError names an unknown one."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: the manifest's and /info's spelling."""
    return str(dtype).removeprefix("torch.")


def slot_bytes(bucket: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The slot's bytes inside a bucket buffer (a view)."""
    return bucket[slot.offset: slot.offset + slot.length]


def slot_tensor(bucket: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """An unsplit slot as a typed, shaped view into the bucket buffer."""
    return slot_bytes(bucket, slot).view(torch_dtype(slot.dtype)).view(slot.shape)
