"""`WeightPusher`: call `push(model, version)` on every trainer rank after
`optimizer.step()`; a moment later /generate serves exactly those weights.

Every rank gathers every bucket in the same order (the collectives line up);
only rank 0 packs, checks for NaN/inf, checksums and sends. Ranks agree on the
outcome after `begin`, after `commit` and after the probe, so an error raises
on all ranks at the same point instead of leaving peers blocked in a
collective. The probe (`verify`, on by default) proves the commit: see
`probe.py`.
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

from rollout_sidecar.client.schema import ProbeRequest, ProbeResult, WeightIndex
from rollout_sidecar.trainer.admin_client import (
    NonFiniteWeightsError,
    WeightAdminClient,
    WeightMismatchError,
    WeightPushError,
)
from rollout_sidecar.trainer.buckets import manifest, plan_buckets
from rollout_sidecar.trainer.gather import (
    MetaDeviceError,
    iter_full_tensors,
    meta_modules,
    param_plan,
    persistent_buffers,
)
from rollout_sidecar.trainer.layout import CheckpointLayout
from rollout_sidecar.trainer.probe import (
    Forward,
    default_tolerance,
    probe_token_ids,
    trainer_logprobs,
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
    probe: ProbeResult | None = None

    @property
    def probe_gap(self) -> float | None:
        """Mean |served - trainer| logprob over the probe tokens, if probed."""
        return self.probe.mean_abs_dlogp if self.probe else None


_ERRORS = {"push": WeightPushError, "nonfinite": NonFiniteWeightsError,
           "mismatch": WeightMismatchError}


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
        verify: after each commit, probe the server against this trainer's own
            forward pass (see `push`). True uses `model(input_ids=...)`; pass a
            callable `(model, input_ids) -> logits` for other models, or False.
        verify_tolerance: largest acceptable mean |dlogp| of the probe;
            default by precision (fp32 1e-3, fp16 0.05, bf16 0.1).
        verify_every: probe every N-th push (the first always), to amortise
            the probe's forward pass when pushes are frequent.
    """

    def __init__(self, url: str | None = None, admin_token: str | None = None,
                 transport: str = "gloo", bucket_mb: float = 256,
                 device: torch.device | None = None, data_plane_host: str | None = None,
                 timeout_s: float = 300.0, verify: bool | Forward = True,
                 verify_tolerance: float | None = None, verify_every: int = 1) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.device = device
        self.verify = verify
        self.verify_tolerance = verify_tolerance
        self.verify_every = max(1, verify_every)
        self._pushes = 0
        self.transport: Any = None
        self.admin: WeightAdminClient | None = None
        self._dtype: torch.dtype | None = None
        self._index: WeightIndex | None = None
        self._status: Any = None
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

    def push(self, model: nn.Module, version: int, *, verify: bool | Forward | None = None,
             verify_tolerance: float | None = None) -> PushResult:
        """Gather, send and commit `model` as `version`; call it on every rank.

        With `verify` (default: the pusher's), the commit is followed by the
        probe; a gap over the tolerance raises `WeightMismatchError` on every
        rank after the server marked the version suspect. Turn it off when the
        model's forward cannot take a bare `input_ids` batch or has side
        effects, or when pushes are so frequent that one extra forward per push
        matters (see README, "Proof of every push").
        """
        t0 = time.perf_counter()
        bad = meta_modules(model)
        if self._any(bool(bad)):
            raise MetaDeviceError(
                "refusing to push: parameters still on the meta device in modules "
                f"{bad[:8] if bad else '(on another rank)'}; materialise them "
                "(e.g. to_empty() + init/load) before pushing")

        begun, err = None, None
        if self.rank == 0:
            try:
                begun = self._begin(model, version)
            except WeightPushError as e:
                err = str(e)
        err = self._broadcast(err)
        if err is not None:
            raise WeightPushError(err)

        t_begun = time.perf_counter()
        if self.rank == 0:
            buckets, push_id, buffers = begun
            checksums, err = self._gather_and_send(model, buckets, push_id, buffers)
        else:
            for _ in iter_full_tensors(model, self.device):  # take part in every gather
                pass
        t_sent = time.perf_counter()

        outcome: Any = None
        if self.rank == 0:
            outcome = self._finish(push_id, checksums, err, buckets)
        outcome = self._raise_if_error(self._broadcast(outcome))
        t_committed = time.perf_counter()
        if verify is None:  # the pusher's setting, every verify_every-th push
            verify = self.verify if self._pushes % self.verify_every == 0 else False
        self._pushes += 1
        if verify:
            self._probe(model, outcome, verify, verify_tolerance or self.verify_tolerance)
        outcome.timings.update(begin_s=t_begun - t0, gather_send_s=t_sent - t_begun,
                               probe_s=time.perf_counter() - t_committed,
                               total_s=time.perf_counter() - t0)
        return outcome

    def _begin(self, model: nn.Module, version: int) -> tuple[list, str, list[str]]:
        assert self.admin is not None
        self._status = status = self.admin.status()
        self._dtype = getattr(torch, status.dtype)
        if self._index is None:
            self._index = self.admin.index()
        # Persistent buffers the served checkpoint holds travel with the params.
        buffers = sorted(set(persistent_buffers(model)) & set(self._index.tensors))
        self.transport.ensure_connected()
        wire = {n: getattr(torch, t.dtype) for n, t in self._index.tensors.items()}
        plan = CheckpointLayout(model).plan(param_plan(model, buffers))
        buckets = plan_buckets(plan, self._dtype, self.bucket_bytes, wire)
        resp = self.admin.begin(version, self.transport.name, manifest(buckets))
        return buckets, resp.push_id, buffers

    def _probe(self, model: nn.Module, outcome: PushResult, verify: bool | Forward,
               tolerance: float | None) -> None:
        """All ranks: forward the probe; rank 0: have the server compare."""
        ids = None
        if self.rank == 0:
            ids = probe_token_ids(self._status.vocab_size, self._status.max_model_len)
        ids = self._broadcast(ids)
        forward = verify if callable(verify) else None
        logprobs, logits_dtype = trainer_logprobs(model, ids, self.device, forward)
        result: Any = None
        if self.rank == 0:
            assert self.admin is not None and self._dtype is not None
            tol = tolerance or default_tolerance(self._dtype, logits_dtype)
            try:
                result = self.admin.verify(ProbeRequest(
                    version=outcome.version, token_ids=ids, trainer_logprobs=logprobs,
                    tolerance=tol))
            except WeightPushError as e:
                result = ("push", f"version {outcome.version} committed, but its probe "
                                  f"failed: {e}")
        result = self._raise_if_error(self._broadcast(result))
        outcome.probe = result
        if not result.passed:
            raise WeightMismatchError(
                f"version {result.version} is served, but its logprobs differ from the "
                f"trainer's forward pass: mean |dlogp| {result.mean_abs_dlogp:.3g} (max "
                f"{result.max_abs_dlogp:.3g}) over {result.tokens} probe tokens > tolerance "
                f"{result.tolerance:.3g}; the server marked it suspect")

    @staticmethod
    def _raise_if_error(outcome: Any) -> Any:
        if isinstance(outcome, tuple):
            kind, message = outcome
            raise _ERRORS[kind](message)
        return outcome

    def _gather_and_send(self, model: nn.Module, buckets: list, push_id: str,
                         buffers: list[str]) -> tuple[list[int], tuple[str, str] | None]:
        """Double-buffered: bucket k is on the wire while k+1 is gathered.
        Returns the CRCs and the first error as (kind, message)."""
        size = max(b.nbytes for b in buckets)
        dev = self.transport.buffer_device
        if not self._buffers or self._buffers[0].numel() < size or self._buffers[0].device != dev:
            pin = dev.type == "cpu" and torch.cuda.is_available()
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=dev, pin_memory=pin)
                             for _ in range(2)]
        in_flight: list[Any] = [None, None]
        checksums: list[int] = []
        err: tuple[str, str] | None = None
        tensors = CheckpointLayout(model).convert(iter_full_tensors(model, self.device, buffers))
        for b in buckets:
            slot = b.index % 2
            try:
                if in_flight[slot] is not None and err is None:
                    in_flight[slot].wait()
            except Exception as e:
                err = ("push", f"sending bucket {b.index - 2} failed: {e}")
            buf = self._buffers[slot][: b.nbytes]
            for s in b.slots:
                name, full = next(tensors)  # gathered on every rank, same order
                if name != s.name:
                    err = err or ("push", f"gather order changed: got {name}, planned {s.name}")
                if err is None:
                    view = buf[s.offset: s.offset + s.nbytes].view(s.dtype).view(s.shape)
                    view.copy_(full)
                    # After the cast: an fp32 value too large for fp16 is caught too.
                    if s.dtype.is_floating_point and not bool(torch.isfinite(view).all()):
                        err = ("nonfinite", f"refusing to push: {name} holds NaN or inf "
                               f"(first such tensor, after casting to {s.dtype}); the "
                               "server keeps serving the previous version")
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
                err = ("push", f"sending bucket {b.index} failed: {e}")
        for w in in_flight:
            try:
                if w is not None and err is None:
                    w.wait()
            except Exception as e:
                err = ("push", f"sending failed: {e}")
        return checksums, err

    def _finish(self, push_id: str, checksums: list[int], err: tuple[str, str] | None,
                buckets: list) -> PushResult | tuple[str, str]:
        assert self.admin is not None
        if err is not None:
            self.transport.reset()
            try:
                self.admin.abort(push_id, err[1])
            except WeightPushError:
                pass  # the server may already have ended it; err says why
            return err
        try:
            resp = self.admin.commit(push_id, checksums)
        except WeightPushError as e:
            self.transport.reset()
            return ("push", str(e))
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
