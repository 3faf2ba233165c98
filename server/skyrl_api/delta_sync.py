"""SkyRL's delta weight sync (SkyRL 0.4.0, `weight_sync_backend=delta`) as a
sidecar push.

SkyRL's trainer publishes each version as byte deltas against the one
before: per tensor, the XOR of its new checkpoint-dtype bytes with the old,
zstd-compressed, in `<sync_dir>/delta-%08d/` (a `manifest.json` and
safetensors payloads), each with an xxh3-128 checksum of the new bytes. Its
engine then calls, on every server:

  /init_weight_transfer_engine  once: here, the served checkpoint's bytes
                                are read into host memory (the base);
  /fetch_weights                before pausing: every version missing up to
                                the target is read, checked and applied to
                                a staged copy (the served weights untouched);
  /start_weight_update          opens the update of the fetched version;
  /update_weights               the staged copy goes through the sidecar's
                                own push, over HTTP to this server: begin,
                                buckets, check, commit, all or nothing, as
                                the target version;
  /finish_weight_update         closes it.

Out of order is refused (409): an update of a version not fetched, an
update not started, a start with nothing fetched. A failed push leaves the
served version and the base as they were; a fetch that fails (a checksum, a
missing file) stages nothing. Memory: one host copy of the weights in the
checkpoint's dtype, and the tensors a delta touches twice while staged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rollout_sidecar.protocol.data_plane.bucket_check import crc32_of_bytes
from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from rollout_sidecar.protocol.schema import BeginRequest, BucketManifest, CommitRequest, TensorSlot
from rollout_sidecar.server.errors import BadRequest, PushConflict

log = logging.getLogger(__name__)
BUCKET_BYTES = 64 << 20
ALIGN = 64
EXTRA = "the skyrl extra (pip install 'rollout-sidecar[skyrl]': zstandard, xxhash)"


def _codecs() -> tuple[Any, Any]:
    try:
        import xxhash
        import zstandard
    except ImportError as e:
        raise NotImplementedError(f"SkyRL's delta weight sync needs {EXTRA}: {e}") from e
    return zstandard, xxhash


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, as stored."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = f.get_tensor(name).contiguous()
    if not out:
        raise BadRequest(f"no safetensors files under {folder}", "init_info.base_model_path")
    return out


@dataclass
class DeltaSync:
    """One server's side of SkyRL's delta sync."""

    model_path: Path
    base: dict[str, torch.Tensor] | None = None  # the served version's tensors
    version: int = 0  # the version `base` holds
    staged: dict[str, torch.Tensor] = field(default_factory=dict)  # changed tensors, fetched
    staged_version: int | None = None
    started: bool = False

    def init(self, served_version: int) -> None:
        _codecs()
        self.base = checkpoint_tensors(self.model_path)
        self.version, self.staged_version, self.started = served_version, None, False
        self.staged = {}

    def fetch(self, target: int, sync_dir: str | None, uri: str | None) -> dict[str, float]:
        if self.base is None:
            raise PushConflict("/fetch_weights before /init_weight_transfer_engine")
        if target <= self.version:
            raise PushConflict(f"target_version {target} is not newer than {self.version}")
        if self.staged_version == target:
            return {"fetched_versions": 0.0}
        staged: dict[str, torch.Tensor] = {}
        for v in range(self.version + 1, target + 1):
            if v == target and uri:
                folder = Path(uri)
            elif sync_dir:
                folder = Path(sync_dir) / f"delta-{v:08d}"
            else:
                raise BadRequest("neither uri nor sync_dir names the deltas", "sync_dir")
            self._apply(folder, v, staged)
        self.staged, self.staged_version, self.started = staged, target, False
        return {"fetched_versions": float(target - self.version),
                "changed_tensors": float(len(staged))}

    def _apply(self, folder: Path, version: int, staged: dict[str, torch.Tensor]) -> None:
        zstandard, xxhash = _codecs()
        assert self.base is not None
        if str(folder).startswith(("gs://", "s3://")):
            raise BadRequest(f"{folder}: only a shared filesystem path is served", "uri")
        manifest = json.loads((folder / "manifest.json").read_text())
        if int(manifest["version"]) != version:
            raise BadRequest(f"{folder}: manifest of version {manifest['version']}, "
                             f"expected {version}", "uri")
        files: dict[str, Any] = {}
        try:
            for rec in manifest["tensors"]:
                name = rec["name"]
                old = staged.get(name, self.base.get(name))
                if old is None:
                    raise BadRequest(f"delta tensor {name!r} is not in the served checkpoint",
                                     "uri")
                f = files.get(rec["payload_file"])
                if f is None:
                    f = files[rec["payload_file"]] = safe_open(
                        str(folder / rec["payload_file"]), framework="pt", device="cpu")
                packed = f.get_tensor(rec["payload_key"]).numpy().tobytes()
                patch = zstandard.ZstdDecompressor().decompress(
                    packed, max_output_size=rec["uncompressed_num_bytes"])
                raw = old.reshape(-1).view(torch.uint8)
                if len(patch) != raw.numel():
                    raise BadRequest(f"delta of {name} has {len(patch)} bytes, the tensor "
                                     f"{raw.numel()}", "uri")
                new = raw ^ torch.frombuffer(bytearray(patch), dtype=torch.uint8)
                algorithm = rec.get("checksum_algorithm", "xxh3-128")
                if algorithm != "xxh3-128":
                    raise BadRequest(f"checksum {algorithm!r} is not served", "uri")
                if xxhash.xxh3_128(new.numpy()).hexdigest() != rec["checksum"]:
                    raise BadRequest(f"{name}: the patched bytes fail their checksum "
                                     f"(version {version})", "uri")
                staged[name] = new.view(old.dtype).view(old.shape)
        finally:
            files.clear()

    def start(self) -> None:
        if self.staged_version is None:
            raise PushConflict("/start_weight_update with no version fetched (/fetch_weights)")
        self.started = True

    def to_push(self, update_info: dict[str, Any]) -> tuple[int, dict[str, torch.Tensor]]:
        """The version and every tensor of it, for the push."""
        target = update_info.get("target_version", update_info.get("version"))
        if not self.started:
            raise PushConflict("/update_weights before /start_weight_update")
        if target != self.staged_version:
            raise PushConflict(f"/update_weights of version {target}; fetched: "
                               f"{self.staged_version}")
        assert self.base is not None
        return target, {**self.base, **self.staged}

    def pushed(self) -> None:
        assert self.base is not None and self.staged_version is not None
        self.base.update(self.staged)
        self.version, self.staged, self.staged_version = self.staged_version, {}, None

    def finish(self) -> None:
        self.started = False


async def push_into(svc: Any, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` (checkpoint names) into this server as an HTTP-transport push,
    in process, as a catch-up does (weights/peer_copy.py): begin, every
    bucket staged and CRC-checked, commit; aborted on any error."""
    index = svc.index()
    missing = [n for n in index.tensors if n not in tensors]
    if missing:
        raise BadRequest(f"the synced weights lack {len(missing)} tensors the served model "
                         f"has: {missing[:8]}", "update_info")
    groups: list[tuple[list[TensorSlot], bytearray]] = []
    for name, info in index.tensors.items():
        data = tensors[name].to(torch_dtype(info.dtype)).contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().tobytes()
        if not groups or len(groups[-1][1]) + ALIGN + len(raw) > BUCKET_BYTES:
            groups.append(([], bytearray()))
        slots, buf = groups[-1]
        buf.extend(b"\0" * (-len(buf) % ALIGN))
        slots.append(TensorSlot(name=name, dtype=info.dtype, shape=info.shape, offset=len(buf)))
        buf.extend(raw)
    buckets = [BucketManifest(index=i, nbytes=len(buf), params=slots)
               for i, (slots, buf) in enumerate(groups)]
    payloads = [bytes(buf) for _, buf in groups]
    begun = await svc.begin_now(BeginRequest(version=version, transport="http",
                                             buckets=buckets))
    checksums = []
    try:
        for b, data in zip(buckets, payloads, strict=True):
            checksum = crc32_of_bytes(data)
            await svc.stage_bucket(begun.push_id, b.index, data, checksum)
            checksums.append(checksum)
        await svc.commit(CommitRequest(push_id=begun.push_id, checksums=checksums))
    except BaseException as e:
        current = svc.session.current
        if current is not None and current.push_id == begun.push_id:
            await svc.abort(begun.push_id, f"SkyRL's delta sync of version {version}: {e}")
        raise
