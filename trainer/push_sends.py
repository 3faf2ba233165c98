"""How a push's bytes leave the trainer: the step after begin, for each
kind of push (pusher.py runs them in order).

- dense, one sender: every rank gathers every tensor, rank 0 converts (a
  PEFT merge, a checkpoint layout), packs and sends (`_gather_and_send`);
- dense, every rank sending: each rank sends the rows of its own FSDP2
  shards, with no gather (gather/own_rows.py), or, where it cannot, every
  rank gathers every tensor and sends the buckets the manifest names it
  for (`_every_rank_sends`);
- named tensors: the stream in the manifest's order, sent by rank 0 or by
  every rank that holds it (`_send_named`, gather/named_tensors.py);
- delta: every rank's changes, encoded and sent by rank 0 (`_send_delta`).

Each returns a `Sent` (the check values by bucket, and the first error)
instead of raising, so every rank keeps taking part in every collective;
the commit then agrees on the outcome.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from rollout_sidecar.protocol.schema import BucketManifest, Check
from rollout_sidecar.trainer.adapter.lora_adapter import LoraAdapter
from rollout_sidecar.trainer.delta.delta_push import DeltaPlan
from rollout_sidecar.trainer.draft_push import converted_target, with_draft
from rollout_sidecar.trainer.errors import Error
from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors
from rollout_sidecar.trainer.gather.named_tensors import NamedLayout, NamedTensors
from rollout_sidecar.trainer.gather.own_rows import OwnRows
from rollout_sidecar.trainer.gather.peft_merge import PeftMerge
from rollout_sidecar.trainer.pack.sender import BucketSender
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.push_opening import Opening
from rollout_sidecar.trainer.push_plan import PushPlan, drained
from rollout_sidecar.trainer.rank_agreement import broadcast
from rollout_sidecar.trainer.sending_ranks import Sent, gather_sent
from rollout_sidecar.trainer.transport.base import Transport
from rollout_sidecar.trainer.transport.peer_sender import PeerSender


class Begun(NamedTuple):
    """Rank 0's begin: what the rest of the push needs."""

    buckets: list[BucketManifest]
    push_ids: list[str]  # each replica's id of this push
    senders: int = 1  # trainer ranks that send this push's buckets
    senders_reason: str | None = None  # why one, where the connection has several
    own_rows: bool = False  # each rank sends its own FSDP2 rows (gather/own_rows.py)
    own_rows_reason: str | None = None  # why not, where several ranks send

    def sending(self) -> tuple[int, str | None]:
        """The ranks that sent bytes of this push, and why fewer than asked:
        with several senders, those given at least one bucket."""
        if self.senders == 1:
            return 1, self.senders_reason
        given = len({b.sender for b in self.buckets})
        return given, None if given == self.senders else \
            f"{len(self.buckets)} bucket(s) for {self.senders} sending ranks"


class PushSends:
    """`WeightPusher`'s sending steps (a base class: they read its parts)."""

    rank: int
    config: PushConfig
    transport: Transport | None
    _sender: BucketSender
    _peer: PeerSender
    _check: Check
    _named: NamedLayout

    def _send_delta(self, delta: DeltaPlan, begun: Begun) -> Sent:
        """Every rank sends its changes of each bucket to rank 0, which
        encodes, packs and sends the patches."""
        with drained(delta.diff.patches(begun.buckets, delta.plans)) as patches:
            if self.rank != 0:
                return Sent()  # `drained` runs every bucket's gather
            assert self.transport is not None
            try:
                return self._sent(begun.buckets, *self._sender.send_all(
                    begun.buckets, patches, self.transport, begun.push_ids,
                    check=self._check), transport=self.transport)
            except Exception as e:
                return Sent(error=("push", f"{type(e).__name__}: {e}"))

    def _sent(self, buckets: list[BucketManifest], checksums: list[int], err: Error | None,
              transport: Transport | PeerSender, sender: int | None = None) -> Sent:
        """What `send_all` returned, by bucket index (with its tags)."""
        ours = [b.index for b in buckets if sender is None or b.source == sender]
        macs = transport.bucket_macs
        return Sent(dict(zip(ours, checksums, strict=False)),
                    dict(zip(ours, macs.tags, strict=False)) if macs is not None else {}, err)

    def _gather_and_send(self, model: nn.Module, begun: Begun, plan: PushPlan,
                         draft: nn.Module | None = None) -> Sent:
        """Every rank gathers every tensor; rank 0 packs and sends them, or,
        with several senders, each rank its share (sending_ranks.py). An
        error is returned, not raised, so every rank keeps taking part in
        every gather; the commit step then agrees on it."""
        if begun is not None and begun.senders > 1:  # (every rank's, agreed at begin)
            return self._every_rank_sends(model, begun, plan, draft)
        # Rank 0's setting for every rank: row blocks are collectives. Half a
        # bucket: rank 0 then holds two send buffers plus at most 0.75 bucket
        # of a gather (a block, or a whole gather of at most a quarter bucket).
        c = self.config
        block_bytes = broadcast(c.bucket_bytes // 2 if c.row_blocks else None)
        lora = LoraAdapter(model) if plan.adapter is not None else None
        # An adapter alone: only its factors are gathered (the same on every rank).
        only = lora.is_factor if lora is not None and plan.encoding == "adapter" else None
        # Buffers are not collectives: only rank 0 reads them.
        buffers = plan.opening.buffers if self.rank == 0 and plan.sends_buffers else ()
        draft_bufs = (plan.opening.draft_buffers or []) if self.rank == 0 else ()
        target = iter_full_tensors(model, c.device, buffers, block_bytes, only)
        with drained(with_draft(target, draft, c.device, draft_bufs, block_bytes)) as gathers:
            if self.rank != 0:
                return Sent()  # `drained` runs every gather
            assert self.transport is not None
            try:
                if lora is not None:
                    tensors = lora.convert(gathers, plan.encoding == "adapter+base")
                else:
                    merge = PeftMerge(model)
                    tensors = converted_target(gathers, lambda ts: CheckpointLayout(
                        merge.base_model).convert(merge.convert(ts)))
                return self._sent(begun.buckets, *self._sender.send_all(
                    begun.buckets, tensors, self.transport, begun.push_ids,
                    check=self._check), transport=self.transport)
            except Exception as e:  # e.g. a layout conversion; agreed on at the commit
                return Sent(error=("push", f"{type(e).__name__}: {e}"))

    def _send_named(self, named: NamedTensors, begun: Begun, opening: Opening) -> Sent:
        """Named tensors (gather/named_tensors.py), in the manifest's order:
        rank 0 sends every bucket, or every rank its share when every rank
        holds every tensor. Every rank draws its stream to the end."""
        assert opening.index is not None
        plan = [s.name for b in begun.buckets for s in b.params if s.first]
        ordered = self._named.ordered(named, plan, opening.index)
        sending = self.rank == 0 or (begun.senders > 1 and named.every_rank)
        sender: Transport | PeerSender | None = self.transport if self.rank == 0 else self._peer
        mine = Sent()
        try:
            if sending:
                assert sender is not None
                mine = self._sent(begun.buckets, *self._sender.send_all(
                    begun.buckets, ordered, sender, begun.push_ids,
                    sender=self.rank if begun.senders > 1 else None, check=self._check),
                    transport=sender, sender=self.rank if begun.senders > 1 else None)
            for _ in ordered:  # the rest: a name past the plan fails here too
                pass
        except Exception as e:  # every rank with the stream meets the same one
            mine = Sent(error=("push", f"{type(e).__name__}: {e}"))
        finally:
            ordered.close()
        if begun.senders > 1:
            return gather_sent(self.rank, mine)
        return mine if self.rank == 0 else Sent()

    def _every_rank_sends(self, model: nn.Module, begun: Begun, plan: PushPlan,
                          draft: nn.Module | None) -> Sent:
        """Every rank packs and sends the buckets its manifest entries name:
        its own rows (`begun.own_rows`: no gather), or from every tensor
        gathered whole on every rank; rank 0 then has every rank's values and
        first error (`gather_sent`). Only a dense push of the model's own
        tensors comes here (push_layout.senders_of): no conversion to run."""
        # Every rank holds the persistent buffers whole (neither FSDP shards
        # them), and, without own rows, gathers every parameter whole: no row
        # blocks, which reach rank 0 alone.
        buffers = plan.opening.buffers if plan.sends_buffers else ()
        sender: Transport | PeerSender | None = self.transport if self.rank == 0 \
            else self._peer
        assert sender is not None
        device = self.config.device
        gathers = iter(()) if begun.own_rows else with_draft(
            iter_full_tensors(model, device, buffers), draft, device,
            plan.opening.draft_buffers or [])
        with drained(gathers) as gathers:
            try:
                mine = self._sent(begun.buckets, *self._sender.send_all(
                    begun.buckets, OwnRows(model, buffers) if begun.own_rows else gathers,
                    sender, begun.push_ids, sender=self.rank, check=self._check),
                    transport=sender, sender=self.rank)
            except Exception as e:
                mine = Sent(error=("push", f"{type(e).__name__}: {e}"))
        return gather_sent(self.rank, mine)
