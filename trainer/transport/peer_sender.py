"""Every trainer rank sends: a connection's rendezvous, shared by rank 0 with
its peers, and a peer rank's sending side.

A connection whose `senders` is N > 1 puts trainer ranks 0 .. N-1 in the
data-plane group, ahead of every worker of every replica, and each bucket
comes from the rank its manifest names (`BucketManifest.sender`, shared out
by bytes, pack/bucket_senders.py). Rank 0 alone talks to the servers: it
draws the rendezvous (`Rendezvous`: the connection id and secret, the store,
the group's size), the pusher broadcasts it over the trainer's own process
group, and ranks 1 .. N-1 join the group with it while rank 0 connects every
replica (distributed.py). The bytes then go point to point, down the chain,
to the first receiver (rank N): a broadcast would carry every bucket to every
sender too, so several senders need `fanout` chain (gloo, or NCCL in fused
steps: data_plane/chain_steps.py). The secret travels
over the trainer's own process group, as its gradients do; it is never
logged (`repr=False`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group, send_bucket
from rollout_sidecar.protocol.data_plane.bucket_mac import PushMacs
from rollout_sidecar.protocol.data_plane.bucket_pieces import Span
from rollout_sidecar.protocol.data_plane.ring_route import entry
from rollout_sidecar.protocol.transports import Fanout, transport


@dataclass(frozen=True)
class Rendezvous:
    """What every sending rank needs to join one connection's group."""

    connection_id: str
    backend: str
    store_host: str
    store_port: int
    world_size: int  # senders + every worker of every replica
    senders: int  # trainer ranks 0 .. senders - 1 send
    rank_offsets: tuple[int, ...]  # each replica's first worker rank
    fanout: Fanout
    join_s: float  # forming the group
    op_s: float  # each operation once formed: the stall bound
    authenticate_buckets: bool
    secret: bytes = dataclasses.field(repr=False)
    # gloo, several replicas: where each bucket enters the chain (ring_route.py).
    ring_starts: tuple[int, ...] | None = None
    # gloo's chain: a bucket holding a chunk goes slot by slot (bucket_pieces.py).
    slot_pieces: bool = False


class PeerSender:
    """A trainer rank other than 0 that sends its share of each push: the
    group it joined, and the `Transport` surface `BucketSender` uses (no
    control plane: rank 0 talks to the servers)."""

    checksum_in_request = False

    def __init__(self) -> None:
        self.rendezvous: Rendezvous | None = None
        self.group: Any = None
        self.bucket_macs: PushMacs | None = None
        self.slot_pieces = False  # the connection's (bucket_pieces.py)

    @property
    def buffer_device(self) -> torch.device:
        if self.rendezvous and transport(self.rendezvous.backend).on_device:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join as data-plane rank `rank`; blocks until the whole group formed,
        `join_s` passed, or rank 0 gave the connection up (its signed abort
        marker ends the wait within a poll)."""
        self.reset()
        r = rendezvous
        on_device = transport(r.backend).on_device
        self.group = broadcast_group(
            r.store_host, r.store_port, r.connection_id, rank, r.world_size, r.backend,
            r.join_s, r.secret, r.op_s,
            device=torch.device("cuda", torch.cuda.current_device()) if on_device else None)
        self.rendezvous, self.slot_pieces = r, r.slot_pieces

    def start_push(self, version: int) -> None:
        r = self.rendezvous
        self.bucket_macs = PushMacs(r.secret, r.connection_id, version) \
            if r is not None and r.authenticate_buckets else None

    def send(self, index: int, buf: torch.Tensor, push_ids: list[str], checksum: int | None,
             pieces: Sequence[Span] | None = None) -> Any:
        assert self.rendezvous is not None and self.group is not None, "not connected"
        r = self.rendezvous
        return send_bucket(self.group, buf, r.fanout,
                           first_receiver=entry(index, r.senders, r.ring_starts), pieces=pieces)

    def reset(self) -> None:
        """Drop this rank's side of the group now (bucket_group.close_group)."""
        group, self.group, self.rendezvous = self.group, None, None
        self.slot_pieces = False
        if group is not None:
            group.close()

    def close(self) -> None:
        self.reset()
