"""Every transport, in one table: what the push path asks of it, and both of
its halves. Both sides look a transport up here and ask it (does it join the
trainer's group, can it relay a bucket, where do buckets land), never compare
its name. Each row names its trainer half (`sender`: the class a pusher sends
with, built by `from_config`) and its server half (`receive`: the receive
path a worker opens a push with, server/weights/worker/receive_paths.py), as
vLLM's weight_transfer/factory.py names its engines: by module and class,
imported only by the side that runs it (the trainer never imports the
server's half, nor the server the trainer's). The wire's `Transport`
(protocol/schema/weights_api.py) is the names of this table.

Adding a transport is a row here, its sender class in trainer/transport/ and,
unless its bytes come over the trainer's group or HTTP as an existing one's
do, its receive path; tests/test_transport_registry_units.py checks that
every row's halves exist and are what the row says.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

Fanout = Literal["broadcast", "chain"]


@dataclass(frozen=True)
class TransportKind:
    name: str
    # "module:Class" of each half: the trainer's sender, the worker's receive path.
    sender: str
    receive: str
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

    def sender_class(self) -> Any:
        """The trainer's half (trainer/transport/base.py's `Transport`)."""
        return _load(self.sender)

    def receive_class(self) -> Any:
        """The server worker's half (receive_paths.py's `ReceivePath`)."""
        return _load(self.receive)

    def check_fanout(self, fanout: str) -> None:
        if fanout == "chain" and not self.chains:
            raise ValueError(f"fanout chain relays a bucket between the group's ranks, which "
                             f"{self.name} has none of: gloo or nccl")


_PKG = "rollout_sidecar"
TRANSPORTS = {t.name: t for t in (
    # Host memory over a torch.distributed group.
    TransportKind("gloo", f"{_PKG}.trainer.transport.distributed:DistributedTransport",
                  f"{_PKG}.server.weights.worker.receive_paths:GroupReceive",
                  joins_group=True, chains=True, chains_by_default=True),
    # GPU to GPU over a torch.distributed group.
    TransportKind("nccl", f"{_PKG}.trainer.transport.distributed:DistributedTransport",
                  f"{_PKG}.server.weights.worker.receive_paths:GroupReceive",
                  joins_group=True, chains=True, on_device=True),
    # Only the HTTP port open between the two: buckets as request bodies.
    TransportKind("http", f"{_PKG}.trainer.transport.http_upload:HttpUploadTransport",
                  f"{_PKG}.server.weights.worker.receive_paths:HttpStage",
                  joins_group=False),
)}


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def transport(name: str) -> TransportKind:
    """The transport of this name; a ValueError names the known ones."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, not {name!r}"
                         ) from None
