"""The tests' one way to shard a model, and one oracle of its full weights.

`wrap(model, wrapper, layers)`: "plain" leaves it as it is; "fsdp2" calls
`fully_shard` on each layer, then on the root; "hsdp" does the same over a
2-D mesh (2 replica groups, each sharding over half the ranks); "fsdp1"
wraps it in FSDP with
each layer's class auto-wrapped, on CPU (`device_id=cpu`, as FSDP1 needs
there) with `use_orig_params`.

`full_state_dict(model, wrapper)`: torch's own unsharded weights, never our
gather (a collective: every rank calls it). FSDP2: `get_model_state_dict`;
FSDP1: `summon_full_params` (its `get_model_state_dict` segfaulted on CPU
here) with the persistent buffers, which FSDP never shards; plain: the
parameters and persistent buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

WRAPPERS = ("plain", "fsdp2", "hsdp", "fsdp1")


def wrap(model: torch.nn.Module, wrapper: str,
         layers: Iterable[torch.nn.Module] | None = None) -> torch.nn.Module:
    """`layers`: the units to shard; default: a causal LM's `model.layers`."""
    layers = list(layers) if layers is not None else list(model.model.layers)
    if wrapper in ("fsdp2", "hsdp"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard")) \
            if wrapper == "hsdp" else None
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}),
                    device_id=torch.device("cpu"), use_orig_params=True)
    if wrapper != "plain":
        raise ValueError(f"wrapper must be one of {WRAPPERS}, not {wrapper!r}")
    return model


def full_state_dict(model: torch.nn.Module, wrapper: str) -> dict[str, torch.Tensor]:
    """Name -> a detached copy, names as torch prints them for that wrapper
    (FSDP1's wrapper prefixes cleaned)."""
    if wrapper in ("fsdp2", "hsdp"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in sd.items()}
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        with FSDP.summon_full_params(model, writeback=False):
            sd = {clean_tensor_name(k): v.detach().clone() for k, v in model.named_parameters()}
        clean = clean_tensor_name
    else:
        sd = {k: v.detach().clone() for k, v in model.named_parameters()}

        def clean(name: str) -> str:
            return name
    for mod_name, m in model.named_modules():  # persistent buffers are never sharded
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                sd[clean(f"{mod_name}.{name}" if mod_name else name)] = buf.detach().clone()
    return sd
