"""One name per transport, one sender in the trainer and one receiver in the
server (trainer/transport/registry.py, server/weights/receivers.py): adding a
transport to the wire without both ends fails here."""

from __future__ import annotations

from typing import get_args

import pytest

from rollout_sidecar.client.protocol import Transport
from rollout_sidecar.server.weights.ops import WorkerOp
from rollout_sidecar.server.weights.receivers import RECEIVERS, receiver
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.transport.registry import SENDERS, build_sender


def test_every_wire_transport_has_one_sender_and_one_receiver():
    build_sender("http", None, PushConfig())  # loads the senders' modules
    assert set(get_args(Transport)) == set(SENDERS) == set(RECEIVERS)


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
    assert receiver("http").opens_with is WorkerOp.ALLOCATE
    assert receiver("gloo").opens_with is WorkerOp.RECEIVE
    assert [r.name for r in RECEIVERS.values() if r.needs_gpu] == ["nccl"]
