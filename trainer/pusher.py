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

Several replicas: `url` lists them (or names a `dns+` headless Service). Each
bucket is broadcast once to all of them, and the commit is all-or-nothing
across them (replica_set.py): a push that any replica refuses before the
commit is aborted everywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rollout_sidecar.client.protocol import ProbeRequest, ProbeResult, WeightIndex
from rollout_sidecar.trainer.control.admin_client import (
    NonFiniteWeightsError,
    ServerRestartedError,
    WeightMismatchError,
    WeightPushError,
)
from rollout_sidecar.trainer.control.replica_admins import (
    ReplicaOutcome,
    ReplicaSet,
    describe,
    failures,
)
from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
from rollout_sidecar.trainer.gather.full_tensors import (
    MetaDeviceError,
    iter_full_tensors,
    meta_modules,
    param_plan,
    persistent_buffers,
)
from rollout_sidecar.trainer.pack.buckets import manifest, plan_buckets
from rollout_sidecar.trainer.pack.sender import BucketSender
from rollout_sidecar.trainer.probe import (
    Forward,
    default_tolerance,
    probe_token_ids,
    trainer_logprobs,
)
from rollout_sidecar.trainer.transport.distributed import DistributedTransport
from rollout_sidecar.trainer.transport.http_upload import HttpTransport

log = logging.getLogger(__name__)


class PartialCommitError(WeightPushError):
    """Every replica prepared the push, but the load failed on some: those
    leave the pool (/ready 503 with the reason) until a push succeeds, while
    the others serve the new version. The message lists every replica."""


_ERRORS = {"push": WeightPushError, "nonfinite": NonFiniteWeightsError,
           "mismatch": WeightMismatchError, "restarted": ServerRestartedError,
           "partial": PartialCommitError}


@dataclass
class PushResult:
    version: int
    nbytes: int
    buckets: int
    timings: dict[str, float] = field(default_factory=dict)
    probe: ProbeResult | None = None
    commit_policy: str | None = None
    server_restarted: bool = False  # a server had restarted since the previous push
    replicas: list[ReplicaOutcome] = field(default_factory=list)

    @property
    def probe_gap(self) -> float | None:
        """Mean |served - trainer| logprob over the probe tokens, if probed."""
        return self.probe.mean_abs_dlogp if self.probe else None


class WeightPusher:
    """Push full weights from any trainer layout to a rollout-sidecar server.

    Args:
        url: server URL (default $ROLLOUT_SIDECAR_URL); several replicas as a
            list, a comma-separated string, or `dns+http://name:port` (every
            address of a headless Service, re-resolved at each push). Every
            listed replica takes part in every push.
        admin_token: weights token (default $ROLLOUT_SIDECAR_ADMIN_TOKEN).
        transport: "gloo" (host memory), "nccl" (GPU to GPU) or "http".
        bucket_mb: bucket size; rank 0's extra peak is about 3 x bucket: two
            send buffers (a tensor larger than a bucket is split across
            buckets) plus at most 0.75 bucket of a gather (FSDP2 brings a
            parameter larger than a quarter bucket to rank 0 in half-bucket
            blocks of rows, see `row_blocks`; FSDP1 gathers one unit at a
            time). The server copies each split tensor
            once while loading (see server/weights/staging.py).
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
        fanout: how each bucket reaches every receiver over gloo/NCCL:
            "broadcast", "chain" (gloo only: rank 0 sends it once and each
            receiver relays it to the next, so the trainer's link carries each
            bucket once however many replicas listen), or "auto" (chain for
            gloo with more than one receiver, else broadcast).
        row_blocks: False gathers every FSDP2 parameter whole with
            `full_tensor()` (on every rank at once) instead of bringing those
            larger than a quarter bucket to rank 0 in blocks of rows.
    """

    def __init__(self, url: str | Sequence[str] | None = None, admin_token: str | None = None,
                 transport: str = "gloo", bucket_mb: float = 256,
                 device: torch.device | None = None, data_plane_host: str | None = None,
                 verify: bool | Forward = True, verify_tolerance: float | None = None,
                 verify_every: int = 1, commit_policy: str | None = None,
                 on_server_restart: Literal["repush", "raise"] = "repush",
                 takeover: bool = False, lease_wait_s: float = 60.0,
                 split_tensors: bool = True, row_blocks: bool = True,
                 fanout: Literal["auto", "broadcast", "chain"] = "auto") -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.split_tensors = split_tensors
        self.row_blocks = row_blocks
        self.device = device
        self.verify, self.verify_tolerance = verify, verify_tolerance
        self.verify_every = max(1, verify_every)
        self.commit_policy = commit_policy
        self.on_server_restart = on_server_restart
        self._pushes = 0
        self._boot_ids: dict[str, str] = {}
        self._index: WeightIndex | None = None
        self._statuses: list[Any] = []
        self._sender = BucketSender()
        self.transport: Any = None
        self.replicas: ReplicaSet | None = None
        if self.rank == 0:
            self.replicas = ReplicaSet(url, admin_token)
            if transport == "http":
                self.transport = HttpTransport(self.replicas)
            elif transport in ("gloo", "nccl"):
                self.transport = DistributedTransport(self.replicas, transport, data_plane_host,
                                                      takeover, lease_wait_s, fanout)
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
        # Rank 0's setting for every rank: row blocks are collectives. Half a
        # bucket: rank 0 then holds two send buffers plus at most 0.75 bucket
        # of a gather (a block, or a whole gather of at most a quarter bucket).
        block_bytes = self._broadcast(self.bucket_bytes // 2 if self.row_blocks else None)
        if self.rank == 0:
            buckets, push_ids, buffers, restarted = begun
            gathers = iter_full_tensors(model, self.device, buffers, block_bytes)
            try:
                checksums, err = self._sender.send_all(
                    buckets, CheckpointLayout(model).convert(gathers), self.transport, push_ids)
            except Exception as e:  # e.g. a layout conversion; agreed on below
                checksums, err = [], ("push", f"{type(e).__name__}: {e}")
            for _ in gathers:  # finish every gather the other ranks are in
                pass
        else:
            for _ in iter_full_tensors(model, self.device, (), block_bytes):  # every gather
                pass
        t_sent = time.perf_counter()
        outcome: PushResult = self._agree(
            lambda: self._finish(push_ids, checksums, err, buckets, restarted)
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

    def _begin(self, model: nn.Module, version: int) -> tuple[list, list[str], list[str], bool]:
        rs = self.replicas
        assert rs is not None
        if rs.refresh():  # a dns+ name resolved to other pods: a new group, a new index
            self._index = None
        self._statuses = statuses = rs.all(lambda a, i: a.status(), "status")
        restarted = [u for u, st in zip(rs.urls, statuses, strict=True)
                     if u in self._boot_ids and self._boot_ids[u] != st.boot_id]
        if restarted:
            msg = (f"{', '.join(restarted)} restarted and serve their checkpoint's weights "
                   "again")
            if self.on_server_restart == "raise":
                raise ServerRestartedError(msg)
            log.warning("%s; pushing version %d restores the trained weights", msg, version)
        self._boot_ids = {u: st.boot_id for u, st in zip(rs.urls, statuses, strict=True)}
        if len({st.dtype for st in statuses}) > 1:
            raise WeightPushError("replicas serve different dtypes: " + ", ".join(
                f"{u}: {st.dtype}" for u, st in zip(rs.urls, statuses, strict=True)))
        serve_dtype = getattr(torch, statuses[0].dtype)
        if self._index is None or restarted:
            self._index = _same_index(rs.all(lambda a, i: a.index(), "index"), rs.urls)
        # Persistent buffers the served checkpoint holds travel with the params.
        buffers = sorted(set(persistent_buffers(model)) & set(self._index.tensors))
        self.transport.ensure_connected(statuses)
        wire = {n: getattr(torch, t.dtype) for n, t in self._index.tensors.items()}
        plan = CheckpointLayout(model).plan(param_plan(model, buffers))
        buckets = plan_buckets(plan, serve_dtype, self.bucket_bytes, wire, self.split_tensors)
        begun = rs.each(lambda a, i: a.begin(version, self.transport.name, manifest(buckets),
                                             self.transport.connection_id, self.commit_policy))
        if bad := failures(begun):
            ids = [None if isinstance(r, Exception) else r.push_id for r in begun]
            self._abort_all(ids, "another replica refused the push at begin")
            raise WeightPushError("begin refused, nothing sent: " + "; ".join(
                f"{rs.urls[i]}: {begun[i]}" for i in bad))
        return buckets, [r.push_id for r in begun], buffers, bool(restarted)

    def _abort_all(self, push_ids: list[str | None], reason: str) -> None:
        """Abort on every replica that holds the push (a failed one already
        ended it); the group is out of step with at least one of them."""
        assert self.replicas is not None
        # The servers first, so each records the trainer's reason; aborting
        # our side of the group first would fail their receives with a
        # connection error that races the abort.
        self.replicas.each(lambda a, i: a.abort(push_ids[i], reason)
                           if push_ids[i] is not None else None)
        self.transport.reset()

    def _finish(self, push_ids: list[str], checksums: list[int],
                err: tuple[str, str] | None, buckets: list, restarted: bool) -> PushResult:
        rs = self.replicas
        assert rs is not None
        if err is not None:
            self._abort_all(push_ids, err[1])
            raise _ERRORS[err[0]](err[1])
        # Each server may wait for in-flight requests, then load: bound by its numbers.
        s = max(self._statuses, key=lambda st: st.push_timeout_s + st.commit_drain_s)
        timeout_s = s.push_timeout_s + s.commit_drain_s + 60
        # Phase 1: every replica has every bucket, CRC-checked; nothing is loaded yet.
        prepared = rs.each(lambda a, i: a.prepare(push_ids[i], checksums, timeout_s))
        if bad := failures(prepared):
            self._abort_all([None if i in bad else p for i, p in enumerate(push_ids)],
                            f"another replica refused the push: {prepared[bad[0]]}")
            version = ", ".join(str(st.weight_version) for st in self._statuses)
            raise WeightPushError(
                f"push refused before the commit, on {len(bad)} of {len(push_ids)} replicas, "
                f"so no replica published it (versions {version} keep serving): "
                + "; ".join(f"{rs.urls[i]}: {prepared[i]}" for i in bad))
        # Phase 2: load everywhere.
        committed = rs.each(lambda a, i: a.commit(push_ids[i], None, timeout_s))
        outcomes = [ReplicaOutcome(u, "failed", None, str(r)) if isinstance(r, Exception)
                    else ReplicaOutcome(u, "committed", r.weight_version, None, r.timings)
                    for u, r in zip(rs.urls, committed, strict=True)]
        if bad := failures(committed):
            self.transport.reset()
            if len(bad) == len(committed):  # e.g. a load refused before touching the model
                raise WeightPushError("push refused at the commit on every replica, nothing "
                                      f"published: {describe(outcomes)}")
            raise PartialCommitError(
                "every replica prepared the push, but the commit failed on some (a failed load "
                f"answers 503 until a push succeeds): {describe(outcomes)}")
        first = committed[0]
        return PushResult(version=first.weight_version, nbytes=sum(b.nbytes for b in buckets),
                          buckets=len(buckets), commit_policy=first.commit_policy,
                          server_restarted=restarted, replicas=outcomes,
                          timings={f"server_{k}": max(o.timings.get(k, 0.0) for o in outcomes)
                                   for k in first.timings}
                          | {"server_verify_s": max(p.timings.get("verify_s", 0.0)
                                                    for p in prepared)})

    def _probe(self, model: nn.Module, outcome: PushResult, verify: bool | Forward,
               tolerance: float | None) -> None:
        """All ranks: forward the probe; rank 0: have every replica compare."""
        ids = self._agree(lambda: probe_token_ids(self._statuses[0].vocab_size,
                                                  min(s.max_model_len for s in self._statuses))
                          if self.rank == 0 else None)
        forward = verify if callable(verify) else None
        logprobs, logits_dtype = trainer_logprobs(model, ids, self.device, forward)

        def ask() -> tuple[ProbeResult, str] | None:
            if self.rank != 0:
                return None
            assert self.replicas is not None
            tol = tolerance or default_tolerance(getattr(torch, self._statuses[0].dtype),
                                                 logits_dtype)
            req = ProbeRequest(version=outcome.version, token_ids=ids,
                               trainer_logprobs=logprobs, tolerance=tol)
            results = self.replicas.all(lambda a, i: a.verify(req), "probe")
            worst = max(range(len(results)), key=lambda i: (not results[i].passed,
                                                            results[i].mean_abs_dlogp))
            return results[worst], self.replicas.urls[worst]

        result, where = self._agree(ask)
        outcome.probe = result
        if not result.passed:
            raise WeightMismatchError(
                f"version {result.version} is served, but its logprobs on {where} differ from "
                f"the trainer's forward pass: mean |dlogp| {result.mean_abs_dlogp:.3g} (max "
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
        if self.transport is not None:
            self.transport.reset()
        if self.replicas is not None:
            self.replicas.close()


def _same_index(indexes: list[WeightIndex], urls: list[str]) -> WeightIndex:
    """Every replica must serve the same tensors, or one push cannot fit all."""
    first = indexes[0].tensors
    for url, idx in zip(urls[1:], indexes[1:], strict=True):
        if idx.tensors != first:
            diff = sorted(set(first) ^ set(idx.tensors)) or sorted(
                n for n in first if first[n] != idx.tensors[n])
            raise WeightPushError(f"{url} serves a different model than {urls[0]}: "
                                  f"tensors differ ({', '.join(diff[:5])})")
    return indexes[0]
