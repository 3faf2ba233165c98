"""A large FSDP2 parameter, gathered to rank 0 one block of rows at a time.

`full_tensor()` all-gathers a whole parameter on every rank: a 151936 x 4096
embedding is 1.2 GB in bf16 (2.4 GB in fp32) on every rank at once, however
small the buckets are. A `Shard(0)` parameter's rows lie in order across the
ranks (torch.chunk's split: ceil(N / W) rows each, the last ranks fewer or
none), so rows [a, b) live on one or two ranks. Each owner sends its part of
the block straight to rank 0 (point-to-point in the mesh's group), rank 0
holds one block at a time (at most `block_bytes`, or one row), and the other
ranks allocate nothing beyond the slice they send.

Parameters above half a block come this way (see `row_blockable`).
The blocks are collectives: every rank must draw the same blocks in the same
order. `iter_full_tensors` drains whatever a consumer left before it moves to
the next parameter, so a pack that fails half-way leaves no peer blocked.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

PACKING_RANK = 0  # the global rank that packs and sends the buckets


def row_blockable(p: torch.Tensor, block_bytes: int | None) -> bool:
    """A DTensor larger than half a block, sharded on dim 0 over a 1-D mesh
    that holds the trainer rank: FSDP2's default. Half, because
    `full_tensor()` holds about three copies of a parameter for a moment (the
    padded shards, the gathered pieces, their concatenation: measured in
    bench/push_memory_fsdp2.py), on every rank: so no whole gather holds more
    than 1.5 blocks. Anything else (HSDP's 2-D
    mesh, `shard_placement_fn` on another dim, strided shards under TP) is
    gathered whole by `full_tensor()`. The answer is the same on every rank."""
    if block_bytes is None or not hasattr(p, "placements") or p.dim() == 0:
        return False
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    placements = p.placements
    if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard:
        return False
    if placements[0].dim != 0 or p.numel() * p.element_size() <= block_bytes // 2:
        return False
    return PACKING_RANK in mesh.mesh.flatten().tolist()


class BlockBuffer:
    """One buffer for every block rank 0 receives, reused: fresh allocations
    of a block each would leave glibc's heap holding several of them after a
    push (its mmap threshold grows with each large free)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        need = math.prod(shape) * dtype.itemsize
        if self._buf is None or self._buf.device != device or self._buf.numel() < need:
            self._buf = None
            self._buf = torch.empty(max(need, self.nbytes), dtype=torch.uint8, device=device)
        return self._buf[:need].view(dtype).view(shape)


class RowBlocks:
    """Rows of one `Shard(0)` DTensor, in blocks, to rank 0. On rank 0
    `next_block()` returns the block's rows, in `buffer`: valid until the next
    call (on any `RowBlocks` sharing that buffer); on the other ranks it sends
    their part and returns None."""

    def __init__(self, p: Any, block_bytes: int, device: torch.device,
                 buffer: BlockBuffer | None = None) -> None:
        self.shape = tuple(p.shape)
        self.dtype = p.dtype
        self.device = device
        self._buffer = buffer or BlockBuffer(block_bytes)
        self._local = p.to_local()
        self._group = p.device_mesh.get_group()
        self._me = dist.get_rank(self._group)
        self._dst = dist.get_group_rank(self._group, PACKING_RANK)
        rows, world = self.shape[0], dist.get_world_size(self._group)
        per_rank = math.ceil(rows / world) if rows else 0
        # (group rank, first row, end row) of every rank that holds rows
        self._owners = [(r, r * per_rank, min(rows, (r + 1) * per_rank))
                        for r in range(world) if r * per_rank < rows]
        row_bytes = math.prod(self.shape[1:]) * p.element_size()
        self.rows_per_block = max(1, block_bytes // max(1, row_bytes))
        self._next_row = 0

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def done(self) -> bool:
        return self._next_row >= self.shape[0]

    def next_block(self) -> torch.Tensor | None:
        a = self._next_row
        b = min(self.shape[0], a + self.rows_per_block)
        if a >= b:
            raise RuntimeError("every block of this parameter was drawn already")
        self._next_row = b
        block = self._buffer.view((b - a, *self.shape[1:]), self.dtype, self.device) \
            if self._me == self._dst else None
        works = []
        for owner, first, end in self._owners:
            lo, hi = max(a, first), min(b, end)
            if lo >= hi:
                continue
            if owner == self._me == self._dst:  # rank 0's own rows: a local copy
                assert block is not None
                block[lo - a: hi - a].copy_(self._local[lo - first: hi - first])
            elif owner == self._me:  # ours, to rank 0 (moved to the mesh's device if offloaded)
                part = self._local[lo - first: hi - first].to(self.device).contiguous()
                works.append(dist.isend(part, group=self._group, group_dst=self._dst))
            elif self._me == self._dst:  # a peer's rows, straight into the block
                assert block is not None
                works.append(dist.irecv(block[lo - a: hi - a], group=self._group,
                                        group_src=owner))
        for w in works:
            w.wait()
        return block

    def drain(self) -> None:
        """Take part in every block not drawn yet (and drop them)."""
        while not self.done:
            self.next_block()

    def materialize(self) -> torch.Tensor | None:
        """The whole tensor (rank 0; None elsewhere), for code that needs it at
        once, such as transformers' reverse weight conversions."""
        blocks = []
        while not self.done:
            block = self.next_block()
            blocks.append(None if block is None else block.clone())  # the buffer is reused
        return torch.cat(blocks) if self._me == self._dst else None


class FlatCursor:
    """Elements of one tensor in order, from a whole tensor or from row
    blocks: `copy_to` fills a bucket's chunk from wherever its elements are,
    casting as it copies. Forward-only; a block is dropped once passed."""

    def __init__(self, source: torch.Tensor | RowBlocks, start: int = 0,
                 numel: int | None = None) -> None:
        """`start`, `numel`: `source` is a part of a larger tensor (a rank's
        own rows, gather/own_rows.py), from element `start` of its `numel`."""
        self._blocks: RowBlocks | None = None
        self._flat: torch.Tensor | None = None
        if isinstance(source, RowBlocks):
            self._blocks = source
        else:  # a whole tensor, flat: a view, or (not contiguous) one copy for all chunks
            self._flat = source.reshape(-1)
        self._start = start  # element index of self._flat[0] in the whole tensor
        self._numel = numel

    def numel(self) -> int:
        """Elements of the whole tensor."""
        if self._numel is not None:
            return self._numel
        if self._blocks is not None:
            return self._blocks.numel()
        assert self._flat is not None
        return self._flat.numel()

    def copy_to(self, dst: torch.Tensor, first: int) -> None:
        """dst (flat) <- elements [first, first + dst.numel())."""
        done, n = 0, dst.numel()
        while done < n:
            pos = first + done
            if self._flat is None or pos >= self._start + self._flat.numel():
                if self._blocks is None:
                    raise IndexError(f"element {pos} is past the tensor's end")
                if self._flat is not None:
                    self._start += self._flat.numel()
                self._flat = None  # dropped before the next block arrives
                block = self._blocks.next_block()
                if block is None:
                    raise RuntimeError("row blocks are copied on the rank they are drawn to")
                self._flat = block.reshape(-1)
                continue
            if pos < self._start:
                raise IndexError(f"element {pos} was already passed (cursor at {self._start})")
            k = min(n - done, self._start + self._flat.numel() - pos)
            dst[done: done + k].copy_(self._flat[pos - self._start: pos - self._start + k])
            done += k
