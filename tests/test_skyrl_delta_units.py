"""SkyRL's delta weight sync, the server's side without a server
(server/skyrl_api/delta_sync.py): deltas written here in SkyRL's format
(XOR of the new checkpoint-dtype bytes with the old, zstd, an xxh3-128
checksum of the new bytes, a manifest per version) are applied in order,
checked, staged apart from the base, and refused out of order or when a
checksum fails. SkyRL's own publisher drives a real server in
tests/integrations/test_skyrl.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
import zstandard
from safetensors.torch import save_file

from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.skyrl_api.delta_sync import DeltaSync


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def write_delta(sync: Path, version: int, old: dict, new: dict, corrupt: str | None = None
                ) -> None:
    folder = sync / f"delta-{version:08d}"
    folder.mkdir(parents=True)
    payloads, records = {}, []
    for i, (name, t) in enumerate(new.items()):
        patch = (raw(t) ^ raw(old[name])).numpy().tobytes()
        packed = zstandard.ZstdCompressor(level=1).compress(patch)
        payloads[f"p{i}"] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
        digest = xxhash.xxh3_128(raw(t).numpy()).hexdigest()
        records.append(dict(name=name, dtype="bfloat16", shape=list(t.shape),
                            uncompressed_num_bytes=len(patch), compressed_num_bytes=len(packed),
                            payload_file="payload.safetensors", payload_key=f"p{i}",
                            checksum="0" * 32 if name == corrupt else digest))
    save_file(payloads, str(folder / "payload.safetensors"))
    (folder / "manifest.json").write_text(json.dumps(dict(
        version=version, base_version=version - 1, tensors=records,
        payload_files=["payload.safetensors"])))


@pytest.fixture
def base(tmp_path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(4, 8, generator=g).bfloat16(),
               "b": torch.randn(8, generator=g).bfloat16()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors


def test_versions_apply_in_order_staged_apart_from_the_base(tmp_path, base):
    sync = tmp_path / "sync"
    v1 = {"w": base["w"] + 1}
    v2 = {"w": v1["w"] * 2, "b": base["b"] - 3}
    write_delta(sync, 1, base, v1)
    write_delta(sync, 2, {**base, **v1}, v2)
    d = DeltaSync(tmp_path)
    d.init(0)
    assert d.fetch(2, str(sync), None)["fetched_versions"] == 2
    assert torch.equal(d.base["w"], base["w"])  # the served weights' copy: untouched
    with pytest.raises(PushConflict, match="before /start_weight_update"):
        d.to_push({"target_version": 2})
    d.start()
    with pytest.raises(PushConflict, match="of version 1; fetched: 2"):
        d.to_push({"target_version": 1})
    version, tensors = d.to_push({"target_version": 2})
    assert version == 2 and torch.equal(tensors["w"], v2["w"]) and torch.equal(
        tensors["b"], v2["b"])
    d.pushed()
    d.finish()
    assert d.version == 2 and torch.equal(d.base["b"], v2["b"])
    with pytest.raises(PushConflict, match="not newer"):
        d.fetch(2, str(sync), None)


def test_a_checksum_that_fails_stages_nothing(tmp_path, base):
    sync = tmp_path / "sync"
    write_delta(sync, 1, base, {"w": base["w"] + 1, "b": base["b"] + 1}, corrupt="b")
    d = DeltaSync(tmp_path)
    d.init(0)
    with pytest.raises(BadRequest, match="b: the patched bytes fail their checksum"):
        d.fetch(1, str(sync), None)
    assert d.staged_version is None and not d.staged
    with pytest.raises(PushConflict, match="nothing fetched|no version fetched"):
        d.start()


def test_calls_before_their_turn_are_refused(tmp_path, base):
    d = DeltaSync(tmp_path)
    with pytest.raises(PushConflict, match="before /init_weight_transfer_engine"):
        d.fetch(1, str(tmp_path / "sync"), None)
    d.init(0)
    write_delta(tmp_path / "sync", 1, base, {"w": torch.zeros(4, 8).bfloat16()})
    (tmp_path / "sync" / "delta-00000001" / "manifest.json").write_text(json.dumps(dict(
        version=1, base_version=0, tensors=[dict(
            name="nope", dtype="bfloat16", shape=[1], uncompressed_num_bytes=2,
            compressed_num_bytes=2, payload_file="payload.safetensors", payload_key="p0",
            checksum="0")])))
    with pytest.raises(BadRequest, match="'nope' is not in the served checkpoint"):
        d.fetch(1, str(tmp_path / "sync"), None)
