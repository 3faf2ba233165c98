"""One float32 server of the default model for the reliability suite (soak,
faults, starvation), and an in-process trainer that pushes to it. In fp32 each
response's logprobs fingerprint the weights that produced it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest
import torch

from tests.conftest import Server, ServerSpec, server_fixture
from tests.reliability.oracle import VersionedWeights

LEASE_S = 3  # a second trainer within this of the first one's last push is refused


@dataclass
class Trainer:
    pusher: object
    weights: VersionedWeights


# Fixed per session, so another replica (test_restart_soak.py) can share them.
TOKENS = {"ROLLOUT_SIDECAR_API_TOKEN": secrets.token_hex(8),
          "ROLLOUT_SIDECAR_ADMIN_TOKEN": secrets.token_hex(8)}
RELIABLE = ServerSpec.of("reliable", dtype="float32", failpoints=True, env={
    **TOKENS,
    "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": str(LEASE_S),
    "ROLLOUT_SIDECAR_CONNECT_TIMEOUT_MAX_S": "10",
    "ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S": "30"})


reliable = server_fixture(RELIABLE, scope="package")


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
