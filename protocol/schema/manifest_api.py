"""Wire types of what a push carries: the bucket manifest (pydantic only).
`POST /weights/begin` sends one (weights_api.py), the trainer's planner
builds it (trainer/pack/), the server checks and stages it
(server/weights/manifest_check.py, worker/staging.py), and a delta's
patches are sized by it before any diff is sent."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from rollout_sidecar.protocol.precisions import dtype_itemsize
from rollout_sidecar.protocol.schema.fields import Int, NonNegative, StrictModel, not_null

PatchFormName = Literal["dense", "index", "gaps", "bitmap"]
POSITION_ALIGN = 8  # a patch's values start at a multiple of this, after its positions
# Every slot starts at a multiple of this in its bucket (any dtype's view is
# aligned), and a bucket is its slots padded to it at most.
SLOT_ALIGN = 64


def patch_nbytes(form: str, numel: int, changed: int, itemsize: int) -> int:
    """Bytes of one patch slot: its positions (int32 indices, uint16 gaps or
    a bitmap; none when dense), padded to POSITION_ALIGN, then the changed
    values (protocol/data_plane/delta_codec.py reads and writes them)."""
    positions = {"dense": 0, "index": 4 * changed, "gaps": 2 * changed,
                 "bitmap": (numel + 7) // 8}[form]
    return -(-positions // POSITION_ALIGN) * POSITION_ALIGN + changed * itemsize


class PatchInfo(StrictModel):
    """A delta push's entry: the tensor's changes since the push's `delta_base`."""

    form: PatchFormName = Field(description="How the changed positions are written: "
                                "`index` (int32 flat positions), `gaps` (uint16 distances "
                                "from the previous position, the first from 0), `bitmap` "
                                "(one bit per element, LSB first), or `dense` (every value, "
                                "no positions).")
    changed: Int = Field(ge=0, description="Changed elements: the values after the "
                         "positions (every element for `dense`).")


class TensorSlot(StrictModel):
    """Where one tensor, or one chunk of it, sits inside a packed bucket: the
    one manifest entry type, built by the trainer's planner, sent in
    `POST /weights/begin`, staged and checked by the server.

    Floating tensors travel in the serving dtype; integer and bool tensors
    (persistent buffers such as routing tables) in their own. A tensor larger
    than a bucket, or sent by several trainer ranks (each its own rows), is
    split: its chunks carry `chunk_offset` and `nbytes` and cover its bytes
    exactly once. A server with the capability `chunks:interleaved` takes
    them in any order and anywhere in the manifest; an older one, in
    consecutive entries and in order."""

    name: str
    dtype: str
    shape: list[Int] = Field(description="The whole tensor's shape, also for a chunk.")
    offset: Int = Field(description="Byte offset in the bucket; aligned to the dtype size.")
    chunk_offset: Int | None = Field(
        None, json_schema_extra=not_null,
        description="A chunk: where it starts in the tensor's bytes (C order, wire dtype). "
        "Absent: the entry is the whole tensor.")
    nbytes: Int | None = Field(None, json_schema_extra=not_null,
                               description="A chunk: its length in bytes; with chunk_offset.")
    patch: PatchInfo | None = Field(
        None, json_schema_extra=not_null,
        description="A delta push's entry (the push names `delta_base`): the slot holds the "
        "tensor's changes, encoded, not the tensor. Never split.")

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of the whole tensor in its wire dtype."""
        return self.numel * dtype_itemsize(self.dtype)

    @property
    def length(self) -> int:
        """Bytes this entry occupies in its bucket: the chunk, the patch, or
        the whole tensor."""
        if self.patch is not None:
            return patch_nbytes(self.patch.form, self.numel, self.patch.changed,
                                dtype_itemsize(self.dtype))
        return self.nbytes if self.chunk_offset is not None and self.nbytes is not None \
            else self.tensor_nbytes

    @property
    def first(self) -> bool:
        """The entry where the tensor's bytes begin (the trainer draws it here)."""
        return not self.chunk_offset

    @property
    def last(self) -> bool:
        """The entry where the tensor's bytes end (the trainer drops it after)."""
        return self.chunk_offset is None or self.chunk_offset + self.length == self.tensor_nbytes


class BucketManifest(StrictModel):
    index: Int
    nbytes: Int
    params: list[TensorSlot]
    sender: NonNegative | None = Field(
        None, json_schema_extra=not_null,
        description="gloo/NCCL: the trainer's data-plane rank that sends this bucket, below "
        "the connection's `senders`. Absent: rank 0, the one sender of a trainer that "
        "predates every-rank sending.")

    @property
    def source(self) -> int:
        """The data-plane rank this bucket comes from."""
        return self.sender or 0
