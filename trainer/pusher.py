"""`WeightPusher`: call `push(model, version)` on every trainer rank after
`optimizer.step()`; a moment later /generate serves exactly those weights.
A framework that hands over `(name, full tensor)` pairs instead of a module
calls `push_tensors` (gather/named_tensors.py), which takes the same steps.

A push, in order:
  1. refuse a model with parameters still on the meta device (any rank's);
  2. open (rank 0): read what every replica serves (control/serving_state.py),
     connect the data plane, and say whether a delta or an adapter can go;
  3. plan (push_plan.py), on every rank: the encoding (dense, delta from every
     rank's diff of its own shard, adapter, adapter+base) and why; begin: lay
     out the buckets and their senders (push_layout.py), begin on every replica;
  4. gather and send (push_sends.py): every rank gathers every bucket in the
     same order (the collectives line up); rank 0, or every rank its share,
     packs and sends (pack/sender.py): the full tensors, or the changed
     elements of each rank's shard; or, where every rank sends an FSDP2
     model, each rank its own rows, with no gather (gather/own_rows.py);
  5. prepare, then commit, on every replica (two_phase.py): all or
     nothing across replicas, a refusal before the commit aborts everywhere;
     every rank's shard copy then moves to this version (the next delta's base);
     meanwhile every rank runs the probe's forward (the servers are loading);
  6. probe (probe.py): the served logprobs against that forward.
Only rank 0 talks to the servers. After steps 2, 3, 5 and 6 the ranks agree on
the outcome (rank_agreement.py): whatever rank 0 hit is raised on every rank
at the same point instead of leaving peers blocked in a collective. Every
wait is bounded (control/deadlines.py): a stall by `stall_timeout_s`, a slow
phase by the servers' push deadline (`/weights/status`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from rollout_sidecar.protocol.schema import Check, CommitPolicy
from rollout_sidecar.trainer.adapter.adapter_push import AdapterPush
from rollout_sidecar.trainer.control.deadlines import Deadlines
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.control.serving_state import ServingState
from rollout_sidecar.trainer.delta.delta_push import DeltaPush
from rollout_sidecar.trainer.errors import from_kind
from rollout_sidecar.trainer.gather.full_tensors import (
    MetaDeviceError,
    meta_modules,
)
from rollout_sidecar.trainer.gather.named_tensors import NamedLayout, NamedTensors
from rollout_sidecar.trainer.pack.buckets import manifest
from rollout_sidecar.trainer.pack.sender import BucketSender
from rollout_sidecar.trainer.probe import Forward, LogitsOf, commit_with_forward, probe_push
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.push_layout import lay_out, why_gathered
from rollout_sidecar.trainer.push_opening import Opening, open_push
from rollout_sidecar.trainer.push_plan import PushPlan
from rollout_sidecar.trainer.push_result import PushResult
from rollout_sidecar.trainer.push_sends import Begun, PushSends
from rollout_sidecar.trainer.rank_agreement import agree, any_rank, rank
from rollout_sidecar.trainer.release import close_parts, close_when_gone
from rollout_sidecar.trainer.sending_ranks import (
    Sent,
    connect_every_rank,
)
from rollout_sidecar.trainer.transport.base import Transport
from rollout_sidecar.trainer.transport.distributed import DistributedTransport
from rollout_sidecar.trainer.transport.peer_sender import PeerSender
from rollout_sidecar.trainer.transport.registry import build_sender
from rollout_sidecar.trainer.two_phase import TwoPhaseCommit

__all__ = ["WeightPusher"]


class WeightPusher(PushSends):
    """Push full weights from any trainer layout (FSDP2, FSDP1, DDP, plain)
    to rollout-sidecar servers.

    Args:
        url: server URL (default $ROLLOUT_SIDECAR_URL); several replicas as a
            list, a comma-separated string, or `dns+http://name:port` (every
            address of a headless Service, re-resolved at each push). Every
            listed replica takes part in every push.
        admin_token: weights token (default $ROLLOUT_SIDECAR_ADMIN_TOKEN).
        config: how to push (push_config.py documents each field).
        **options: `PushConfig` fields as keyword arguments
            (`transport="http"`, `bucket_mb=64`, `probe=False`, ...), applied
            on top of `config`.
    """

    def __init__(self, url: str | Sequence[str] | None = None, admin_token: str | None = None,
                 *, config: PushConfig | None = None, **options: Any) -> None:
        self.config = PushConfig.build(config, options)
        self.rank = rank()
        self._pushes = 0
        # The last push's probe gap, if it passed: the next probe's floor (probe.py).
        self._probe_floor: float | None = None
        self._sender = BucketSender()
        self._serving = ServingState()
        self._delta = DeltaPush(self.config.delta_copy, self.config.delta_dense_above) \
            if self.config.delta is not False else None
        self._adapter = AdapterPush(self.config.adapter)
        self._named = NamedLayout()  # a named-tensor stream's order, learned (push_tensors)
        # Rank 0 alone talks to the servers: the others hold no connection.
        self.replicas: ReplicaAdmins | None = None
        self.transport: Transport | None = None
        # Ranks 1 .. N-1 when every rank sends (sending_ranks.py): their group.
        self._peer = PeerSender()
        self._check: Check = "crc32"  # this push's (every rank: `_connect`)
        if self.rank == 0:
            c = self.config
            deadlines = Deadlines(c.stall_timeout_s, c.connect_timeout_s)
            self.replicas = ReplicaAdmins(url, admin_token, deadlines)
            self.transport = build_sender(c.transport, self.replicas, c)
        # Closed once collected, or at interpreter exit, if the caller never does.
        close_when_gone(self, self.transport, self.replicas, self._sender, self._peer)

    @property
    def _two_phase(self) -> TwoPhaseCommit:
        # Built per use, over whatever `transport` is now (tests swap it in).
        assert self.replicas is not None and self.transport is not None, "rank 0 only"
        return TwoPhaseCommit(self.replicas, self.transport)

    @property
    def commit_policy(self) -> CommitPolicy | None:
        return self.config.commit_policy

    @commit_policy.setter
    def commit_policy(self, policy: CommitPolicy | None) -> None:  # e.g. switched per push
        self.config.commit_policy = policy

    def push(self, model: nn.Module, version: int, *, probe: bool | Forward | None = None,
             probe_tolerance: float | None = None, adapter: bool | None = None,
             draft: nn.Module | None = None) -> PushResult:
        """Gather, send and commit `model` as `version`; call it on every rank.

        With `probe` (default: the pusher's), the commit is followed by the
        probe; a gap over the tolerance raises `WeightMismatchError` on every
        rank after the server marked the version suspect. Turn it off when the
        model's forward cannot take a bare `input_ids` batch or has side
        effects, or when pushes are so frequent that one extra forward per push
        matters (see docs/proofs.md, "The probe"). `adapter` (default: the
        pusher's `adapter` setting) sends a PEFT LoRA model's adapter instead
        of merged weights. `draft` (a second module, or `model` itself) is the
        replicas' speculative drafter, pushed with the target and loaded in
        the same commit (draft_push.py); without it their drafter stays
        frozen, and `PushResult.drafter` says so.
        """
        return self._push(model, version, probe, probe_tolerance, adapter, draft)

    def push_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]] | None, version: int,
                     *, every_rank: bool = True,
                     probe: nn.Module | Callable[[torch.Tensor], torch.Tensor] | None = None,
                     probe_tolerance: float | None = None) -> PushResult:
        """Push `(name, full tensor)` pairs as `version`: what frameworks hand
        over instead of a module (verl's `get_per_tensor_param()`, a state
        dict's `items()`); call it on every rank. Names are the served
        checkpoint's (`GET /weights/index`); every tensor it lists comes
        once, each at its shape, in any order (gather/named_tensors.py).
        `every_rank`: every rank yields every tensor in the same order (each
        may be a collective), so each can send its share; with False, rank
        0's tensors are read and the others pass None. The push is dense (no
        shard copy to diff) and all or nothing as any other. `probe`: a
        module whose forward takes `input_ids` (the policy), or a function
        from input ids to logits, for the post-push probe; none: no probe.
        """
        forward = None if probe is None else probe if isinstance(probe, nn.Module) \
            else LogitsOf(probe)
        return self._push(NamedTensors(tensors, every_rank), version,
                          forward if forward is not None else False, probe_tolerance,
                          False, None)

    def _push(self, model: nn.Module | NamedTensors, version: int,
              probe: bool | Forward | nn.Module | None, probe_tolerance: float | None,
              adapter: bool | None, draft: nn.Module | None) -> PushResult:
        t0 = time.perf_counter()
        named = model if isinstance(model, NamedTensors) else None
        bad = [] if named is not None else meta_modules(model)
        bad += meta_modules(draft) if draft is not None else []
        if any_rank(bool(bad)):
            raise MetaDeviceError(
                "refusing to push: parameters still on the meta device in modules "
                f"{bad[:8] if bad else '(on another rank)'}; materialise them "
                "(e.g. to_empty() + init/load) before pushing")

        opening: Opening = agree(lambda: self._open(model, version, adapter, draft)
                                 if self.rank == 0 else None)
        if named is not None:  # the probe runs on the module or function given
            model, probe = (probe if isinstance(probe, nn.Module) else nn.Module()), \
                (probe is not False)
            source: nn.Module | NamedTensors = named
        else:
            source = model
        self._connect(opening, version)
        t_opened = time.perf_counter()
        plan = self._plan(source, opening)  # every rank: the same plan
        diff_s = time.perf_counter() - t_opened  # every rank's diff and the counts
        begun: Begun = agree(lambda: self._begin(source, version, plan, draft)
                              if self.rank == 0 else None)
        t_begun = time.perf_counter()
        if plan.delta is not None:
            sent = self._send_delta(plan.delta, begun)
        elif named is not None:
            sent = self._send_named(named, begun, opening)
        else:
            sent = self._gather_and_send(model, begun, plan, draft)
        t_sent = time.perf_counter()
        if probe is None:  # the pusher's setting, every probe_every-th push
            probe = self.config.probe if self._pushes % self.config.probe_every == 0 else False

        def commit() -> PushResult | None:
            return self._commit(begun, sent, opening.restarted) if self.rank == 0 else None

        forwarded = None
        # The probe's forward while the servers load. On `probe` alone, the
        # same on every rank (a send error is rank 0's: its commit aborts and
        # raises, and every rank raises it once the forward is done).
        if probe:
            result, forwarded = commit_with_forward(commit, model, self._serving
                                                    if self.rank == 0 else None, probe,
                                                    self.config.device)
        else:
            result = agree(commit)
        t_committed = time.perf_counter()
        if self._delta is not None and opening.keep_copy:  # the next delta's base
            self._delta.committed(model, opening, result.version, plan.delta)
        self._adapter.committed(plan.adapter, result.version)
        result.encoding, result.delta_base = plan.encoding, plan.delta_base
        result.adapter_reason = opening.adapter_reason
        result.senders, result.senders_reason = begun.sending()
        result.own_rows, result.own_rows_reason = begun.own_rows, begun.own_rows_reason
        if named is not None:
            result.held_bytes = self._named.held_bytes
        result.check = opening.check
        if plan.delta is not None:
            result.timings["diff_s"] = diff_s
            result.changed = sum(p.changed for p in plan.delta.plans
                                 if p.form.value != "dense")
            result.elements = sum(p.numel for p in plan.delta.plans)
        else:
            result.delta_reason = plan.why_dense
        self._pushes += 1
        floor, self._probe_floor = self._probe_floor, None  # only from the push before
        if forwarded is not None:
            tolerance = probe_tolerance or self.config.probe_tolerance
            result.probe = probe_push(forwarded, result.version, self.replicas,
                                      self._serving if self.rank == 0 else None,
                                      tolerance, floor)
            if tolerance is None:  # the next push's floor; the same on every rank
                self._probe_floor = result.probe.mean_abs_dlogp
        if forwarded is not None:
            result.timings["probe_forward_s"] = forwarded.seconds
        result.timings.update(open_s=t_opened - t0, begin_s=t_begun - t0,
                              gather_send_s=t_sent - t_begun, commit_s=t_committed - t_sent,
                              probe_s=time.perf_counter() - t_committed,
                              total_s=time.perf_counter() - t0)
        return result

    def _open(self, source: nn.Module | NamedTensors, version: int, adapter: bool | None,
              draft: nn.Module | None) -> Opening:
        """Rank 0: read the replicas and connect (push_opening.py)."""
        assert self.replicas is not None and self.transport is not None
        return open_push(source, version, adapter, draft, self.replicas, self.transport,
                         self._serving, self.config, self._adapter,
                         self._delta.copy.version if self._delta else None)

    def _connect(self, opening: Opening, version: int) -> None:
        """Every rank: join the connection rank 0 drew, if any (several
        senders, sending_ranks.py), then start this push's bucket tags."""
        t = self.transport if isinstance(self.transport, DistributedTransport) else None
        redraw = (lambda: t.plan_connect(self._serving.statuses, opening.senders)) \
            if t is not None else (lambda: None)
        connect_every_rank(self.rank, opening.rendezvous, opening.senders, t, self._peer,
                           redraw)
        self._check = opening.check
        if self.rank == 0:
            assert self.transport is not None
            self.transport.start_push(version)  # gloo/NCCL: this push's bucket tags
        elif self._peer.group is not None:
            self._peer.start_push(version)

    def _plan(self, model: nn.Module | NamedTensors, opening: Opening) -> PushPlan:
        """Every rank: a delta if one may go and is worth it (the diff is a
        collective), else what `opening` says (push_plan.py)."""
        if opening.draft_buffers is not None:
            return PushPlan(opening, None, "a push with a drafter: dense",
                            "a push with a drafter: every rank gathers")
        if isinstance(model, NamedTensors):
            return PushPlan(opening, None, opening.why_dense)
        delta, why_dense = self._delta.plan(model, opening, self.config.bucket_bytes) \
            if self._delta is not None else (None, None)
        return PushPlan(opening, delta, why_dense, why_gathered(model, opening, self.config))

    def _begin(self, model: nn.Module | NamedTensors, version: int, plan: PushPlan,
               draft: nn.Module | None) -> Begun:
        """Rank 0: lay out the buckets (push_layout.py), begin everywhere."""
        lay = lay_out(model, plan, draft, self._serving, self.config, self._named)
        push_ids = self._two_phase.begin(version, manifest(lay.buckets),
                                         self.config.commit_policy,
                                         self._serving.commit_timeout_s, plan.delta_base,
                                         plan.adapter.model_dump(exclude_none=True)
                                         if plan.adapter is not None else None,
                                         plan.opening.check)
        return Begun(lay.buckets, push_ids, lay.senders, lay.senders_reason, lay.own_rows,
                     lay.own_rows_reason)

    def _commit(self, begun: Begun, sent: Sent, restarted: bool) -> PushResult:
        """Rank 0: abort on a send error, else prepare and commit everywhere."""
        two_phase, transport = self._two_phase, self.transport
        assert transport is not None, "rank 0 only"
        err = sent.error
        if err is not None:
            kind, message = err
            if kind == "push":  # the data plane or a replica failed: say what each answered
                message = two_phase.abort_after_send_error(begun.push_ids, message)
            else:
                two_phase.abort(begun.push_ids, message)
            raise from_kind(kind, message)
        timeout_s = self._serving.commit_timeout_s
        checksums = [sent.checksums[b.index] for b in begun.buckets]
        tags = [sent.tags[b.index] for b in begun.buckets] \
            if transport.bucket_macs is not None else None
        if len(begun.push_ids) == 1:  # one replica: check and commit in one call
            prepared = []
            committed, outcomes = two_phase.commit(begun.push_ids, timeout_s, checksums, tags)
        else:
            prepared = two_phase.prepare(begun.push_ids, checksums, timeout_s,
                                         self._serving.versions, tags)
            committed, outcomes = two_phase.commit(begun.push_ids, timeout_s)
        result = PushResult.committed(begun.buckets, prepared, committed, outcomes, restarted)
        result.route, result.absent = transport.route, dict(two_phase.replicas.absent)
        return result

    def close(self) -> None:
        """Release the data-plane connection on every replica (a few seconds at
        most, best effort: it never raises for a server that is down), so the
        next pusher, in this process or a restarted one, connects at once;
        then end this side of the data plane for good: the group destroyed in
        this thread (its gloo threads joined), a join still running waited
        for, the send buffers freed, the HTTP clients closed. Nothing of it
        is left to interpreter exit, where a gloo thread can abort the
        process. Idempotent; a pusher never closed is closed once collected,
        or at interpreter exit (release.py)."""
        close_parts(self.transport, self.replicas, self._sender, self._peer)

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
