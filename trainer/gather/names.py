"""Map trainer-side parameter names to the served checkpoint's names.

FSDP, activation checkpointing, torch.compile and DDP each insert a wrapper
segment into parameter names; the checkpoint has none of them.
"""

from __future__ import annotations

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def normalize_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    # DDP/DataParallel prefix only the first segment with "module".
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)
