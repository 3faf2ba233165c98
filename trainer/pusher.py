"""`WeightPusher`: call `push(model, version)` on every trainer rank after
`optimizer.step()`; a moment later /generate serves exactly those weights.

Every rank gathers every bucket in the same order (the collectives line up);
only rank 0 packs, checksums and sends. Ranks agree on the outcome twice, after
`begin` and after `commit`, so an error raises on all ranks at the same point
instead of leaving peers blocked in an all-gather.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rollout_sidecar.trainer.admin_client import WeightAdminClient, WeightPushError
from rollout_sidecar.trainer.buckets import manifest, plan_buckets
from rollout_sidecar.trainer.gather import (
    MetaDeviceError,
    iter_full_tensors,
    meta_modules,
    param_plan,
)
from rollout_sidecar.trainer.transport.distributed import DistributedTransport
from rollout_sidecar.trainer.transport.http import HttpTransport

log = logging.getLogger(__name__)


@dataclass
class PushResult:
    version: int
    nbytes: int
    buckets: int
    timings: dict[str, float] = field(default_factory=dict)


def _crc32(buf: torch.Tensor) -> int:
    return zlib.crc32(memoryview((buf if buf.is_cpu else buf.cpu()).numpy()))


class WeightPusher:
    """Push full weights from any trainer layout to a rollout-sidecar server.

    Args:
        url: server URL (default $ROLLOUT_SIDECAR_URL).
        admin_token: weights token (default $ROLLOUT_SIDECAR_ADMIN_TOKEN).
        transport: "gloo" (host memory), "nccl" (GPU to GPU) or "http".
        bucket_mb: bucket size; rank 0's extra peak is about
            2 x max(bucket, largest single tensor) plus that tensor gathered.
        device: compute device for FSDP gathers (default: the mesh's device).
        data_plane_host: where the server's TCPStore listens (default: url host).
    """

    def __init__(self, url: str | None = None, admin_token: str | None = None,
                 transport: str = "gloo", bucket_mb: float = 256,
                 device: torch.device | None = None, data_plane_host: str | None = None,
                 timeout_s: float = 300.0) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.device = device
        self.transport: Any = None
        self.admin: WeightAdminClient | None = None
        self._dtype: torch.dtype | None = None
        self._buffers: list[torch.Tensor] = []
        if self.rank == 0:
            url = url or os.environ.get("ROLLOUT_SIDECAR_URL", "http://127.0.0.1:8000")
            self.admin = WeightAdminClient(url, admin_token, timeout=timeout_s)
            if transport == "http":
                self.transport = HttpTransport(self.admin)
            elif transport in ("gloo", "nccl"):
                self.transport = DistributedTransport(self.admin, transport, data_plane_host,
                                                      timeout_s)
            else:
                raise ValueError(f"transport must be gloo, nccl or http, not {transport!r}")

    # ----------------------------------------------------------------- push

    def push(self, model: nn.Module, version: int) -> PushResult:
        t0 = time.perf_counter()
        bad = meta_modules(model)
        if self._any(bool(bad)):
            raise MetaDeviceError(
                "refusing to push: parameters still on the meta device in modules "
                f"{bad[:8] if bad else '(on another rank)'}; materialise them "
                "(e.g. to_empty() + init/load) before pushing")
        plan = param_plan(model)

        begun, err = None, None
        if self.rank == 0:
            try:
                begun = self._begin(plan, version)
            except WeightPushError as e:
                err = str(e)
        err = self._broadcast(err)
        if err is not None:
            raise WeightPushError(err)

        t_begun = time.perf_counter()
        if self.rank == 0:
            buckets, push_id = begun
            checksums, err = self._gather_and_send(model, buckets, push_id)
        else:
            for _ in iter_full_tensors(model, self.device):  # take part in every gather
                pass
        t_sent = time.perf_counter()

        outcome: Any = None
        if self.rank == 0:
            outcome = self._finish(push_id, checksums, err, buckets, version)
        outcome = self._broadcast(outcome)
        if isinstance(outcome, str):
            raise WeightPushError(outcome)
        outcome.timings.update(begin_s=t_begun - t0, gather_send_s=t_sent - t_begun,
                               total_s=time.perf_counter() - t0)
        return outcome

    def _begin(self, plan: list, version: int) -> tuple[list, str]:
        assert self.admin is not None
        if self._dtype is None:
            self._dtype = getattr(torch, self.admin.status().dtype)
        self.transport.ensure_connected()
        buckets = plan_buckets(plan, self._dtype, self.bucket_bytes)
        resp = self.admin.begin(version, self.transport.name, manifest(buckets, self._dtype))
        return buckets, resp.push_id

    def _gather_and_send(self, model: nn.Module, buckets: list, push_id: str
                         ) -> tuple[list[int], str | None]:
        """Double-buffered: bucket k is on the wire while k+1 is gathered."""
        size = max(b.nbytes for b in buckets)
        dev = self.transport.buffer_device
        if not self._buffers or self._buffers[0].numel() < size or self._buffers[0].device != dev:
            pin = dev.type == "cpu" and torch.cuda.is_available()
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=dev, pin_memory=pin)
                             for _ in range(2)]
        in_flight: list[Any] = [None, None]
        checksums: list[int] = []
        err: str | None = None
        tensors = iter_full_tensors(model, self.device)
        for b in buckets:
            slot = b.index % 2
            try:
                if in_flight[slot] is not None and err is None:
                    in_flight[slot].wait()
            except Exception as e:
                err = f"sending bucket {b.index - 2} failed: {e}"
            buf = self._buffers[slot][: b.nbytes]
            for s in b.slots:
                name, full = next(tensors)  # gathered on every rank, same order
                if name != s.name:
                    err = err or f"gather order changed: got {name}, planned {s.name}"
                if err is None:
                    buf[s.offset: s.offset + s.nbytes].view(self._dtype).view(s.shape).copy_(full)
                del full
            if err is not None:
                continue  # keep gathering so peers never hang; send nothing more
            try:
                if self.transport.checksum_in_request:
                    checksums.append(_crc32(buf))
                    in_flight[slot] = self.transport.send(b.index, buf, push_id, checksums[-1])
                else:
                    # The CRC travels with the commit, so compute it while the
                    # bucket is on the wire (zlib releases the GIL).
                    in_flight[slot] = self.transport.send(b.index, buf, push_id, None)
                    checksums.append(_crc32(buf))
            except Exception as e:
                err = f"sending bucket {b.index} failed: {e}"
        for w in in_flight:
            try:
                if w is not None and err is None:
                    w.wait()
            except Exception as e:
                err = f"sending failed: {e}"
        return checksums, err

    def _finish(self, push_id: str, checksums: list[int], err: str | None, buckets: list,
                version: int) -> PushResult | str:
        assert self.admin is not None
        if err is not None:
            self.transport.reset()
            try:
                self.admin.abort(push_id, err)
            except WeightPushError:
                pass  # the server may already have ended it; err says why
            return err
        try:
            resp = self.admin.commit(push_id, checksums)
        except WeightPushError as e:
            self.transport.reset()
            return str(e)
        return PushResult(version=resp.weight_version, nbytes=sum(b.nbytes for b in buckets),
                          buckets=len(buckets), timings={f"server_{k}": v for k, v in
                                                         resp.timings.items()})

    # ------------------------------------------------------- rank agreement

    @staticmethod
    def _broadcast(obj: Any) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @staticmethod
    def _any(flag: bool) -> bool:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([int(flag)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        if self.admin is not None:
            self.admin.close()
