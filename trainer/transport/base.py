"""What the pusher needs of a transport: the data plane that carries bucket
bytes from the trainer's sending ranks to every replica (the control plane,
/weights/*, is control/admin_client.py whatever the transport). Each
transport's row in protocol/transports.py names its class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rollout_sidecar.protocol.data_plane.bucket_mac import PushMacs
from rollout_sidecar.protocol.data_plane.bucket_pieces import Span

if TYPE_CHECKING:
    from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
    from rollout_sidecar.trainer.push_config import PushConfig


class Pending(Protocol):
    """A send in flight: `wait()` returns once its buffer may be reused, or
    raises what the send hit."""

    def wait(self) -> Any: ...


class Sends(Protocol):
    """What `BucketSender` (pack/sender.py) sends through: rank 0's
    `Transport`, or another rank's `PeerSender` (peer_sender.py)."""

    @property
    def buffer_device(self) -> torch.device:
        """Where the send buffers live."""
        ...

    # True: each bucket's CRC goes with its bytes, so it is computed before the
    # send; False: the CRCs go with the prepare, computed while the bucket is
    # on the wire.
    checksum_in_request: bool
    # This push's keyed bucket tags (protocol/data_plane/bucket_mac.py), set by
    # `start_push` when the connection authenticates buckets; else None.
    bucket_macs: PushMacs | None
    # True: a bucket holding a chunk goes in `pieces` cut slot by slot, so each
    # lands in its tensor's place (protocol/data_plane/bucket_pieces.py).
    slot_pieces: bool

    def send(self, index: int, buf: torch.Tensor, push_ids: list[str], checksum: int | None,
             pieces: Sequence[Span] | None = None) -> Pending:
        """Start sending bucket `index`; `push_ids`: each replica's id of the
        push, in replica order; `pieces`: where to cut it (`slot_pieces`)."""
        ...


class Transport(Sends, Protocol):
    name: str  # what `/weights/begin` is told: "gloo", "nccl" or "http"
    # How each bucket reaches every replica: "http", "broadcast", "chain" or
    # "ring" (a chain entered at each replica in turn: ring_route.py).
    route: str
    connection_id: str | None  # the data-plane group the replicas hold, if any

    @classmethod
    def from_config(cls, name: str, replicas: ReplicaAdmins, config: PushConfig
                    ) -> Transport:
        """The transport `name` (its row's) for one pusher, from its settings."""
        ...

    def ensure_connected(self, statuses: list[Any]) -> None:
        """Make sure every replica (its `WeightStatus` each) can receive."""

    def start_push(self, version: int) -> None:
        """A push of `version` begins (after `ensure_connected`)."""

    def reset(self) -> None:
        """Drop the connection (after a failed push the replicas drop theirs)."""

    def close(self) -> None:
        """The pusher is done: release the connection on every replica (best
        effort, bounded) and drop ours."""
