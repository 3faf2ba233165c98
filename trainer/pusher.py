"""`WeightPusher`: call `push(model, version)` on every trainer rank after
`optimizer.step()`; a moment later /generate serves exactly those weights.

Every rank gathers every bucket in the same order (the collectives line up);
only rank 0 talks to the server, packs and sends (sender.py). Ranks agree on
the outcome after `begin`, after `commit` and after the probe: whatever rank 0
hit (a server error, an OOM while packing, a lost connection) is broadcast,
and every rank raises the same exception type at the same point instead of
leaving peers blocked in a collective. Every wait is bounded by the server's
push deadline (`/weights/status`). The probe (`verify`, on by default) proves
the commit: see probe.py.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rollout_sidecar.client.schema import ProbeRequest, ProbeResult, WeightIndex
from rollout_sidecar.trainer.admin_client import (
    NonFiniteWeightsError,
    ServerRestartedError,
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
from rollout_sidecar.trainer.sender import BucketSender
from rollout_sidecar.trainer.transport.distributed import DistributedTransport
from rollout_sidecar.trainer.transport.http import HttpTransport

log = logging.getLogger(__name__)
_ERRORS = {"push": WeightPushError, "nonfinite": NonFiniteWeightsError,
           "mismatch": WeightMismatchError, "restarted": ServerRestartedError}


@dataclass
class PushResult:
    version: int
    nbytes: int
    buckets: int
    timings: dict[str, float] = field(default_factory=dict)
    probe: ProbeResult | None = None
    commit_policy: str | None = None
    server_restarted: bool = False  # the server had restarted since the previous push

    @property
    def probe_gap(self) -> float | None:
        """Mean |served - trainer| logprob over the probe tokens, if probed."""
        return self.probe.mean_abs_dlogp if self.probe else None


class WeightPusher:
    """Push full weights from any trainer layout to a rollout-sidecar server.

    Args:
        url: server URL (default $ROLLOUT_SIDECAR_URL).
        admin_token: weights token (default $ROLLOUT_SIDECAR_ADMIN_TOKEN).
        transport: "gloo" (host memory), "nccl" (GPU to GPU) or "http".
        bucket_mb: bucket size; rank 0's extra peak is about 2 x bucket (two
            send buffers: a tensor larger than a bucket is split across
            buckets) plus the largest tensor gathered (FSDP materialises one
            full tensor at a time). The server copies each split tensor once
            while loading (see server/weights/staging.py).
        device: compute device for FSDP gathers (default: the mesh's device).
        data_plane_host: where the server's TCPStore listens (default: url host).
        verify: after each commit, probe the server against this trainer's own
            forward pass (see `push`). True uses `model(input_ids=...)`; pass a
            callable `(model, input_ids) -> logits` for other models, or False.
        verify_tolerance: largest acceptable mean |dlogp| of the probe;
            default by precision (fp32 1e-3, fp16 0.05, bf16 0.1).
        verify_every: probe every N-th push (the first always), to amortise
            the probe's forward pass when pushes are frequent.
        commit_policy: in-flight requests at this trainer's commits (wait,
            abort, keep); default: the server's.
        on_server_restart: the server restarted (new boot id) since the last
            push and serves its checkpoint again: "repush" (log it, push this
            version as usual, `PushResult.server_restarted`) or "raise"
            (`ServerRestartedError`).
        takeover: connect even while another trainer's connection is live.
        lease_wait_s: how long to wait for another trainer's connection lease
            to run out (a restarted trainer finds its old self there) before
            raising.
        split_tensors: False gives a tensor larger than a bucket a bucket of
            its own instead of splitting it (for servers that predate chunked
            manifests); the send buffers then grow to 2 x the largest tensor.
    """

    def __init__(self, url: str | None = None, admin_token: str | None = None,
                 transport: str = "gloo", bucket_mb: float = 256,
                 device: torch.device | None = None, data_plane_host: str | None = None,
                 verify: bool | Forward = True, verify_tolerance: float | None = None,
                 verify_every: int = 1, commit_policy: str | None = None,
                 on_server_restart: Literal["repush", "raise"] = "repush",
                 takeover: bool = False, lease_wait_s: float = 60.0,
                 split_tensors: bool = True) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.split_tensors = split_tensors
        self.device = device
        self.verify, self.verify_tolerance = verify, verify_tolerance
        self.verify_every = max(1, verify_every)
        self.commit_policy = commit_policy
        self.on_server_restart = on_server_restart
        self._pushes = 0
        self._boot_id: str | None = None
        self._index: WeightIndex | None = None
        self._status: Any = None
        self._sender = BucketSender()
        self.transport: Any = None
        self.admin: WeightAdminClient | None = None
        if self.rank == 0:
            url = url or os.environ.get("ROLLOUT_SIDECAR_URL", "http://127.0.0.1:8000")
            self.admin = WeightAdminClient(url, admin_token)
            if transport == "http":
                self.transport = HttpTransport(self.admin)
            elif transport in ("gloo", "nccl"):
                self.transport = DistributedTransport(self.admin, transport, data_plane_host,
                                                      takeover, lease_wait_s)
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

        begun = self._agree(lambda: self._begin(model, version) if self.rank == 0 else None)
        t_begun = time.perf_counter()
        if self.rank == 0:
            buckets, push_id, buffers, restarted = begun
            gathers = iter_full_tensors(model, self.device, buffers)
            try:
                checksums, err = self._sender.send_all(
                    buckets, CheckpointLayout(model).convert(gathers), self.transport, push_id)
            except Exception as e:  # e.g. a layout conversion; agreed on below
                checksums, err = [], ("push", f"{type(e).__name__}: {e}")
            for _ in gathers:  # finish every gather the other ranks are in
                pass
        else:
            for _ in iter_full_tensors(model, self.device):  # take part in every gather
                pass
        t_sent = time.perf_counter()
        outcome: PushResult = self._agree(
            lambda: self._finish(push_id, checksums, err, buckets, restarted)
            if self.rank == 0 else None)
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

    def _begin(self, model: nn.Module, version: int) -> tuple[list, str, list[str], bool]:
        assert self.admin is not None
        self._status = status = self.admin.status()
        restarted = self._boot_id is not None and status.boot_id != self._boot_id
        if restarted:
            msg = (f"the server restarted (boot {self._boot_id} -> {status.boot_id}) and "
                   f"serves weight_version {status.weight_version} again")
            if self.on_server_restart == "raise":
                raise ServerRestartedError(msg)
            log.warning("%s; pushing version %d restores the trained weights", msg, version)
            self._index = None
        self._boot_id = status.boot_id
        serve_dtype = getattr(torch, status.dtype)
        if self._index is None:
            self._index = self.admin.index()
        # Persistent buffers the served checkpoint holds travel with the params.
        buffers = sorted(set(persistent_buffers(model)) & set(self._index.tensors))
        self.transport.ensure_connected(status)
        wire = {n: getattr(torch, t.dtype) for n, t in self._index.tensors.items()}
        plan = CheckpointLayout(model).plan(param_plan(model, buffers))
        buckets = plan_buckets(plan, serve_dtype, self.bucket_bytes, wire, self.split_tensors)
        resp = self.admin.begin(version, self.transport.name, manifest(buckets),
                                self.transport.connection_id, self.commit_policy)
        return buckets, resp.push_id, buffers, restarted

    def _finish(self, push_id: str, checksums: list[int], err: tuple[str, str] | None,
                buckets: list, restarted: bool) -> PushResult:
        assert self.admin is not None
        if err is not None:
            self.transport.reset()
            try:
                self.admin.abort(push_id, err[1])
            except WeightPushError:
                pass  # the server may already have ended it; err says why
            raise _ERRORS[err[0]](err[1])
        # The server may wait for in-flight requests, then load: bound by its numbers.
        s = self._status
        try:
            resp = self.admin.commit(push_id, checksums,
                                     timeout_s=s.push_timeout_s + s.commit_drain_s + 60)
        except WeightPushError:
            self.transport.reset()
            raise
        return PushResult(version=resp.weight_version, nbytes=sum(b.nbytes for b in buckets),
                          buckets=len(buckets), commit_policy=resp.commit_policy,
                          server_restarted=restarted,
                          timings={f"server_{k}": v for k, v in resp.timings.items()})

    def _probe(self, model: nn.Module, outcome: PushResult, verify: bool | Forward,
               tolerance: float | None) -> None:
        """All ranks: forward the probe; rank 0: have the server compare."""
        ids = self._agree(lambda: probe_token_ids(self._status.vocab_size,
                                                  self._status.max_model_len)
                          if self.rank == 0 else None)
        forward = verify if callable(verify) else None
        logprobs, logits_dtype = trainer_logprobs(model, ids, self.device, forward)

        def ask() -> ProbeResult | None:
            if self.rank != 0:
                return None
            assert self.admin is not None
            tol = tolerance or default_tolerance(getattr(torch, self._status.dtype),
                                                 logits_dtype)
            return self.admin.verify(ProbeRequest(version=outcome.version, token_ids=ids,
                                                  trainer_logprobs=logprobs, tolerance=tol))

        result: ProbeResult = self._agree(ask)
        outcome.probe = result
        if not result.passed:
            raise WeightMismatchError(
                f"version {result.version} is served, but its logprobs differ from the "
                f"trainer's forward pass: mean |dlogp| {result.mean_abs_dlogp:.3g} (max "
                f"{result.max_abs_dlogp:.3g}) over {result.tokens} probe tokens > tolerance "
                f"{result.tolerance:.3g}; the server marked it suspect")

    # ------------------------------------------------------- rank agreement

    def _agree(self, step: Any) -> Any:
        """Run `step` (rank 0 does the work), share its result or its error, and
        raise the same exception type on every rank."""
        try:
            out: Any = ("ok", step())
        except WeightPushError as e:
            kind = next((k for k, t in _ERRORS.items() if type(e) is t), "push")
            out = ("error", (kind, str(e)))
        except Exception as e:  # anything else rank 0 hit: every rank raises it as a push error
            out = ("error", ("push", f"{type(e).__name__}: {e}"))
        status, value = self._broadcast(out)
        if status == "error":
            raise _ERRORS[value[0]](value[1])
        return value

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
