"""One float32 server of the default model for the reliability suite (soak,
faults, starvation), and an in-process trainer that pushes to it. In fp32 each
response's logprobs fingerprint the weights that produced it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.conftest import Server, start_server, stop_server
from tests.reliability.oracle import VersionedWeights

LEASE_S = 3  # a second trainer within this of the first one's last push is refused


@dataclass
class Trainer:
    pusher: object
    weights: VersionedWeights


@pytest.fixture(scope="package")
def reliable(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("reliable")
    fault = tmp / "fault"
    fault.write_text("")
    s = start_server(tmp, "reliable", dtype="float32", extra_env={
        "ROLLOUT_SIDECAR_TEST_FAULT_FILE": str(fault),
        "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": str(LEASE_S),
        "ROLLOUT_SIDECAR_CONNECT_TIMEOUT_MAX_S": "10",
        "ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S": "30"})
    s.fault_file = fault
    yield s
    stop_server(s)


def model_of(server: Server) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="package")
def trainer(reliable) -> Trainer:
    from rollout_sidecar.trainer import WeightPusher

    pusher = WeightPusher(reliable.url, admin_token=reliable.admin_token, bucket_mb=1)
    return Trainer(pusher, VersionedWeights(model_of(reliable)))


@pytest.fixture(scope="package")
def oracle(reliable) -> VersionedWeights:
    return VersionedWeights(model_of(reliable))


def served_version(server: Server) -> int:
    with server.client() as c:
        return c.info().weight_version
