"""SkyRL's delta weight sync (SkyRL 0.4.0, `weight_sync_backend=delta`) as a
sidecar push.

SkyRL's trainer publishes each version as byte deltas against the one
before: per tensor, the XOR of its new checkpoint-dtype bytes with the old,
zstd-compressed, in `<sync_dir>/delta-%08d/` (a `manifest.json` and
safetensors payloads), each with an xxh3-128 checksum of the new bytes. Its
engine then calls, on every server:

  /init_weight_transfer_engine  the base: the served version's bytes in
                                host memory (served_base.py says which);
  /fetch_weights                before pausing: every version missing up to
                                the target is read, checked and applied to
                                a staged copy (the served weights untouched);
  /start_weight_update          opens the update of the fetched version;
  /update_weights               the staged copy goes through the sidecar's
                                own push, in process: begin, buckets, check,
                                commit, all or nothing, as the target version;
  /finish_weight_update         closes it.

Out of order is refused (409): an update of a version not fetched, an
update not started, a start with nothing fetched. One lock over the calls
(router.py), so a fetch cannot race an update. A failed push leaves the
served version and the base as they were; a fetch that fails (a checksum, a
missing file) stages nothing.

What it reads: only under `weight_sync_root` (its `sync_dir`, `uri` and
every `payload_file` resolved first, so `..` and links out are refused);
each zstd frame decompressed into at most its tensor's bytes, whatever the
frame says. Memory: the base (one host copy of the weights in the
checkpoint's dtype), the tensors a delta touches twice while staged, and
one bucket at an update.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from rollout_sidecar.protocol.schema import BeginRequest, BucketManifest, TensorSlot
from rollout_sidecar.protocol.schema.manifest_api import SLOT_ALIGN
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.skyrl_api import served_base
from rollout_sidecar.server.weights import self_report
from rollout_sidecar.server.weights.in_process_push import Bucket, push_in_process

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.service import WeightService

log = logging.getLogger(__name__)
BUCKET_BYTES = 64 << 20
EXTRA = "the skyrl extra (pip install 'rollout-sidecar[skyrl]': zstandard, xxhash)"
READ_BYTES = 1 << 20  # a zstd frame is read this much at a time


def _codecs() -> tuple[Any, Any]:
    try:
        import xxhash
        import zstandard
    except ImportError as e:
        raise NotImplementedError(f"SkyRL's delta weight sync needs {EXTRA}: {e}") from e
    return zstandard, xxhash


def inflate(zstandard: Any, packed: bytes, size: int, name: str) -> bytes:
    """The frame's bytes, exactly `size` of them, never more in memory:
    python-zstandard allocates whatever a frame declares, so a declared size
    is checked first and the frame is then read in steps up to `size`."""
    out = bytearray()
    try:
        declared = zstandard.get_frame_parameters(packed).content_size
        if declared not in (size, zstandard.CONTENTSIZE_UNKNOWN):
            raise BadRequest(f"delta of {name}: its frame holds {declared} bytes, the tensor "
                             f"{size}", "uri")
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(packed)) as reader:
            while len(out) <= size:
                chunk = reader.read(min(READ_BYTES, size + 1 - len(out)))
                if not chunk:
                    break
                out += chunk
    except zstandard.ZstdError as e:
        raise BadRequest(f"delta of {name}: not a zstd frame ({e})", "uri") from None
    if len(out) != size:
        raise BadRequest(f"delta of {name} has {'more than ' if len(out) > size else ''}"
                         f"{len(out)} bytes, the tensor {size}", "uri")
    return bytes(out)


def _inside(root: Path, path: Path, field_name: str) -> Path:
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise BadRequest(f"{field_name}: {path} is outside weight_sync_root {root}", field_name)
    return resolved


@dataclass
class DeltaSync:
    """One server's side of SkyRL's delta sync (called under router.py's lock)."""

    model_path: Path
    root: Path | None  # weight_sync_root: the only place deltas are read from
    base: dict[str, torch.Tensor] | None = None  # the served version's tensors
    version: int = 0  # the version `base` holds
    staged: dict[str, torch.Tensor] = field(default_factory=dict)  # changed tensors, fetched
    staged_version: int | None = None
    started: bool = False

    async def init(self, svc: WeightService) -> str:
        """The base of the served version (served_base.py); what it came from."""
        _codecs()
        served = svc.engine.gate.version
        self.staged_version, self.started, self.staged = None, False, {}
        if self.base is not None and self.version == served:
            return "kept"
        self.base = None
        if served == 0:
            self.base = await asyncio.to_thread(served_base.checkpoint_tensors, self.model_path)
            source = "checkpoint"
        else:
            dtypes = await asyncio.to_thread(served_base.checkpoint_dtypes, self.model_path)
            staged = await served_base.staged_tensors(svc, served)
            base = served_base.as_checkpoint(staged, dtypes, served)
            rest = set(dtypes) - set(base)  # not loaded by vLLM: as the checkpoint has them
            base.update(await asyncio.to_thread(served_base.checkpoint_tensors,
                                                self.model_path, rest))
            self.base, source = base, "staged copy"
        if not self.base:
            raise BadRequest(f"no safetensors files under {self.model_path}",
                             "init_info.base_model_path")
        self.version = served
        log.info("SkyRL delta sync: base of version %d from the %s", served, source)
        return source

    def fetch(self, target: int, sync_dir: str | None, uri: str | None) -> dict[str, float]:
        if self.base is None:
            raise PushConflict("/fetch_weights before /init_weight_transfer_engine")
        if self.root is None:
            raise PushConflict("this server reads no deltas: start it with --weight-sync-root "
                               "naming the store SkyRL publishes to (docs/skyrl.md)")
        for name, value in (("uri", uri), ("sync_dir", sync_dir)):
            if value is not None and value.startswith(("gs://", "s3://")):
                raise BadRequest(f"{name}: {value}: only a shared filesystem path is served",
                                 name)
        if target <= self.version:
            raise PushConflict(
                f"target_version {target} is not newer than {self.version}, which this server "
                "serves: a SkyRL publisher that starts again at 1 (a new trainer engine) needs a "
                "server restarted with it, or the publisher's state kept across the restart")
        if self.staged_version == target:
            return {"fetched_versions": 0.0}
        root = self.root.resolve()
        staged: dict[str, torch.Tensor] = {}
        for v in range(self.version + 1, target + 1):
            if v == target and uri:
                folder = _inside(root, root / uri, "uri")
            elif sync_dir:
                folder = _inside(root, root / sync_dir / f"delta-{v:08d}", "sync_dir")
            else:
                raise BadRequest("neither uri nor sync_dir names the deltas", "sync_dir")
            self._apply(folder, v, staged)
        self.staged, self.staged_version, self.started = staged, target, False
        return {"fetched_versions": float(target - self.version),
                "changed_tensors": float(len(staged))}

    def _apply(self, folder: Path, version: int, staged: dict[str, torch.Tensor]) -> None:
        zstandard, xxhash = _codecs()
        assert self.base is not None
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            records = manifest["tensors"]
            if int(manifest["version"]) != version or not isinstance(records, list):
                raise BadRequest(f"{folder}: manifest of version {manifest['version']}, "
                                 f"expected {version}", "uri")
            for rec in records:
                self._apply_one(folder, rec, version, staged, zstandard, xxhash)
        except BadRequest:
            raise
        except OSError as e:
            raise BadRequest(f"{folder}: {e.strerror or e}: {e.filename or ''}", "uri") from None
        except (KeyError, TypeError, ValueError, SafetensorError) as e:
            raise BadRequest(f"{folder}/manifest.json: malformed ({type(e).__name__}: {e})",
                             "uri") from None

    def _apply_one(self, folder: Path, rec: dict, version: int,
                   staged: dict[str, torch.Tensor], zstandard: Any, xxhash: Any) -> None:
        assert self.base is not None
        name = str(rec["name"])
        old = staged.get(name, self.base.get(name))
        if old is None:
            raise BadRequest(f"delta tensor {name!r} is not in the served checkpoint", "uri")
        payload = _inside(folder, folder / str(rec["payload_file"]), "payload_file")
        with safe_open(str(payload), framework="pt", device="cpu") as f:
            packed = f.get_tensor(str(rec["payload_key"])).numpy().tobytes()
        raw = old.reshape(-1).view(torch.uint8)
        patch = inflate(zstandard, packed, raw.numel(), name)
        new = raw ^ torch.frombuffer(bytearray(patch), dtype=torch.uint8)
        algorithm = rec.get("checksum_algorithm", "xxh3-128")
        if algorithm != "xxh3-128":
            raise BadRequest(f"checksum {algorithm!r} is not served", "uri")
        if xxhash.xxh3_128(new.numpy()).hexdigest() != rec["checksum"]:
            raise BadRequest(f"{name}: the patched bytes fail their checksum "
                             f"(version {version})", "uri")
        staged[name] = new.view(old.dtype).view(old.shape)

    def start(self) -> None:
        if self.staged_version is None:
            raise PushConflict("/start_weight_update with no version fetched (/fetch_weights)")
        self.started = True

    def to_push(self, target: object) -> tuple[int, dict[str, torch.Tensor]]:
        """The version and every tensor of it, for the push."""
        if not self.started:
            raise PushConflict("/update_weights before /start_weight_update")
        if target != self.staged_version or not isinstance(target, int):
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


async def push_into(svc: WeightService, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` (checkpoint names) into this server as an in-process push:
    the layout planned from the served index first, each bucket packed only
    when it is staged (one bucket in memory beside the base)."""
    index = self_report.weight_index(svc)
    missing = [n for n in index.tensors if n not in tensors]
    if missing:
        raise BadRequest(f"the synced weights lack {len(missing)} tensors the served model "
                         f"has: {missing[:8]}", "update_info")
    layout: list[list[TensorSlot]] = []
    used = 0
    for name, info in index.tensors.items():
        size = tensors[name].numel() * torch_dtype(info.dtype).itemsize
        start = -(-used // SLOT_ALIGN) * SLOT_ALIGN
        if not layout or (layout[-1] and start + size > BUCKET_BYTES):
            layout.append([])
            start = 0
        layout[-1].append(TensorSlot(name=name, dtype=info.dtype, shape=info.shape,
                                     offset=start))
        used = start + size
    buckets = [BucketManifest(index=i, params=slots, nbytes=slots[-1].offset
                              + tensors[slots[-1].name].numel()
                              * torch_dtype(slots[-1].dtype).itemsize)
               for i, slots in enumerate(layout)]

    async def packed() -> AsyncIterator[Bucket]:
        for b in buckets:
            buf = bytearray(b.nbytes)
            view = torch.frombuffer(buf, dtype=torch.uint8)
            for p in b.params:
                data = tensors[p.name].to(torch_dtype(p.dtype)).contiguous().reshape(-1)
                raw = data.view(torch.uint8)
                view[p.offset:p.offset + raw.numel()] = raw
            yield buf, None

    await push_in_process(svc, BeginRequest(version=version, transport="http",
                                            buckets=buckets), packed(),
                          f"SkyRL's delta sync of version {version}")
