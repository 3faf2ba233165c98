"""The base SkyRL's deltas apply to: the weights this server serves, in the
checkpoint's dtypes.

Why: a SkyRL trainer that restarts calls /init_weight_transfer_engine again
while the server serves a version it pushed (v2, say). Its next delta (v3)
is against v2. A base read back from the checkpoint on disk and labelled v2
made v3 silently undo every tensor v2 had changed and the delta did not
touch. So the base is always the served version's bytes:

- the base this server already holds, if it is of the served version (the
  trainer restarted, the server did not);
- else the checkpoint, if the server serves it (version 0);
- else the staged copy of the served version (a restarted server that caught
  up from a peer, or a version a WeightPusher pushed), each tensor cast back
  to its checkpoint dtype where that is exact, with the tensors vLLM does
  not load (the staged copy lacks them) from the checkpoint;
- else the init is refused, naming the version and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from rollout_sidecar.protocol.precisions import PRECISIONS
from rollout_sidecar.protocol.schema import StagedCopy
from rollout_sidecar.server.errors import PushConflict

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.service import WeightService

# The stored dtypes a served tensor is cast back to (protocol/precisions.py's
# rows), but float8: such a tensor keeps the served dtype (None below), since a
# cast to float8 rarely gives back the served bytes.
_CAST_BACK = {p.safetensors: p.name for p in PRECISIONS.values()
              if not p.name.startswith("float8")}


def checkpoint_dtypes(folder: Path) -> dict[str, torch.dtype | None]:
    """Every tensor's stored dtype (None: one this module does not cast),
    read from the safetensors headers only."""
    out: dict[str, torch.dtype | None] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                code = f.get_slice(name).get_dtype()
                out[name] = torch_dtype(_CAST_BACK[code]) if code in _CAST_BACK else None
    return out


def checkpoint_tensors(folder: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as stored (`names` only, if given)."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if names is None or name in names:
                    out[name] = f.get_tensor(name).contiguous()
    return out


async def staged_tensors(svc: WeightService, version: int) -> dict[str, torch.Tensor]:
    """The staged copy's tensors, in their wire dtypes; refused if it does
    not hold `version` or moves while read."""
    try:
        copy: StagedCopy = await svc.peer_copy.manifest()
    except PushConflict as e:
        raise PushConflict(f"version {version} serves, but this server holds no staged copy "
                           f"of it to base SkyRL's deltas on ({e})") from None
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, tuple[torch.dtype, list[int]]] = {}
    for b in copy.buckets:
        held, data = await svc.peer_copy.bucket(b.index)
        if held != version or copy.version != version:
            raise PushConflict(f"the served version moved from {version} to {held} while its "
                               "staged copy was read: call /init_weight_transfer_engine again")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for p in b.params:
            dtype = torch_dtype(p.dtype)
            whole = torch.Size(p.shape).numel() * dtype.itemsize
            start, n = p.chunk_offset or 0, p.nbytes if p.nbytes is not None else whole
            target = out.setdefault(p.name, torch.empty(whole, dtype=torch.uint8))
            target[start:start + n] = raw[p.offset:p.offset + n]
            meta[p.name] = (dtype, p.shape)
    return {name: flat.view(meta[name][0]).view(meta[name][1]) for name, flat in out.items()}


def as_checkpoint(served: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype | None],
                  version: int) -> dict[str, torch.Tensor]:
    """`served` in the checkpoint's dtypes, where the cast gives back exactly
    the bytes the trainer had: refused where the served dtype is narrower."""
    out = {}
    for name, t in served.items():
        want = dtypes.get(name) or t.dtype
        back = t.to(want)
        if want.itemsize > t.dtype.itemsize or not torch.equal(back.to(t.dtype), t):
            raise PushConflict(
                f"version {version} serves {name} in {t.dtype}, which cannot give back its "
                f"checkpoint dtype {want} that SkyRL's deltas apply to: serve with --dtype "
                "matching the trainer's, or restart the server and SkyRL's sync together")
        out[name] = back
    return out
