"""Rank 0's half of a push: pack gathered tensors into buckets and send them.

Double-buffered: bucket k is on the wire while k+1 is gathered and packed.
Each tensor is cast to its wire dtype in place in the bucket, then checked for
NaN/inf (after the cast, so an fp16 overflow counts). A tensor split across
buckets (buckets.py) is drawn from the gathers once, at its first chunk, and
kept until its last chunk is packed; each chunk casts and checks its own
elements, so every element is cast and checked exactly once, and no cast copy
of the whole tensor is ever made. A large FSDP2 parameter arrives as row
blocks (gather/row_blocks.py) rather than whole: a `FlatCursor` draws them as the
chunks need them, so rank 0 holds one block besides the two buffers. After the first error
the loop keeps drawing tensors, so rank 0 keeps taking part in every FSDP
gather and no peer is left blocked, but sends nothing more. Every exception
becomes the returned error, never a raise: the pusher then agrees on it with
the other ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from rollout_sidecar.protocol.data_plane.bucket_check import bucket_check
from rollout_sidecar.protocol.data_plane.bucket_pieces import holds_chunk, spans
from rollout_sidecar.protocol.data_plane.delta_codec import Patch, write
from rollout_sidecar.protocol.data_plane.wire_format import slot_bytes, torch_dtype
from rollout_sidecar.protocol.failpoints import fire
from rollout_sidecar.protocol.schema import BucketManifest, Check, TensorSlot
from rollout_sidecar.trainer.errors import Error  # (kind, message): see errors.py
from rollout_sidecar.trainer.gather.own_rows import OwnRows
from rollout_sidecar.trainer.gather.row_blocks import PACKING_RANK, FlatCursor, RowBlocks
from rollout_sidecar.trainer.pack.finite import all_finite
from rollout_sidecar.trainer.transport.base import Pending, Sends


class BucketSender:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def release(self) -> None:
        """Free the send buffers (the pusher is closed); the next send allocates."""
        self._buffers = []

    def _buffers_for(self, size: int, device: torch.device) -> list[torch.Tensor]:
        # Reused across pushes: a steady-state push allocates nothing.
        b = self._buffers
        if not b or b[0].numel() < size or b[0].device != device:
            pin = device.type == "cpu" and torch.cuda.is_available()
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=device,
                                         pin_memory=pin) for _ in range(2)]
        return self._buffers

    def send_all(self, buckets: list[BucketManifest],
                 tensors: Iterator[tuple[str, torch.Tensor]] | OwnRows,
                 transport: Sends, push_ids: list[str], *, sender: int | None = None,
                 check: Check = "crc32") -> tuple[list[int], Error | None]:
        """Send every bucket; returns the check values and the first error.
        `push_ids` (each replica's id of the push) go to `transport.send` as
        they are. With `sender` (every rank sends: pusher.py), only the
        buckets whose manifest names this rank are packed and sent, and the
        values are theirs, in order; every tensor is still drawn, so this rank
        takes part in every gather. `OwnRows` instead of gathered tensors:
        this rank's buckets hold only its own rows (gather/own_rows.py),
        read by name; nothing is drawn, as nothing is gathered."""
        mine = [b for b in buckets if sender is None or b.source == sender]
        own = tensors if isinstance(tensors, OwnRows) else None
        drawn = iter(()) if isinstance(tensors, OwnRows) else tensors
        if not mine:  # an unchanged delta, or no share for this rank: nothing to send
            if not isinstance(tensors, OwnRows):
                for _ in _drawn(buckets, tensors):
                    pass
            return [], None
        buffers = self._buffers_for(max(b.nbytes for b in mine), transport.buffer_device)
        in_flight: list[Pending | None] = [None, None]
        flying = [0, 0]  # the bucket each buffer is sending
        checksums: list[int] = []
        chk = bucket_check(check)  # (an HTTP push's is the default: the server takes no other)
        # gloo/NCCL with a connection secret: this push's keyed tags (bucket_mac.py).
        macs = transport.bucket_macs
        err: Error | None = None
        name, full = "", None  # the tensor being packed, until its last chunk
        sent = 0  # this rank's buckets so far: they take turns in the two buffers
        for b in buckets:
            ours = sender is None or b.source == sender
            slot = sent % 2
            flight = in_flight[slot]
            if ours and flight is not None and err is None:
                err = _wait(flight, f"sending bucket {flying[slot]}")
                in_flight[slot] = None
            buf = buffers[slot][: b.nbytes] if ours else None
            for s in b.params:
                if own is not None:  # own rows: no gather, only this rank's buckets
                    if ours and err is None:
                        name, full, err = _own(own, s)
                elif s.first:  # gathered on every rank, same order; a split tensor once
                    name, full = next(drawn)
                    # Another rank's row blocks: only rank 0 gets their rows.
                    drawn_only = not ours and isinstance(full, RowBlocks)
                    if ours and isinstance(full, RowBlocks) and sender not in (None,
                                                                               PACKING_RANK):
                        err = err or ("push", f"{name} comes in row blocks, to rank "
                                      f"{PACKING_RANK} alone, but bucket {b.index} is rank "
                                      f"{sender}'s (every rank sends without row blocks)")
                    if (not s.last or isinstance(full, RowBlocks)) and err is None \
                            and not drawn_only:
                        full, err = _cursor(name, full)
                if err is None and buf is not None:
                    err = _pack(buf, s, name, full)
                if s.last and own is None:
                    full = None  # freed before the next gather
            if err is not None or buf is None:
                continue  # keep gathering so peers never hang; send nothing more
            sent += 1
            flying[slot] = b.index
            try:
                # A test's stand-in for the bytes on the wire, or None (failpoints.py).
                wire = fire("push.send", index=b.index, buf=buf)
                wire = buf if wire is None else wire
                if transport.checksum_in_request:
                    checksums.append(chk.compute(buf))
                    in_flight[slot] = transport.send(b.index, wire, push_ids, checksums[-1])
                else:
                    # The values (and tags) travel with the prepare, so compute
                    # them while the bucket is on the wire (ISA-L and hashlib
                    # release the GIL). An NCCL bucket's sum64 is computed in
                    # device memory; it comes to the host only for a CRC or a tag.
                    # A bucket holding a chunk, cut slot by slot where the
                    # connection asked: each piece lands in its place (bucket_pieces.py).
                    pieces = spans(b.nbytes, b.params) \
                        if transport.slot_pieces and holds_chunk(b.params) else None
                    in_flight[slot] = transport.send(b.index, wire, push_ids, None, pieces)
                    if chk.on_device:
                        checksums.append(chk.compute(buf))
                    host = None if not chk.needs_host_copy(tagged=macs is not None) else (
                        buf if buf.is_cpu else buf.cpu())
                    if not chk.on_device:
                        checksums.append(chk.compute(host))
                    if macs is not None:
                        macs.add(b.index, host)
            except Exception as e:
                err = ("push", f"sending bucket {b.index} failed: {type(e).__name__}: {e}")
        for w in in_flight:
            if w is not None and err is None:
                err = _wait(w, "sending the last buckets")
        return checksums, err


def _drawn(buckets: list[BucketManifest], tensors: Iterator[tuple[str, torch.Tensor]]
           ) -> Iterator[str]:
    """Draw every tensor the buckets hold, packing nothing (this rank's
    part in the gathers)."""
    for b in buckets:
        for s in b.params:
            if s.first:
                yield next(tensors)[0]


def _own(own: OwnRows, slot: TensorSlot
         ) -> tuple[str, torch.Tensor | FlatCursor | None, Error | None]:
    try:
        return slot.name, own.source(slot), None
    except Exception as e:  # a name the model lacks: agreed on at the commit
        return slot.name, None, ("push", f"packing {slot.name} failed: {type(e).__name__}: {e}")


def _cursor(name: str, full: torch.Tensor | RowBlocks
            ) -> tuple[FlatCursor | None, Error | None]:
    """A split tensor (or row blocks), flat, once for all its chunks: a view,
    or (not contiguous) one copy, never one per chunk."""
    try:
        return FlatCursor(full), None
    except Exception as e:
        return None, ("push", f"packing {name} failed: {type(e).__name__}: {e}")


def _pack(buf: torch.Tensor, slot: TensorSlot, name: str, full: torch.Tensor | FlatCursor
          ) -> Error | None:
    """Cast `full` (a tensor, or a cursor over a split or row-blocked one: only
    the slot's chunk) into the bucket."""
    if name != slot.name:
        return ("push", f"gather order changed: got {name}, planned {slot.name}")
    if slot.patch is not None:
        return _pack_patch(buf, slot, name, full)
    try:
        dtype = torch_dtype(slot.dtype)
        view = slot_bytes(buf, slot).view(dtype)
        if isinstance(full, torch.Tensor):
            view.view(slot.shape).copy_(full)
        elif full.numel() * dtype.itemsize != slot.tensor_nbytes:
            return ("push", f"packing {name} failed: {full.numel()} elements, planned "
                    f"shape {list(slot.shape)}")
        else:
            full.copy_to(view, (slot.chunk_offset or 0) // dtype.itemsize)
        if dtype.is_floating_point and not all_finite(view):
            return ("nonfinite", f"refusing to push: {name} holds NaN or inf (first such "
                    f"tensor, after casting to {dtype}); the server keeps serving the "
                    "previous version")
    except Exception as e:  # an OOM, a shape mismatch: agreed on with the other ranks
        return ("push", f"packing {name} failed: {type(e).__name__}: {e}")
    return None


def _pack_patch(buf: torch.Tensor, slot: TensorSlot, name: str, patch: object) -> Error | None:
    """A delta push's slot: the patch's positions and values (delta_codec.py);
    its values are checked for NaN/inf like a dense tensor's."""
    if not isinstance(patch, Patch):  # the gather failed: patch_gather.py says why
        return ("push", f"packing {name} failed: {patch}")
    try:
        if patch.values.is_floating_point() and not all_finite(patch.values):
            return ("nonfinite", f"refusing to push: {name} holds NaN or inf (first such "
                    f"tensor, in the delta after casting to {slot.dtype}); the server keeps "
                    "serving the previous version")
        write(patch, slot_bytes(buf, slot))
    except Exception as e:
        return ("push", f"packing {name} failed: {type(e).__name__}: {e}")
    return None


def _wait(work: Pending, what: str) -> Error | None:
    try:
        work.wait()
    except Exception as e:
        # gloo leads with its source path; a timeout there means no progress
        # for the stall bound (the group's per-operation timeout).
        text = re.sub(r"^\[[^\]]*\] ", "", str(e)).split(". This is typically")[0]
        stalled = "the data plane stalled: " if "Timed out" in text else ""
        return ("push", f"{what} failed: {stalled}{type(e).__name__}: {text}")
    return None
