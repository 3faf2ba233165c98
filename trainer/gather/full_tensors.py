"""Full tensors out of a (possibly sharded, offloaded) model, one at a time.

Every rank walks the same plan in the same order, so each collective
(FSDP2 `full_tensor()` or row blocks, FSDP1 `summon_full_params`) is entered
by all ranks together. Memory stays bounded: FSDP2 materialises one parameter
at a time, and one larger than half of `block_bytes` comes to rank 0 alone as
`RowBlocks`, one block of rows at a time (row_blocks.py); FSDP1 one FSDP unit
at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rollout_sidecar.trainer.gather.names import normalize_name
from rollout_sidecar.trainer.gather.row_blocks import BlockBuffer, RowBlocks, row_blockable


class MetaDeviceError(RuntimeError):
    """Some parameters were never materialised (still on the meta device)."""


@dataclass(frozen=True)
class ParamInfo:
    name: str  # normalised, as the served checkpoint names it
    shape: tuple[int, ...]
    dtype: torch.dtype


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP (and DataParallel) keep the real model in `.module`.
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module
    return model


def _fsdp1_units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m for m in FSDP.fsdp_modules(model) if m._handle is not None]


def _is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(m, FSDP) for m in model.modules())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def meta_modules(model: nn.Module) -> list[str]:
    """Names of modules holding a parameter whose data is on the meta device."""
    model = _unwrap(model)
    bad = []
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            if _local(p).is_meta:
                bad.append(normalize_name(mod_name) or "<root>")
                break
    return bad


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers a `state_dict()` would hold, by normalised name. Neither FSDP
    shards buffers, so every rank holds them whole."""
    model = _unwrap(model)
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.setdefault(normalize_name(f"{mod_name}.{name}" if mod_name else name), buf)
    return out


def param_plan(model: nn.Module, buffers: Sequence[str] = ()) -> list[ParamInfo]:
    """Names, global shapes and dtypes, in gather order; no collective.
    `buffers` (persistent buffer names) come last, after every parameter."""
    model = _unwrap(model)
    if _is_fsdp1(model):
        plan = []
        for unit in _fsdp1_units(model):
            flat = unit._handle.flat_param
            prefix = _unit_prefix(model, unit)
            for fqn, shape in zip(flat._fqns, flat._shapes, strict=True):
                plan.append(ParamInfo(normalize_name(prefix + fqn), tuple(shape), flat.dtype))
    else:
        plan = [ParamInfo(normalize_name(n), tuple(p.shape), p.dtype)
                for n, p in model.named_parameters()]
    bufs = persistent_buffers(model) if buffers else {}
    return plan + [ParamInfo(n, tuple(bufs[n].shape), bufs[n].dtype) for n in buffers]


def _unit_prefix(root: nn.Module, unit: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is unit:
            return name + "." if name else ""
    raise RuntimeError("FSDP unit not found under the model")


def iter_full_tensors(model: nn.Module, device: torch.device | None = None,
                      buffers: Sequence[str] = (), block_bytes: int | None = None,
                      only: Callable[[str], bool] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor | RowBlocks]]:
    """Yield (normalised name, full tensor) in `param_plan` order, on every rank.

    `device` is the compute device for gathers; params offloaded to the CPU are
    brought there for the all-gather only, and nothing new stays on it.
    With `block_bytes` (the same on every rank), an FSDP2 parameter larger than
    half that comes as `RowBlocks` (see `row_blockable`) instead of a tensor: the consumer draws its
    blocks; whatever it left is drawn here before the next parameter, so the
    ranks' collectives stay in step.
    Buffers need no collective, so a rank that only takes part in the gathers
    may leave `buffers` empty. With `only` (the same on every rank), just the
    parameters whose normalised name it accepts are gathered (an adapter
    push: FSDP1 gathers the units holding one).
    """
    model = _unwrap(model)
    if _is_fsdp1(model):
        yield from _iter_fsdp1(model, only)
    else:
        buffer = BlockBuffer(block_bytes or 0)  # one for every parameter's blocks
        for name, p in model.named_parameters():
            if only is not None and not only(normalize_name(name)):
                continue
            p = p.detach()
            if block_bytes is not None and row_blockable(p, block_bytes):
                blocks = RowBlocks(p, block_bytes, _mesh_device(p, device), buffer)
                yield normalize_name(name), blocks
                blocks.drain()
            else:
                yield normalize_name(name), _full(p, device)
    bufs = persistent_buffers(model) if buffers else {}
    for name in buffers:
        yield name, bufs[name].detach()


def _mesh_device(p: torch.Tensor, device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    mesh_type = p.device_mesh.device_type
    return torch.device(mesh_type, torch.accelerator.current_device_index()) \
        if mesh_type != "cpu" else torch.device("cpu")


def _full(p: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    if not hasattr(p, "full_tensor"):
        return p
    # Offloaded (CPUOffloadPolicy, or moved by hand): the all-gather must run on
    # the mesh's device. The moved copy is a temporary and is freed after this.
    if p.to_local().device.type != p.device_mesh.device_type:
        p = p.to(_mesh_device(p, device))
    return p.full_tensor()


def _iter_fsdp1(model: nn.Module, only: Callable[[str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in _fsdp1_units(model):
        flat = unit._handle.flat_param
        prefix = _unit_prefix(model, unit)
        wanted = [f for f in flat._fqns
                  if only is None or only(normalize_name(prefix + f))]
        if not wanted:
            continue
        # recurse=False: only this unit's flat parameter is gathered.
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            by_name = {normalize_name(n): p
                       for n, p in unit.named_parameters(remove_duplicate=False)}
            for fqn in wanted:
                t = by_name.get(normalize_name(fqn))
                if t is None:
                    raise RuntimeError(f"FSDP1 unit parameter {fqn!r} not found after gather")
                yield normalize_name(prefix + fqn), t.detach()
