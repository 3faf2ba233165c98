"""Deliberate faults in the worker's load, for the tests that prove the
post-load checks catch them. Off unless the server's environment names a file
in `ROLLOUT_SIDECAR_TEST_FAULT_FILE`; never set it in production. The file is
read at every load, so one server can go through several faults:

- ``drop:NAME``: the staged tensor NAME is not loaded at all (what a skipped or
  mis-mapped parameter looks like). The layer-coverage check must refuse it.
- ``stale:NAME``: NAME is loaded from the served checkpoint on disk instead of
  the push (the layer is complete, but holds old values). Only the probe can
  see it.
- ``crash``: the load raises after it changed the model (past the point of no
  return), as a device error mid-load would.
- ``lora_scaling_twice``: a LoRA adapter's scaling (alpha/r) is applied twice,
  as SkyRL's rebuilt adapters were (SkyRL 2221). Only the probe can see it.
- ``corrupt``: the first staged bucket's first byte is flipped after it
  arrived, so its CRC check refuses the push.

Any of them followed by ``@R`` happens on worker rank R alone (TP >= 2): a
fault on one rank is what puts vLLM's worker replies out of step (ops.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

ENV = "ROLLOUT_SIDECAR_TEST_FAULT_FILE"
log = logging.getLogger(__name__)


def _checkpoint_tensor(checkpoint: str, name: str, like: torch.Tensor) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return st.get_tensor(name).to(like.dtype)
    raise KeyError(f"{name} not in {checkpoint}")


def _spec(rank: int | None = None) -> tuple[str, str]:
    """(kind, target) of the fault for worker `rank` (None: any rank)."""
    path = os.environ.get(ENV)
    spec = Path(path).read_text().strip() if path and Path(path).exists() else ""
    spec, at, only = spec.partition("@")
    if at and rank is not None and int(only) != rank:
        return "", ""
    kind, _, target = spec.partition(":")
    return kind, target


def crash_after_load(rank: int) -> None:
    if _spec(rank)[0] == "crash":
        raise RuntimeError("injected failure after the model changed (test fault)")


def corrupt_arrived(buffer: torch.Tensor, rank: int) -> bool:
    """Flip a staged byte after arrival, so the CRC check refuses it."""
    if _spec(rank)[0] != "corrupt" or not buffer.numel():
        return False
    log.warning("%s: corrupting a staged bucket on rank %d (tests only)", ENV, rank)
    buffer[0] ^= 0xFF
    return True


def lora_scaling_fault() -> bool:
    if _spec()[0] != "lora_scaling_twice":
        return False
    log.warning("%s: applying every LoRA scaling twice (tests only)", ENV)
    return True


def apply_test_faults(weights: Iterable[tuple[str, torch.Tensor]], checkpoint: str,
                      rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    kind, target = _spec(rank)
    if kind:
        log.warning("%s: injecting %s:%s into this load (tests only)", ENV, kind, target)
    for name, tensor in weights:
        if name == target and kind == "drop":
            continue
        if name == target and kind == "stale":
            tensor = _checkpoint_tensor(checkpoint, name, tensor)
        yield name, tensor
