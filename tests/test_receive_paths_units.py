"""The worker's receive paths (server/weights/worker/receive_paths.py), alone:
no engine, no group. Pushes through them run in tests/e2e (test_push.py:
gloo, HTTP, split buckets; test_tensor_parallel.py: two workers)."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from rollout_sidecar.server.weights.worker.group_membership import GroupMembership
from rollout_sidecar.server.weights.worker.receive_paths import HOST, GroupReceive, HttpStage
from rollout_sidecar.server.weights.worker.staging import StagedBucket, Staging


def _staging(*sizes: int) -> Staging:
    return Staging([StagedBucket(i, n, [], torch.zeros(n, dtype=torch.uint8), checksum=7)
                    for i, n in enumerate(sizes)])


def test_http_stage_copies_a_bucket_in_and_refuses_what_does_not_fit():
    staging = _staging(4, 2)
    buckets = staging.buckets
    HttpStage.stage(staging, 1, b"\x01\x02", "crc32", None)
    assert buckets[1].received and buckets[1].buffer.tolist() == [1, 2]
    assert buckets[1].checksum == zlib.crc32(b"\x01\x02")  # over these bytes, as they land
    assert not buckets[0].received
    for bucket, data, message in [(2, b"ab", "not in the manifest"),
                                  (0, b"abc", "3 bytes, expected 4"),
                                  (None, b"ab", "needs bucket and data")]:
        with pytest.raises(ValueError, match=message):
            HttpStage.stage(staging, bucket, data, "crc32", None)
    http = HttpStage(GroupMembership(), torch.device("cpu"))  # needs no group
    assert http.staging_device(small=False) == HOST and http.start(staging) is None


def test_a_group_receive_needs_a_group_and_stages_full_pushes_where_nccl_says():
    with pytest.raises(RuntimeError, match="not connected"):
        GroupReceive(GroupMembership(), torch.device("cpu"))

    def joined(backend: str, staging: str) -> GroupMembership:
        c = GroupMembership()
        c.joiner = SimpleNamespace(group=object(),
                                   info=SimpleNamespace(backend=backend, staging=staging))
        return c

    gpu = torch.device("cuda", 1)
    assert GroupReceive(joined("nccl", "device"), gpu).staging_device(small=False) == gpu
    # Patches are applied on the host; host staging and gloo are host memory.
    assert GroupReceive(joined("nccl", "device"), gpu).staging_device(small=True) == HOST
    assert GroupReceive(joined("nccl", "auto"), gpu).staging_device(small=False) == HOST
    assert GroupReceive(joined("gloo", "device"), gpu).staging_device(small=False) == HOST
