"""Chunks land in place (server/weights/worker/placed_tensors.py): a push of
own rows, laid out by the trainer's own planner (two ranks' rows of every
tensor, interleaved), received by the worker's own receive (`receive_chain`,
`receive_broadcast`) over a real gloo group of threads, lands every chunk in
its tensor's place as its bucket arrives. The oracle is the tensors
themselves: every staged tensor equals its source bit for bit, is a view
(the load copies nothing), and the buckets' check values and tags are the
ones computed over the bytes the senders sent. Receive buffers stay within
the relay's window, whatever the model's size."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

from rollout_sidecar.protocol.data_plane.bucket_check import bucket_check
from rollout_sidecar.protocol.data_plane.bucket_group import send_bucket
from rollout_sidecar.protocol.data_plane.bucket_mac import bucket_mac
from rollout_sidecar.protocol.data_plane.bucket_pieces import spans
from rollout_sidecar.protocol.data_plane.ring_route import entry
from rollout_sidecar.protocol.data_plane.wire_format import slot_bytes
from rollout_sidecar.protocol.schema import BucketManifest, TensorSlot
from rollout_sidecar.server.weights.worker.bucket_receive import receive_broadcast, receive_chain
from rollout_sidecar.server.weights.worker.host_share import SharedBuffers
from rollout_sidecar.server.weights.worker.placed_tensors import ReceiveBuffers
from rollout_sidecar.server.weights.worker.staging import Staging
from rollout_sidecar.trainer.gather.own_rows import Piece
from rollout_sidecar.trainer.pack.buckets import plan_buckets
from rollout_sidecar.trainer.pack.rank_buckets import plan_rank_buckets
from tests.gloo_threads import run_ranks
from tests.test_chain_steps_units import _WithSlots
from tests.test_split_buckets import plan_of

pytestmark = pytest.mark.timeout(120)

WIRE = torch.float32
KEY = b"k" * 32
CPU = torch.device("cpu")


def model() -> dict[str, torch.Tensor]:
    """Odd shapes: rows that do not divide by two, a 1-D vector, a tensor of one row."""
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(301, 67, generator=g), "norm": torch.randn(67, generator=g),
            "w": torch.randn(97, 67, generator=g), "bias": torch.randn(1, 5, generator=g),
            "head": torch.randn(301, 67, generator=g)}


def own_rows(m: dict[str, torch.Tensor], ranks: int, bucket: int) -> list[BucketManifest]:
    """Each rank's rows of every tensor (torch.chunk's split, as FSDP2's)."""
    pieces: list[list[Piece]] = [[] for _ in range(ranks)]
    for name, t in m.items():
        c = -(-t.shape[0] // ranks)
        for r in range(ranks):
            first, end = min(r * c, t.shape[0]), min((r + 1) * c, t.shape[0])
            if end > first:
                pieces[r].append(Piece(name, tuple(t.shape), t.dtype, first, end))
    return plan_rank_buckets(pieces, WIRE, bucket)


def packed(m: dict[str, torch.Tensor], b: BucketManifest) -> torch.Tensor:
    """A bucket's bytes as a sender packs them: each slot, the tensor's bytes
    from its chunk offset (garbage between slots, as a reused send buffer)."""
    out = torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8)
    for p in b.params:
        flat = m[p.name].to(WIRE).contiguous().view(-1).view(torch.uint8)
        start = p.chunk_offset or 0
        slot_bytes(out, p).copy_(flat[start: start + p.length])
    return out


def assert_staged(staging: Staging, m: dict[str, torch.Tensor], sent: list[torch.Tensor]
                  ) -> None:
    staging.check([zlib.crc32(s.numpy()) for s in sent])
    staging.check_macs([bucket_mac(KEY, s, "c", 1, b.index) for s, b in
                        zip(sent, staging.buckets, strict=True)], KEY, "c", 1)
    got = dict(staging.tensors())
    assert sorted(got) == sorted(m)
    for name, t in m.items():
        assert torch.equal(got[name], t.to(WIRE)), name
        assert got[name].data_ptr() == dict(staging.tensors())[name].data_ptr()  # a view


@pytest.mark.parametrize("replicas, relay", [(1, "gloo"), (2, "gloo"), (2, "fused-steps"),
                                             (1, "gloo-slot-pieces"), (2, "gloo-slot-pieces"),
                                             (2, "gloo-slot-pieces-ring")])
def test_own_rows_of_two_senders_land_in_place_through_the_chain(replicas: int, relay: str
                                                                  ) -> None:
    """`fused-steps`: NCCL's relay (chain_steps.py), its host staging landing
    through slots, run over gloo as tests/test_chain_steps_units.py does.
    `gloo-slot-pieces`: every bucket cut slot by slot (bucket_pieces.py) on
    the senders' side, as the trainer sends it, and each piece received
    straight into its place: no receive buffer at all; `-ring`: each bucket
    enters at a replica of its own and goes round (ring_route.py), so both
    replicas forward pieces out of their places."""
    m = model()
    manifest = own_rows(m, 2, bucket=4096)
    assert {b.source for b in manifest} == {0, 1}
    assert all(any(p.chunk_offset is not None for p in b.params) for b in manifest)
    assert any(len(b.params) > 1 for b in manifest)  # slots side by side in a bucket
    sent = [packed(m, b) for b in manifest]
    senders, world = 2, 2 + replicas
    slot_pieces = relay.startswith("gloo-slot-pieces")
    starts = [2, 3] if relay.endswith("ring") else None  # one worker a replica
    stagings: dict[int, Staging] = {}

    def body(rank: int, group: Any) -> None:
        if rank < senders:
            works = [send_bucket(group, s, "chain", first_receiver=entry(b.index, senders, starts),
                                 pieces=spans(b.nbytes, b.params) if slot_pieces else None)
                     for s, b in zip(sent, manifest, strict=True) if b.source == rank]
            for w in works:
                w.wait()
            return
        st = stagings[rank] = Staging()
        st.allocate(manifest, CPU)
        if relay.startswith("gloo"):
            receive_chain(group, st, rank, world, KEY, senders, "crc32", "gloo", CPU,
                          ring_starts=starts, slot_pieces=slot_pieces)
        else:
            receive_chain(_WithSlots(group), st, rank, world, KEY, senders, "crc32", "nccl")

    run_ranks(world, f"placed-{replicas}-{relay}", body)
    for rank, st in stagings.items():
        assert_staged(st, m, sent)
        # Every bucket held a chunk, so none is kept; their buffers were lent
        # and returned, never more than the relay's window (senders) + 2 at once.
        assert all(b.scattered and b.buffer.numel() == 0 for b in st.buckets)
        assert st.lent.out == 0 and int(not slot_pieces) <= st.lent.most <= 2 * senders
        if relay == "gloo" and rank == world - 1:  # the chain's last: nothing to forward
            assert st.lent.most == senders, st.lent.most  # window, not window + 1
        if slot_pieces:  # every piece went straight to its place (or a gap's bytes)
            assert st.lent.most == 0 and st.lent.held_bytes == 0, st.lent.most
        model_bytes = sum(t.numel() * 4 for t in m.values())
        assert st.places.held_bytes == model_bytes
        assert st.lent.held_bytes <= (senders + 2) * max(b.nbytes for b in manifest)


def test_a_broadcast_lands_split_tensors_in_place_and_keeps_whole_buckets() -> None:
    m = {"exact": torch.randn(8192), **model()}  # fills a bucket: kept as it came
    manifest = plan_buckets(plan_of(m), WIRE, 32 * 1024)  # embed and head split
    assert any(not any(p.chunk_offset is not None for p in b.params) for b in manifest)
    sent = [packed(m, b) for b in manifest]
    got: dict[str, Staging] = {}

    def body(rank: int, group: Any) -> None:
        if rank == 0:
            for s in sent:
                group.broadcast(s).wait()
            return
        st = got["st"] = Staging()
        st.allocate(manifest, CPU)
        receive_broadcast(group, st, "gloo", CPU, KEY, "crc32")

    run_ranks(2, "placed-bcast", body)
    st = got["st"]
    assert_staged(st, m, sent)
    whole = [b for b in st.buckets if not b.scattered]
    assert whole and all(b.buffer.numel() == b.nbytes for b in whole)  # kept as they came
    assert st.lent.out == 0 and st.lent.most <= 2


def test_a_peer_reads_back_the_trainers_bytes_and_a_bad_bucket_is_named() -> None:
    m = model()
    manifest = own_rows(m, 2, bucket=4096)
    sent = [packed(m, b) for b in manifest]
    st = Staging()
    st.allocate(manifest, CPU)
    for k, s in enumerate(sent):
        st.stage(k, s.clone(), "crc32")
    for k, (s, b) in enumerate(zip(sent, manifest, strict=True)):
        back = st.bucket_bytes(k)
        for p in b.params:  # the slots' bytes; what lay between them is not kept
            assert torch.equal(slot_bytes(back, p), slot_bytes(s, p)), (k, p.name)
    wrong = [zlib.crc32(s.numpy()) for s in sent]
    wrong[3] ^= 1
    with pytest.raises(ValueError, match="bucket 3 checksum mismatch"):
        st.check(wrong)


def test_followers_read_the_leaders_places_and_a_new_layout_frees_the_old(tmp_path) -> None:
    m = model()
    manifest = own_rows(m, 2, bucket=4096)
    sent = [packed(m, b) for b in manifest]
    leader, follower = Staging(), Staging()
    leader.share(lambda kind: SharedBuffers(tmp_path, kind, leader=True), "staging")
    follower.share(lambda kind: SharedBuffers(tmp_path, kind, leader=False), "staging")
    leader.allocate(manifest, CPU)
    follower.allocate(manifest, CPU)
    for k, s in enumerate(sent):
        leader.stage(k, s, "crc32")
    follower.attach()
    try:
        for name, t in follower.tensors():
            assert torch.equal(t, m[name].to(WIRE)), name
    finally:
        follower.detach()
    assert follower.held_bytes == 0 and leader.held_bytes == sum(t.numel() * 4
                                                                 for t in m.values())
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {f"staging-places-{i}" for i in range(len(m))}, files
    # A gathered layout with no chunk: the places go, the buckets are files instead.
    whole = plan_buckets(plan_of(m), WIRE, 1 << 20)
    leader.allocate(whole, CPU)
    assert {p.name for p in tmp_path.iterdir()} == {f"staging-{b.index}" for b in whole}


def test_a_stale_receive_writes_nothing_the_next_push_reads() -> None:
    """A receive still blocked on a dead trainer when its push is discarded
    (transfer_engine.discard: `drop_pool`) may land a bucket later: into its
    own push's places and buffers, never the next push's."""
    m = model()
    manifest = own_rows(m, 2, bucket=4096)
    sent = [packed(m, b) for b in manifest]
    st = Staging()
    st.allocate(manifest, CPU)
    stale = st.receipt()  # what the blocked receive holds
    st.drop_pool()
    st.allocate(manifest, CPU)  # the next push, the same layout
    for k, s in enumerate(sent):
        st.stage(k, s, "crc32")
    junk = stale.buffer(0)
    junk.fill_(0xAB)
    stale.arrived(0, junk, 1, None)  # the stale bucket lands
    stale.give_back(0, junk)
    assert st.lent.out == 0 and st.lent.free == []
    st.check([zlib.crc32(s.numpy()) for s in sent])
    for name, t in st.tensors():
        assert torch.equal(t, m[name].to(WIRE)), name


def test_idle_receive_buffers_give_their_pages_back_and_serve_the_next_push() -> None:
    """Before a load the receive buffers' pages go back to the kernel (the
    load's peak is then a gathered push's): they read as zeros afterwards,
    the resident set falls by about their size, and they are lent again."""
    import psutil

    lent = ReceiveBuffers()
    lent.reset(16 << 20, torch.device("cpu"))
    bufs = [lent.lend(16 << 20) for _ in range(2)]
    for b in bufs:
        b.fill_(7)
        lent.give_back(b)
    rss = psutil.Process().memory_info().rss
    lent.idle()
    fell = rss - psutil.Process().memory_info().rss
    assert fell > 30 << 20, fell  # 32 MiB, less a page at each end at most
    again = lent.lend(16 << 20)
    page = 4096
    assert int(again[page: -page].count_nonzero()) == 0  # fresh pages: zeros
    again.fill_(3)
    assert int((again == 3).sum()) == again.numel()
    assert lent.most == 2 and lent.held_bytes == 16 << 20


def test_slot_pieces_cut_each_slot_and_gap_and_refuse_overlaps() -> None:
    """The cut both ends make from the manifest alone: a piece per slot (a
    long one in pieces of at most `most`), a piece per gap, in byte order."""
    chunk = TensorSlot(name="a", dtype="float32", shape=[10], offset=8, chunk_offset=0,
                       nbytes=24)
    whole = TensorSlot(name="b", dtype="float32", shape=[10], offset=40)
    assert spans(100, [whole, chunk], most=16) == [
        (0, 8), (8, 24), (24, 32), (32, 40), (40, 56), (56, 72), (72, 80), (80, 100)]
    assert spans(64, [chunk.model_copy(update={"offset": 0}), whole.model_copy(
        update={"offset": 24})]) == [(0, 24), (24, 64)]
    with pytest.raises(ValueError, match="overlaps"):
        spans(100, [chunk, whole.model_copy(update={"offset": 28})])
    with pytest.raises(ValueError, match="leaves the bucket"):
        spans(60, [whole])


@pytest.mark.parametrize("check", ["crc32", "sum64"])
def test_slot_pieces_with_gaps_land_in_place_and_check_the_bytes_sent(check: str) -> None:
    """Gaps between slots (garbage from a reused send buffer) are received and
    counted in the check, never kept; each slot lands straight in its place.
    sum64 has no running form, so its buckets land through a lent buffer,
    cut the same way."""
    g = torch.Generator().manual_seed(5)
    m = {"a": torch.randn(10, generator=g), "b": torch.randn(10, generator=g)}
    manifest = [
        BucketManifest(index=0, nbytes=100, sender=0, params=[
            TensorSlot(name="a", dtype="float32", shape=[10], offset=8, chunk_offset=0,
                       nbytes=24),
            TensorSlot(name="b", dtype="float32", shape=[10], offset=40)]),
        BucketManifest(index=1, nbytes=24, sender=0, params=[
            TensorSlot(name="a", dtype="float32", shape=[10], offset=4, chunk_offset=24,
                       nbytes=16)])]
    sent = [packed(m, b) for b in manifest]
    got: dict[str, Staging] = {}

    def body(rank: int, group: Any) -> None:
        if rank == 0:
            for s, b in zip(sent, manifest, strict=True):
                send_bucket(group, s, "chain", 1, spans(b.nbytes, b.params)).wait()
            return
        st = got["st"] = Staging()
        st.allocate(manifest, CPU)
        receive_chain(group, st, rank, 2, KEY, 1, check, "gloo", CPU, slot_pieces=True)

    run_ranks(2, f"slot-pieces-{check}", body)
    st = got["st"]
    checks = bucket_check(check)
    st.check([checks.compute(s) for s in sent], check)
    staged = dict(st.tensors())
    assert all(torch.equal(staged[n], t) for n, t in m.items())
    assert st.lent.most == (0 if check == "crc32" else 1)
