"""A fake admin client for the `gpu` tests, as its name says: it answers the
control plane a `WeightPusher` drives and keeps the bucket bytes a real server
would receive, because the device machine has no vLLM.

Its methods take what `trainer/control/admin_client.py`'s `WeightAdminClient` takes;
`tests/test_capturing_server_units.py` checks that on CPU, so the fake cannot
fall behind the client unnoticed between the sessions that get a GPU.
"""

from __future__ import annotations

import zlib

import torch

from rollout_sidecar.protocol.schema import (
    BeginResponse,
    CommitResponse,
    LastPush,
    PrepareResponse,
    TensorInfo,
    WeightIndex,
    WeightStatus,
)


class CapturingServer:
    """Fake admin client: answers the control plane, keeps the bucket bytes."""

    def __init__(self, checkpoint: dict[str, torch.Tensor], vocab: int) -> None:
        self.status_ = WeightStatus(weight_version=0, dtype="bfloat16", vocab_size=vocab,
                                    max_model_len=512, boot_id="gpu-test", push_state="idle",
                                    push_in_progress=False, connected=None, data_plane_port=0,
                                    transports=["http"], push_timeout_s=60, commit_drain_s=1)
        self.index_ = WeightIndex(tensors={n: TensorInfo(shape=list(t.shape), dtype="bfloat16")
                                           for n, t in checkpoint.items()},
                                  ignored=[], tie_word_embeddings=False)
        self.base_url = "http://capturing"
        self.buckets: dict[int, bytes] = {}
        self.manifest: list[dict] = []
        self.aborted: str | None = None
        self.closed = False

    def status(self) -> WeightStatus:
        return self.status_

    def index(self) -> WeightIndex:
        return self.index_

    def begin(self, version: int, transport: str, buckets: list[dict],
              connection_id: str | None, commit_policy: str | None,
              budget_s: float = 300.0, delta_base: int | None = None,
              adapter: dict | None = None, check: str = "crc32") -> BeginResponse:
        assert delta_base is None and adapter is None, "the fake takes dense pushes only"
        assert check == "crc32", "the fake takes HTTP pushes: CRC-32 bodies"
        self.manifest = buckets
        return BeginResponse(push_id="p", deadline_s=60, commit_policy="wait")

    def put_bucket(self, push_id: str, index: int, data: bytes, checksum: int,
                   budget_s: float = 300.0) -> None:
        assert zlib.crc32(data) == checksum
        self.buckets[index] = data

    def prepare(self, push_id: str, checksums: list[int], timeout_s: float,
                macs: list[str] | None = None) -> PrepareResponse:
        assert [zlib.crc32(self.buckets[i]) for i in range(len(checksums))] == checksums
        return PrepareResponse(push_id=push_id, deadline_s=60, timings={})

    def commit(self, push_id: str, checksums: list[int] | None, timeout_s: float,
               macs: list[str] | None = None) -> CommitResponse:
        if checksums is not None:  # both phases in one call (one replica)
            self.prepare(push_id, checksums, timeout_s, macs)
        self.status_.weight_version += 1
        return CommitResponse(weight_version=self.status_.weight_version, push_id=push_id,
                              commit_policy="wait", timings={})

    def abort(self, push_id: str, reason: str) -> LastPush:
        self.aborted = reason
        return LastPush(version=self.status_.weight_version, outcome="aborted", reason=reason,
                        push_id=push_id)

    def close(self) -> None:
        self.closed = True

    def tensors(self) -> dict[str, torch.Tensor]:
        """The pushed tensors, read back out of the buckets by the manifest."""
        out = {}
        for b in self.manifest:
            raw = torch.frombuffer(bytearray(self.buckets[b["index"]]), dtype=torch.uint8)
            for p in b["params"]:
                dt = getattr(torch, p["dtype"])
                n = torch.Size(p["shape"]).numel() * dt.itemsize
                out[p["name"]] = raw[p["offset"]: p["offset"] + n].view(dt).view(p["shape"])
        return out
