"""Senders by transport name: the one place the trainer tells transports
apart. The server's counterpart is server/weights/receivers.py; the names are
the wire's `Transport` (protocol/schema/weights_api.py).

Adding a transport is its row in protocol/transports.py and one module in
this package: its sender class (the `Transport` protocol of base.py,
registered with `@sender(name)` and built from the pusher's settings by
`from_config`).
"""

from __future__ import annotations

import importlib
import pkgutil
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


def _load_senders() -> None:
    """The senders register when their modules load: every module of this
    package is loaded once, so a new sender's module is all a new transport
    adds here."""
    import rollout_sidecar.trainer.transport as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")


def build_sender(name: str, replicas: ReplicaAdmins, config: PushConfig) -> Transport:
    _load_senders()
    if name not in SENDERS:
        raise ValueError(f"transport must be one of {sorted(SENDERS)}, not {name!r}")
    return SENDERS[name](name, replicas, config)
