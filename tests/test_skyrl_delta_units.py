"""SkyRL's delta weight sync, the server's side without a server
(server/skyrl_api/delta_sync.py): deltas written here in SkyRL's format
(XOR of the new checkpoint-dtype bytes with the old, zstd, an xxh3-128
checksum of the new bytes, a manifest per version) are applied in order,
checked, staged apart from the base, and refused out of order or when a
checksum fails; nothing is read outside the sync root, and no zstd frame
is inflated past its tensor's size. The base is the served version's bytes:
kept across a SkyRL re-init, read back from the staged copy after a restart,
refused where the served dtype cannot give the checkpoint's back. The server
here is a fake that says so (`served`: a gate version and a staged copy).
SkyRL's own publisher drives a real server in tests/integrations/test_skyrl.py."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import xxhash
import zstandard
from safetensors.torch import save_file

from rollout_sidecar.protocol.schema import BucketManifest, StagedCopy, TensorSlot
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.skyrl_api.delta_sync import DeltaSync
from tests import processes


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


def served(version: int = 0, staged: dict[str, torch.Tensor] | None = None) -> SimpleNamespace:
    """A fake server (no engine): the version it serves and, if given, the
    staged copy of it, one tensor a bucket, as `peer_copy` reads it."""
    names = list(staged or {})

    async def manifest() -> StagedCopy:
        if staged is None:
            raise PushConflict("no complete version is staged here")
        return StagedCopy(version=version, buckets=[BucketManifest(
            index=i, nbytes=staged[n].numel() * staged[n].element_size(), params=[TensorSlot(
                name=n, dtype=str(staged[n].dtype).removeprefix("torch."),
                shape=list(staged[n].shape), offset=0)]) for i, n in enumerate(names)])

    async def bucket(index: int) -> tuple[int, bytes]:
        return version, raw(staged[names[index]]).numpy().tobytes()

    return SimpleNamespace(engine=SimpleNamespace(gate=SimpleNamespace(version=version)),
                           peer_copy=SimpleNamespace(manifest=manifest, bucket=bucket))


def start(d: DeltaSync, server: SimpleNamespace | None = None) -> str:
    return asyncio.run(d.init(server or served()))


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
    d = DeltaSync(tmp_path, tmp_path)
    assert start(d) == "checkpoint"
    assert d.fetch(2, str(sync), None)["fetched_versions"] == 2
    assert torch.equal(d.base["w"], base["w"])  # the served weights' copy: untouched
    with pytest.raises(PushConflict, match="before /start_weight_update"):
        d.to_push(2)
    d.start()
    with pytest.raises(PushConflict, match="of version 1; fetched: 2"):
        d.to_push(1)
    version, tensors = d.to_push(2)
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
    d = DeltaSync(tmp_path, tmp_path)
    start(d)
    with pytest.raises(BadRequest, match="b: the patched bytes fail their checksum"):
        d.fetch(1, str(sync), None)
    assert d.staged_version is None and not d.staged
    with pytest.raises(PushConflict, match="nothing fetched|no version fetched"):
        d.start()


def test_calls_before_their_turn_are_refused(tmp_path, base):
    d = DeltaSync(tmp_path, tmp_path)
    with pytest.raises(PushConflict, match="before /init_weight_transfer_engine"):
        d.fetch(1, str(tmp_path / "sync"), None)
    start(d)
    write_delta(tmp_path / "sync", 1, base, {"w": torch.zeros(4, 8).bfloat16()})
    (tmp_path / "sync" / "delta-00000001" / "manifest.json").write_text(json.dumps(dict(
        version=1, base_version=0, tensors=[dict(
            name="nope", dtype="bfloat16", shape=[1], uncompressed_num_bytes=2,
            compressed_num_bytes=2, payload_file="payload.safetensors", payload_key="p0",
            checksum="0")])))
    with pytest.raises(BadRequest, match="'nope' is not in the served checkpoint"):
        d.fetch(1, str(tmp_path / "sync"), None)


def test_a_reinit_keeps_the_served_base_or_reads_the_staged_copy(tmp_path, base):
    """SkyRL's trainer restarts while version 1 serves: its next delta is
    against version 1, never against the checkpoint."""
    sync = tmp_path / "sync"
    v1 = {"w": base["w"] * 4}
    write_delta(sync, 1, base, v1)
    d = DeltaSync(tmp_path, tmp_path)
    start(d)
    d.fetch(1, str(sync), None)
    d.start()
    d.pushed()
    assert start(d, served(1)) == "kept" and torch.equal(d.base["w"], v1["w"])
    # A restarted server (caught up from a peer, or pushed by a WeightPusher):
    # the base is its staged copy of version 1, served in fp32 here.
    fresh = DeltaSync(tmp_path, tmp_path)
    fp32 = {"w": v1["w"].float(), "b": base["b"].float()}
    assert start(fresh, served(1, fp32)) == "staged copy"
    assert fresh.version == 1 and fresh.base["w"].dtype == torch.bfloat16
    assert torch.equal(fresh.base["w"], v1["w"]) and torch.equal(fresh.base["b"], base["b"])
    write_delta(sync, 2, {**base, **v1}, {"b": base["b"] + 1})
    fresh.fetch(2, str(sync), None)
    fresh.start()
    _, tensors = fresh.to_push(2)
    assert torch.equal(tensors["w"], v1["w"]), "version 2 must keep version 1's w"
    # Nothing staged, or a served dtype narrower than the checkpoint's: refused by name.
    with pytest.raises(PushConflict, match="holds no staged copy"):
        start(DeltaSync(tmp_path, tmp_path), served(1))
    narrow = {"w": torch.randn(4, 8).bfloat16()}
    save_file({"w": torch.randn(4, 8)}, str(tmp_path / "model.safetensors"))  # fp32 on disk
    with pytest.raises(PushConflict, match="cannot give back its checkpoint dtype"):
        start(DeltaSync(tmp_path, tmp_path), served(1, narrow))


def test_reads_stay_under_the_sync_root(tmp_path, base):
    root = tmp_path / "store"
    root.mkdir()
    write_delta(tmp_path / "outside", 1, base, {"w": base["w"] + 1})
    d = DeltaSync(tmp_path, root)
    start(d)
    with pytest.raises(BadRequest) as e:
        d.fetch(1, "../outside", None)
    assert e.value.field == "sync_dir" and "outside weight_sync_root" in str(e.value)
    with pytest.raises(BadRequest) as e:
        d.fetch(1, None, str(tmp_path / "outside" / "delta-00000001"))
    assert e.value.field == "uri"
    for uri in ("s3://bucket/delta-00000001", "gs://bucket/x"):
        with pytest.raises(BadRequest, match="only a shared filesystem path"):
            d.fetch(1, None, uri)
    # A payload_file pointing out of its folder.
    write_delta(root / "sync", 1, base, {"w": base["w"] + 1})
    manifest = root / "sync" / "delta-00000001" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["tensors"][0]["payload_file"] = "../../../outside/delta-00000001/payload.safetensors"
    manifest.write_text(json.dumps(m))
    with pytest.raises(BadRequest) as e:
        d.fetch(1, "sync", None)
    assert e.value.field == "payload_file"
    with pytest.raises(PushConflict, match="--weight-sync-root"):
        d2 = DeltaSync(tmp_path, None)
        start(d2)
        d2.fetch(1, "sync", None)


BOMB = """
import resource, sys, zstandard
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.skyrl_api.delta_sync import inflate
declared = sys.argv[1] == "declared"
out = __import__("io").BytesIO()
# 2 GiB of zeros in a few KiB, compressed in steps (never whole in memory).
with zstandard.ZstdCompressor(level=1, write_content_size=declared).stream_writer(
        out, size=2**31 if declared else -1, closefd=False) as w:
    for _ in range(2048):
        w.write(bytes(1 << 20))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    inflate(zstandard, out.getvalue(), 64, "w")
except BadRequest as e:
    print("refused", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, e)
"""


@pytest.mark.parametrize("frame", ["declared", "undeclared"])
def test_a_zstd_bomb_is_refused_before_it_inflates(frame):
    r = processes.run([sys.executable, "-c", BOMB, frame], timeout_s=120,
                      env=processes.repo_env())
    assert r.returncode == 0, r.stderr[-2000:]
    word, grew_mib, *why = r.stdout.split()
    assert word == "refused", r.stdout
    assert int(grew_mib) < 64, r.stdout  # a 2 GiB frame, refused at most a few MiB in
    assert "the tensor 64" in " ".join(why), r.stdout
