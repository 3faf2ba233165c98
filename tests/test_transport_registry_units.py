"""One table of transports (protocol/transports.py): each row says what the
transport is and names both of its halves, the trainer's sender and the
server worker's receive path. Adding a transport to the wire without every
part fails here. And no transport name is compared outside that table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from rollout_sidecar.protocol.schema import Transport
from rollout_sidecar.protocol.transports import TRANSPORTS, transport
from rollout_sidecar.server.weights.worker.receive_paths import GroupReceive, HttpStage
from rollout_sidecar.server.weights.worker.receive_paths import ReceivePath as _ReceivePath
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.transport.base import Transport as _Sender
from rollout_sidecar.trainer.transport.registry import build_sender


def _methods(protocol: type) -> set[str]:
    """The methods a protocol class declares."""
    return {n for n, v in vars(protocol).items() if not n.startswith("_")
            and (callable(v) or isinstance(v, classmethod))}


def test_every_wire_transport_is_a_row_naming_both_of_its_halves():
    assert set(get_args(Transport)) == set(TRANSPORTS)
    for kind in TRANSPORTS.values():
        sender, receive = kind.sender_class(), kind.receive_class()
        # Each half has what its side asks of it (base.py's and receive_paths.py's protocol).
        assert _methods(_Sender) <= set(dir(sender)), kind.name
        assert _methods(_ReceivePath) <= set(dir(receive)), kind.name
    assert "from_config" in _methods(_Sender) and "start" in _methods(_ReceivePath)
    # The server's half follows what the row says of the group.
    assert {n: t.receive_class() for n, t in TRANSPORTS.items()} == {
        "gloo": GroupReceive, "nccl": GroupReceive, "http": HttpStage}
    assert [t.receive_class() is GroupReceive for t in TRANSPORTS.values()] == [
        t.joins_group for t in TRANSPORTS.values()]


def test_the_pusher_builds_its_sender_by_name_with_its_settings():
    gloo = build_sender("gloo", None, PushConfig(fanout="chain", takeover=True))
    assert (gloo.name, gloo.fanout_setting, gloo.takeover) == ("gloo", "chain", True)
    assert build_sender("nccl", None, PushConfig()).name == "nccl"
    assert build_sender("http", None, PushConfig()).name == "http"
    with pytest.raises(ValueError, match="transport must be one of"):
        build_sender("carrier-pigeon", None, PushConfig())


def test_the_server_asks_the_transport_what_a_push_needs():
    assert transport("gloo").joins_group and transport("nccl").joins_group
    assert not transport("http").joins_group
    assert [t.name for t in TRANSPORTS.values() if t.needs_gpu] == ["nccl"]


def test_each_side_asks_the_transport_what_it_does():
    assert transport("gloo").fanout(3) == "chain" and transport("gloo").fanout(2) == "broadcast"
    assert transport("nccl").fanout(9) == "broadcast" and transport("nccl").on_device
    transport("gloo").check_fanout("chain")
    transport("nccl").check_fanout("chain")  # several senders relay point to point
    PushConfig(transport="nccl", fanout="chain")
    with pytest.raises(ValueError, match="gloo or nccl"):
        transport("http").check_fanout("chain")
    with pytest.raises(ValueError, match="fanout chain"):
        PushConfig(transport="http", fanout="chain")


# A transport's name in a comparison, outside the table that says what each is.
_NAME_COMPARED = re.compile(r"""[=!]= *["'](gloo|nccl|http)["']|["'](gloo|nccl|http)["'] *[=!]=""")


def test_no_transport_name_is_compared_outside_its_table():
    root = Path(__file__).resolve().parents[1]
    found = [f"{f.relative_to(root)}:{i}: {line.strip()}"
             for d in ("trainer", "server", "protocol", "client")
             for f in sorted((root / d).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if _NAME_COMPARED.search(line) and 'scope["type"]' not in line]
    assert found == []
