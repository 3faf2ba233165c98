"""Every transport, by what the push path asks of it: the one place its name
means anything. Both sides look a transport up here and ask it (does it join
the trainer's group, can it relay a bucket, where do buckets land), never
compare its name; each side then registers its own half under the same name:
the trainer's sender (trainer/transport/registry.py) and the server's receive
(server/weights/receivers.py). The wire's `Transport`
(protocol/schema/weights_api.py) is the names of this table.

Adding a transport is a row here and a sender class in the trainer; the
server's `Receiver` is built from the row, and a transport that neither joins
the group nor comes over HTTP adds its receive path on the server
(worker/receive_paths.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fanout = Literal["broadcast", "chain"]


@dataclass(frozen=True)
class TransportKind:
    name: str
    # The bytes come over the trainer's data-plane group (bucket_group.py), a
    # torch.distributed backend of this name; otherwise as HTTP bodies.
    joins_group: bool
    # A bucket can be relayed rank to rank in pieces (`fanout="chain"`), which
    # several senders need (point to point: a broadcast would carry every
    # bucket to every sender too). NCCL relays in fused steps
    # (data_plane/chain_steps.py).
    chains: bool = False
    # The chain is also the default with more than one receiver: gloo's
    # broadcast is a binomial tree of whole buffers; NCCL's is a pipelined ring.
    chains_by_default: bool = False
    # Buckets travel in GPU memory (NCCL): a receiving worker sets its CUDA
    # device first, and a host-staged copy goes through a device bounce buffer.
    on_device: bool = False

    @property
    def needs_gpu(self) -> bool:
        return self.on_device

    def fanout(self, world_size: int) -> Fanout:
        """The default fan-out of a group of `world_size` ranks: a chain where
        one can relay and more than one rank receives."""
        return "chain" if self.chains_by_default and world_size > 2 else "broadcast"

    def check_fanout(self, fanout: str) -> None:
        if fanout == "chain" and not self.chains:
            raise ValueError(f"fanout chain relays a bucket between the group's ranks, which "
                             f"{self.name} has none of: gloo or nccl")


TRANSPORTS = {t.name: t for t in (
    TransportKind("gloo", joins_group=True, chains=True, chains_by_default=True),  # host memory
    TransportKind("nccl", joins_group=True, chains=True, on_device=True),  # GPU to GPU
    TransportKind("http", joins_group=False),  # only the HTTP port open between the two
)}


def transport(name: str) -> TransportKind:
    """The transport of this name; a ValueError names the known ones."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, not {name!r}"
                         ) from None
