"""Split tensors staged in place: each has one buffer of its own, and every
chunk is copied there as its bucket arrives.

A tensor larger than a bucket arrives split across buckets, and with every
trainer rank sending its own FSDP2 rows (trainer/gather/own_rows.py) every
sharded tensor arrives as one chunk per rank, in different buckets. Such a
bucket (`StagedBucket.scattered`: it holds a chunk) does not stay as it came:
it lands in a buffer lent for as long as it arrives and goes on to the next
replica (`ReceiveBuffers`), is checked there (its CRC and tag, on the bytes
the trainer sent), and then each of its slots is copied to its tensor's
place (`land`), while the next bucket arrives. The places are the
staged copy of those tensors, so a load hands vLLM views of them, as it
does of an unsplit bucket's slots, and copies nothing. Before, a split
tensor was reassembled at the load into a new tensor, and vLLM's layerwise
reload keeps every tensor it is given until the load ends (reload.py), so a
push of own rows cost the server the model once more at every load: twice
with TP 2, in GPU memory with device staging, which is why such servers
refused it.

What a push costs the server now: the staged copy (unsplit buckets plus
places), its receive buffers and one layer at the load
(bench/push_peak_memory.py measures it against a gathered push). Over
gloo's chain a trainer that asks (`ConnectRequest.slot_pieces`, every
trainer since) sends such a bucket slot by slot, and each piece is received
straight into its place (`Staging`'s receipt `in_place`;
protocol/data_plane/bucket_pieces.py): no receive buffer at all. Otherwise
a relay lends as many as it holds buckets at once: two for a broadcast,
senders in gloo's chain (one more on a rank that forwards), up to 2 x
senders in NCCL's fused steps; they give their pages back to the kernel
before the load (`ReceiveBuffers.idle`).

Every slot of a scattered bucket gets a place, unsplit ones too: the bucket
itself is not kept. Places are kept from push to push by name and size, so
a steady push allocates nothing; with shared staging (host_share.py) they
are the leader's files too, mapped by the followers at a load.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass, field

import torch

from rollout_sidecar.protocol.data_plane.wire_format import slot_bytes, torch_dtype
from rollout_sidecar.protocol.schema import TensorSlot
from rollout_sidecar.server.weights.worker.host_share import SharedBuffers

_UNMAPPED = torch.empty(0, dtype=torch.uint8)  # a follower's place between loads


def _where(p: TensorSlot) -> slice:
    """The slot's bytes inside its tensor's place."""
    start = p.chunk_offset or 0
    return slice(start, start + p.length)


@dataclass
class Places:
    """Every tensor of the scattered buckets: name -> its flat bytes."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # name -> whole tensor's bytes
    shared: SharedBuffers | None = None  # the leader's files, by place number
    _numbers: dict[str, int] = field(default_factory=dict)  # name -> its file's number

    def allocate(self, sizes: dict[str, int], device: torch.device, pin: bool) -> None:
        """A place for each tensor, last push's where name and size match."""
        old, self.buffers, self.sizes = self.buffers, {}, dict(sizes)
        self._numbers = {n: i for i, n in enumerate(sizes)}
        if self.shared is not None:
            if self.shared.leader:
                for name, nbytes in sizes.items():
                    self.buffers[name] = self.shared.buffer(self._numbers[name], nbytes)
                self.shared.keep_only(set(self._numbers.values()))
            return
        for name, nbytes in sizes.items():
            buf = old.pop(name, None)
            if buf is None or buf.numel() != nbytes or buf.device != device:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self.buffers[name] = buf

    def attach(self) -> None:
        """A follower: map the leader's places of this layout, afresh."""
        if self.shared is not None and not self.shared.leader:
            self.buffers = {n: self.shared.attach(self._numbers[n], size)
                            for n, size in self.sizes.items()}

    def detach(self) -> None:
        if self.shared is not None and not self.shared.leader:
            self.buffers = dict.fromkeys(self.sizes, _UNMAPPED)
            self.shared.drop()

    def drop(self) -> None:
        """Forget them all (a receive may still write into them)."""
        self.buffers, self.sizes, self._numbers = {}, {}, {}
        if self.shared is not None:
            self.shared.drop()

    @property
    def held_bytes(self) -> int:
        if self.shared is not None:
            return self.shared.nbytes if self.shared.leader else 0
        return sum(b.numel() for b in self.buffers.values())

    def read_back(self, params: list[TensorSlot], out: torch.Tensor) -> torch.Tensor:
        """A bucket's bytes again, from the places (`out`: zeros, its size);
        what lay between slots (alignment) is not kept and reads as zeros."""
        for p in params:
            slot_bytes(out, p).copy_(self.buffers[p.name][_where(p)])
        return out

    def tensor(self, p: TensorSlot) -> torch.Tensor:
        """The whole tensor `p` is a slot of, typed and shaped: a view."""
        return self.buffers[p.name].view(torch_dtype(p.dtype)).view(p.shape)


def land(places: dict[str, torch.Tensor], params: list[TensorSlot], data: torch.Tensor
         ) -> None:
    """Copy each slot of a bucket's bytes `data` to its tensor's place."""
    for p in params:
        places[p.name][_where(p)].copy_(slot_bytes(data, p))


class ReceiveBuffers:
    """Buffers lent to scattered buckets while they arrive, kept for the
    next bucket and the next push (never more than the relay's window)."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.size = 0
        self.device = torch.device("cpu")
        self.pin = False  # host buffers a GPU's slots copy into (staging.py: pinned)
        self.out = 0  # lent now
        self.most = 0  # lent at once, at most, this push

    def reset(self, size: int, device: torch.device, pin: bool = False) -> bool:
        """Buffers of `size` bytes on `device` (pinned host memory: `pin`)
        for this push's buckets; True where last push's were dropped."""
        dropped = bool(self.free) and (size, device, pin) != (self.size, self.device, self.pin)
        if dropped:
            self.free = []
        self.size, self.device, self.pin = size, device, pin
        self.out = self.most = 0
        return dropped

    def lend(self, nbytes: int) -> torch.Tensor:
        buf = self.free.pop() if self.free else torch.empty(
            self.size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        self.out += 1
        self.most = max(self.most, self.out)
        return buf[:nbytes]

    def give_back(self, buf: torch.Tensor) -> None:
        self.out -= 1
        base = buf._base if buf._base is not None else buf
        if base.numel() == self.size and base.device == self.device:
            self.free.append(base)

    def idle(self) -> None:
        """Every bucket arrived: the free buffers' pages go back to the kernel
        (a host buffer stays mapped and faults in zeros at the next push's
        first write). Dropping them instead frees nothing measurable: glibc
        keeps a freed 16 MiB block in its heap (measured: the resident set
        grew over 4 pushes). The price: the next push's first write into
        each buffer faults its pages in again (48 MiB: 11.8 ms against 2.5 ms
        into kept pages, measured), about 0.2 ms a MiB of the window. Pinned
        (a GPU server's) and device buffers stay as they are."""
        if self.pin or self.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
            return
        for buf in self.free:
            start = -(-buf.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
            end = (buf.data_ptr() + buf.numel()) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                mmap.MADV_DONTNEED)

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self.free)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
