"""Every dtype's facts in one table: one row per precision a checkpoint, a push
or the engine may hold, and the one rule for the bytes of any other.

Before this table each fact lived where it was used: the wire's itemsize
(schema/manifest_api.py), the checkpoint's header codes, floating set and
widths (server/model/checkpoint_index.py), the served width (the engine's
config), the finite check's bit patterns (trainer/pack/finite.py) and the
probe's tolerance (trainer/probe.py), five tables that had to agree. A new
precision is now one row here; each of those asks the row.

Names are torch's spelling (`"bfloat16"`), the manifest's and /info's; no
torch here (the client and the schema import this): a torch dtype is
`protocol/data_plane/wire_format.torch_dtype(name)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the torch dtype `name` ("bfloat16" -> 2), read off
    its name without torch: its bits, a byte at least (bool, and sub-byte or
    packed dtypes, take one). torch's own for every torch dtype (tested), so
    the wire can size any dtype a push carries, rows or not."""
    bits = re.search(r"\d+", name)
    if name != "bool" and bits is None:
        raise ValueError(f"unknown dtype {name!r}")
    return max(1, int(bits.group()) // 8) if bits else 1


@dataclass(frozen=True)
class Precision:
    name: str  # torch's spelling
    safetensors: str  # the code a safetensors header gives it
    floating: bool = False
    # NaN or inf without float math (trainer/pack/finite.py): the element's
    # bits without the sign, read as a same-size integer, are at least those
    # of +inf. None: the encoding differs (float8), so `torch.isfinite`.
    magnitude_mask: int | None = None
    inf_bits: int | None = None
    # The probe's default tolerance (mean |dlogp|) when this is the coarser of
    # the served and the trainer's logit precision (trainer/probe.py): fp32
    # serving matches a fp32 forward to ~1e-7, bf16 and fp16 round differently
    # in each engine, so only gross errors show there.
    probe_tolerance: float | None = None
    # vLLM serves weights in it (`serve --dtype`; the server's settings).
    served: bool = False

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.name)


PRECISIONS = {p.name: p for p in (
    Precision("float64", "F64", floating=True,
              magnitude_mask=0x7FFF_FFFF_FFFF_FFFF, inf_bits=0x7FF0_0000_0000_0000),
    Precision("float32", "F32", floating=True, magnitude_mask=0x7FFF_FFFF,
              inf_bits=0x7F80_0000, probe_tolerance=1e-3, served=True),
    Precision("bfloat16", "BF16", floating=True, magnitude_mask=0x7FFF, inf_bits=0x7F80,
              probe_tolerance=0.1, served=True),
    Precision("float16", "F16", floating=True, magnitude_mask=0x7FFF, inf_bits=0x7C00,
              probe_tolerance=0.05, served=True),
    Precision("float8_e4m3fn", "F8_E4M3", floating=True),
    Precision("float8_e5m2", "F8_E5M2", floating=True),
    Precision("int64", "I64"),
    Precision("int32", "I32"),
    Precision("int16", "I16"),
    Precision("int8", "I8"),
    Precision("uint8", "U8"),
    Precision("bool", "BOOL"),
)}
# A precision the probe has no row for is judged as loosely as bf16.
LOOSEST_PROBE_TOLERANCE = 0.1
SERVED = tuple(p.name for p in PRECISIONS.values() if p.served)
FLOATING = frozenset(p.name for p in PRECISIONS.values() if p.floating)
_BY_SAFETENSORS = {p.safetensors: p.name for p in PRECISIONS.values()}


def precision(name: str) -> Precision:
    """The row of `name`; a ValueError names the known ones."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(PRECISIONS)}, not {name!r}") from None


def from_safetensors(code: str) -> str:
    """A safetensors header's dtype code ("BF16") as torch's name; a code
    with no row is kept as it is (the index then refuses it by name)."""
    return _BY_SAFETENSORS.get(code, code)


def probe_tolerance(*names: str) -> float:
    """The probe's default tolerance for logits made at these precisions:
    the coarsest one's."""
    return max(_tolerance(n) for n in names)


def _tolerance(name: str) -> float:
    row = PRECISIONS.get(name)
    tol = row.probe_tolerance if row is not None else None
    return tol if tol is not None else LOOSEST_PROBE_TOLERANCE
