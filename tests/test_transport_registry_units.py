"""One name per transport: what it is (protocol/transports.py), one
sender in the trainer and one receiver in the server
(trainer/transport/registry.py, server/weights/receivers.py): adding a
transport to the wire without every part fails here. And no transport name is
compared outside that table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from rollout_sidecar.protocol.schema import Transport
from rollout_sidecar.protocol.transports import TRANSPORTS, transport
from rollout_sidecar.server.weights.receivers import RECEIVERS, receiver
from rollout_sidecar.server.weights.worker_requests import Allocate, Receive
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.transport.registry import SENDERS, build_sender


def test_every_wire_transport_has_one_sender_and_one_receiver():
    build_sender("http", None, PushConfig())  # loads the senders' modules
    assert set(get_args(Transport)) == set(TRANSPORTS) == set(SENDERS) == set(RECEIVERS)


def test_the_pusher_builds_its_sender_by_name_with_its_settings():
    gloo = build_sender("gloo", None, PushConfig(fanout="chain", takeover=True))
    assert (gloo.name, gloo.fanout_setting, gloo.takeover) == ("gloo", "chain", True)
    assert build_sender("nccl", None, PushConfig()).name == "nccl"
    assert build_sender("http", None, PushConfig()).name == "http"
    with pytest.raises(ValueError, match="transport must be one of"):
        build_sender("carrier-pigeon", None, PushConfig())


def test_the_server_asks_the_receiver_what_a_push_needs():
    assert receiver("gloo").joins_group and receiver("nccl").joins_group
    assert not receiver("http").joins_group
    assert receiver("http").opens_with is Allocate
    assert receiver("gloo").opens_with is Receive
    assert [r.name for r in RECEIVERS.values() if r.needs_gpu] == ["nccl"]


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
