"""Every trainer rank sends its share of a dense push (issue 44): which ranks
send, how they all connect, and how rank 0 learns what each one sent.

Why: every rank holds its own FSDP2 rows, which it sends as they are
(gather/own_rows.py), or each gathered tensor (FSDP2's `full_tensor()`,
FSDP1's `summon_full_params`), so the bytes need not all leave through rank
0's link. With N senders each bucket leaves from one rank (its rows' rank,
or shared out by bytes: pack/bucket_senders.py), so each trainer link
carries about 1/N of the push.

Connecting (`connect_every_rank`): rank 0 draws the rendezvous (its
`_open`), every rank gets it with the opening, and ranks 1 .. N-1 join the
group while rank 0 connects every replica; then the ranks agree on the
outcome, naming each rank that failed. A tampered rendezvous is drawn again
under a fresh id and secret, `CONNECT_TRIES` times, as with one sender.

Sending (`gather_sent`): each rank checks and tags its own buckets while they
are on the wire, then rank 0 gathers every rank's values and first error over
the trainer's process group, so the prepare carries all of them; an error on
any rank fails the push on every rank, by the rank's name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_sidecar.protocol.data_plane.signed_store import TAMPERED
from rollout_sidecar.protocol.schema import SENDERS, SENDERS_NCCL
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.trainer.errors import Error, WeightPushError
from rollout_sidecar.trainer.rank_agreement import agree, all_ranks
from rollout_sidecar.trainer.transport.distributed import (
    CONNECT_TRIES,
    DistributedTransport,
    tampered_every_try,
)
from rollout_sidecar.trainer.transport.peer_sender import PeerSender, Rendezvous

log = logging.getLogger(__name__)


def choose_senders(setting: str, transport_name: str, world: int, statuses: list[Any]
                   ) -> tuple[int, str | None]:
    """How many ranks send this connection's pushes, and why one if one."""
    if setting == "one":
        return 1, "senders='one'"
    if world == 1:
        return 1, "one trainer rank"
    if not transport(transport_name).chains:  # http
        return 1, (f"transport {transport_name}: several senders go point to point down a "
                   "chain of the data-plane group, which gloo and nccl form")
    need = SENDERS_NCCL if transport(transport_name).on_device else SENDERS
    old = [i for i, s in enumerate(statuses) if need not in s.capabilities]
    if old:
        return 1, (f"replica {old[0]} predates every-rank sending over {transport_name} (no "
                   f"'{need}' in its capabilities): rank 0 sends every bucket")
    return world, None


@dataclass
class Sent:
    """One rank's share of a push: its buckets' check values and tags, by
    bucket index, and its first error."""

    checksums: dict[int, int] = field(default_factory=dict)
    tags: dict[int, str] = field(default_factory=dict)
    error: Error | None = None


def connect_every_rank(rank: int, rendezvous: Rendezvous | None, senders: int,
                       transport_: DistributedTransport | None, peer: PeerSender,
                       redraw: Callable[[], Rendezvous | None]) -> None:
    """Every rank: join `rendezvous` (rank 0 connects the replicas too), or,
    with none, keep the group as it is; a rank that no longer sends drops its
    old one. Raises the same `WeightPushError` on every rank."""
    for attempt in range(1, CONNECT_TRIES + 1):
        if rendezvous is None:
            if rank >= senders:
                peer.reset()
            return
        error = None
        try:
            if rank == 0:
                assert transport_ is not None
                transport_.connect(rendezvous)
            elif rank < rendezvous.senders:
                peer.join(rendezvous, rank)
            else:
                peer.reset()
        except Exception as e:
            error = f"{type(e).__name__}: {e}" if not isinstance(e, WeightPushError) else str(e)
        errors = all_ranks(error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if rank != 0:
            peer.reset()
        text = "; ".join(f"trainer rank {r}: {e}" for r, e in failed)
        tampered = any(TAMPERED in e for _, e in failed)
        if not tampered or attempt == CONNECT_TRIES:
            err = WeightPushError(f"data plane: connecting {rendezvous.senders} senders failed: "
                                  f"{text}")
            raise tampered_every_try(err) if tampered else err
        log.warning("data-plane connect %d of %d: %s", attempt, CONNECT_TRIES, text)
        rendezvous = agree(redraw if rank == 0 else lambda: None)


def gather_sent(rank: int, mine: Sent) -> Sent:
    """Rank 0: every rank's `Sent` merged: check values and tags by index,
    and every rank's error, each named (the first kind leads: a rank that
    could not send shows up on the others as a stalled or closed transfer);
    the others: their own."""
    shares = all_ranks(mine)
    if rank != 0:
        return mine
    merged = Sent()
    errors = []
    for r, share in enumerate(shares):
        merged.checksums.update(share.checksums)
        merged.tags.update(share.tags)
        if share.error is not None:
            errors.append((r, share.error))
    if errors:
        kind = errors[0][1][0]
        merged.error = (kind, "; ".join(f"trainer rank {r}: {message}"
                                        for r, (_, message) in errors))
    return merged
