"""Validate a push manifest against the served checkpoint, before any bytes move."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_sidecar.protocol.precisions import dtype_itemsize
from rollout_sidecar.protocol.schema import BeginRequest, TensorSlot, is_draft
from rollout_sidecar.protocol.schema.manifest_api import SLOT_ALIGN
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex
from rollout_sidecar.server.weights.adapter_check import AdapterFactors


@dataclass
class _Chunk:
    start: int
    nbytes: int
    field: str


class _ChunkCoverage:
    """A split tensor's chunks cover its bytes exactly once: no gap, no
    overlap. They may come in any order and anywhere in the manifest (each
    trainer rank sends the rows of its own shards, so one tensor's chunks
    interleave with the other ranks' buckets: capability `chunks:interleaved`);
    staging copies each chunk to its tensor's place as its bucket lands
    (worker/placed_tensors.py), so a chunk refused here is never written."""

    def __init__(self) -> None:
        self.split: dict[str, list[_Chunk]] = {}
        self.totals: dict[str, int] = {}

    def size(self, p: TensorSlot, total: int, itemsize: int, f: str) -> int:
        """Bytes the entry occupies in its bucket; raise if it is malformed."""
        if p.chunk_offset is None and p.nbytes is None:
            return total
        if p.chunk_offset is None or p.nbytes is None:
            raise BadRequest(f"{p.name}: a chunk needs both chunk_offset and nbytes",
                             f"{f}.chunk_offset")
        if p.chunk_offset % itemsize or p.nbytes % itemsize:
            raise BadRequest(f"{p.name}: chunk at byte {p.chunk_offset} of {p.nbytes} bytes "
                             f"splits an element of {itemsize} bytes", f"{f}.chunk_offset")
        if p.nbytes <= 0 or p.chunk_offset + p.nbytes > total:
            raise BadRequest(f"{p.name}: chunk of {p.nbytes} bytes at byte {p.chunk_offset} "
                             f"does not fit the tensor's {total} bytes", f"{f}.nbytes")
        self.split.setdefault(p.name, []).append(_Chunk(p.chunk_offset, p.nbytes, f))
        self.totals[p.name] = total
        return p.nbytes

    def finish(self) -> None:
        for name, chunks in self.split.items():
            covered = 0
            for c in sorted(chunks, key=lambda c: c.start):
                if c.start != covered:
                    what = "an overlap" if c.start < covered else "a gap"
                    raise BadRequest(f"{name}: chunk at byte {c.start}, but its chunks cover "
                                     f"bytes 0..{covered} before it ({what})",
                                     f"{c.field}.chunk_offset")
                covered += c.nbytes
            if covered != self.totals[name]:
                raise BadRequest(f"{name}: chunks cover only bytes 0..{covered} of "
                                 f"{self.totals[name]}", "buckets")


def _patch_size(p: TensorSlot, f: str) -> int:
    assert p.patch is not None
    if p.chunk_offset is not None or p.nbytes is not None:
        raise BadRequest(f"{p.name}: a patch is never split (no chunk_offset, nbytes)",
                         f"{f}.chunk_offset")
    if p.patch.changed > p.numel or (p.patch.form == "dense" and p.patch.changed != p.numel):
        raise BadRequest(f"{p.name}: {p.patch.changed} changed elements in a {p.patch.form} "
                         f"patch of a tensor of {p.numel}", f"{f}.patch.changed")
    return p.length


def _frozen_draft(index: CheckpointIndex, seen: set[str]) -> frozenset[str]:
    """The drafter's tensors when the push carries none of them."""
    return index.draft if not index.draft & seen else frozenset()


def carries_draft(req: BeginRequest) -> bool:
    """Whether a (checked) push loads the drafter too."""
    return any(is_draft(p.name) for b in req.buckets for p in b.params)


def check_manifest(req: BeginRequest, index: CheckpointIndex, serve_dtype: str,
                   max_lora_rank: int = 0) -> None:
    """Raise `BadRequest` naming the first offending field."""
    if not req.buckets:
        if req.delta_base is None or req.adapter is not None:
            raise BadRequest("buckets: empty; only a delta push (delta_base) of weights "
                             "that did not change may carry no bucket", "buckets")
        return  # unchanged: the staged copy of delta_base is the whole checkpoint
    seen: set[str] = set()
    whole: set[str] = set()  # sent unsplit: any other entry of it is a second copy
    chunks = _ChunkCoverage()
    factors = AdapterFactors(req.adapter, index, serve_dtype, max_lora_rank) \
        if req.adapter is not None else None
    # A delta push covers the checkpoint too: a slot per tensor, zero bytes
    # where nothing changed; the resident copy supplies the rest.
    for bi, bucket in enumerate(req.buckets):
        where = f"buckets[{bi}]"
        if bucket.index != bi:
            raise BadRequest(f"{where}.index is {bucket.index}, expected {bi}", f"{where}.index")
        if bucket.nbytes <= 0:
            raise BadRequest(f"{where}.nbytes must be > 0", f"{where}.nbytes")
        end_prev = 0
        for pi, p in enumerate(bucket.params):
            f = f"{where}.params[{pi}]"
            spec = index.tensors.get(p.name)
            if factors is not None and (adapted := factors.slot_spec(p, f)) is not None:
                spec = adapted
            if spec is None and p.name in index.ignored:
                raise BadRequest(f"{p.name!r} is in the checkpoint but vLLM drops it at load "
                                 "(see GET /weights/index 'ignored'); leave it out", f"{f}.name")
            if spec is None and is_draft(p.name) and not index.draft:
                raise BadRequest(f"{p.name!r} is a drafter's tensor, but this server has no "
                                 "drafter that takes pushes (serve --speculative-config with a "
                                 "drafter checkpoint of its own; see /info)", f"{f}.name")
            if spec is None:
                raise BadRequest(f"unknown parameter {p.name!r}: the served checkpoint has no "
                                 "such tensor (check name normalisation)", f"{f}.name")
            chunk = p.chunk_offset is not None or p.nbytes is not None
            if p.name in whole or (p.name in seen and not chunk):
                raise BadRequest(f"parameter {p.name!r} sent twice", f"{f}.name")
            seen.add(p.name)
            if not chunk:
                whole.add(p.name)
            if tuple(p.shape) != spec.shape:
                raise BadRequest(f"{p.name}: shape {list(p.shape)}, server expects "
                                 f"{list(spec.shape)}", f"{f}.shape")
            want = index.push_dtype(spec, serve_dtype)
            if p.dtype != want:
                raise BadRequest(f"{p.name}: dtype {p.dtype}, server expects {want} (floating "
                                 f"tensors travel in the serving dtype {serve_dtype}; the "
                                 "pusher casts: is it talking to another server?)", f"{f}.dtype")
            if (p.patch is not None) != (req.delta_base is not None):
                raise BadRequest(f"{p.name}: a delta push (delta_base) carries a patch in "
                                 "every slot, a dense push in none", f"{f}.patch")
            if p.patch is not None:
                size = _patch_size(p, f)
            else:
                size = chunks.size(p, dtype_itemsize(p.dtype) * spec.numel,
                                   dtype_itemsize(p.dtype), f)
            if p.offset < end_prev or p.offset % dtype_itemsize(p.dtype):
                raise BadRequest(f"{p.name}: offset {p.offset} overlaps or is misaligned",
                                 f"{f}.offset")
            end_prev = p.offset + size
            if end_prev > bucket.nbytes:
                raise BadRequest(f"{p.name}: ends at byte {end_prev}, bucket has "
                                 f"{bucket.nbytes}", f"{f}.offset")
        # A bucket is its slots, padded to the alignment at most: a larger
        # nbytes would make the server allocate (and a peer send) bytes no
        # slot reads.
        room = max(-(-end_prev // SLOT_ALIGN) * SLOT_ALIGN, SLOT_ALIGN)
        if bucket.nbytes > room:
            raise BadRequest(f"{where}.nbytes {bucket.nbytes}: its slots end at byte "
                             f"{end_prev}, so it may be {room} at most", f"{where}.nbytes")
    chunks.finish()
    if factors is not None:
        factors.finish()
        if req.adapter_only:  # the factors alone
            return
    missing = sorted(set(index.tensors) - seen - _frozen_draft(index, seen))
    # Every push is complete: vLLM's layerwise reload rebuilds a fused layer
    # (q/k/v, gate/up) from what was pushed, so a partial push would zero the rest.
    # The drafter's tensors are complete too, or absent (the drafter frozen).
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise BadRequest(f"push is missing {', '.join(missing[:5])}{more}; every push must "
                         "carry the whole checkpoint", "buckets")
