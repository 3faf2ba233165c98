"""Senders by transport name: the one place the trainer tells transports
apart. The server's counterpart is server/weights/receivers.py; the names are
the wire's `Transport` (protocol/schema/weights_api.py).

Adding a transport is its row in protocol/transports.py and one sender class
here (the `Transport` protocol of base.py, registered with `@sender(name)` and
built from the pusher's settings by `from_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.transport.base import Transport

if TYPE_CHECKING:
    from rollout_sidecar.trainer.push_config import PushConfig

# name -> how to build its sender for one pusher
SENDERS: dict[str, Callable[[str, ReplicaAdmins, PushConfig], Transport]] = {}


def sender(*names: str) -> Callable[[Any], Any]:
    """Register a sender class for `names`; the class's
    `from_config(name, replicas, config)` builds it."""
    def register(cls: Any) -> Any:
        for name in names:
            SENDERS[name] = cls.from_config
        return cls
    return register


def build_sender(name: str, replicas: ReplicaAdmins, config: PushConfig) -> Transport:
    # The senders register when their modules load.
    from rollout_sidecar.trainer.transport import distributed, http_upload  # noqa: F401

    if name not in SENDERS:
        raise ValueError(f"transport must be one of {sorted(SENDERS)}, not {name!r}")
    return SENDERS[name](name, replicas, config)
