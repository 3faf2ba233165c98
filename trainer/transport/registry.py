"""The trainer's half of a transport, built by name: the row of
protocol/transports.py names the class (`sender`), and the class builds
itself from the pusher's settings (`from_config`, base.py's `Transport`).
The server's counterpart is the row's `receive`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.transport.base import Transport

if TYPE_CHECKING:
    from rollout_sidecar.trainer.push_config import PushConfig


def build_sender(name: str, replicas: ReplicaAdmins, config: PushConfig) -> Transport:
    """The sender of transport `name` for one pusher; a ValueError names the known ones."""
    return transport(name).sender_class().from_config(name, replicas, config)
