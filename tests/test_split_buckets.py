"""Tensors larger than a bucket: split by the planner, packed by the sender,
checked by the server's manifest check, reassembled by its staging.

The oracle is always the original tensors (cast to the wire dtype by torch),
never a second copy of our own layout code.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from rollout_sidecar.protocol.schema import BeginRequest
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex, TensorSpec
from rollout_sidecar.server.weights.manifest_check import check_manifest
from rollout_sidecar.server.weights.worker.staging import Staging
from rollout_sidecar.trainer.gather.full_tensors import ParamInfo
from rollout_sidecar.trainer.pack.buckets import ALIGN, manifest, plan_buckets
from rollout_sidecar.trainer.pack.sender import BucketSender

BUCKET = 4096
WIRE = torch.bfloat16


def random_model() -> dict[str, torch.Tensor]:
    """fp32 weights (cast to bf16 on the wire) of odd sizes, one 'embedding'
    ~25 buckets large, one not contiguous, and an int64 buffer (own dtype)."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(397, 131, generator=g),  # 104 KB in bf16
        "small.0": torch.randn(7, generator=g),
        "exact": torch.randn(BUCKET // 2, generator=g),  # one whole bucket, never split
        "mid": torch.randn(33, 65, generator=g),  # 4290 B: just over a bucket
        "transposed": torch.randn(90, 50, generator=g).t(),  # split and not contiguous
        "small.1": torch.randn(3, 3, generator=g),
        "routes": torch.randint(0, 1 << 40, (700,), generator=g),  # 5600 B, int64
        "lm_head": torch.randn(397, 131, generator=g),
    }


def plan_of(model: dict[str, torch.Tensor]) -> list[ParamInfo]:
    return [ParamInfo(n, tuple(t.shape), t.dtype) for n, t in model.items()]


def on_wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(WIRE) if t.is_floating_point() else t


def index_of(model: dict[str, torch.Tensor]) -> CheckpointIndex:
    return CheckpointIndex({n: TensorSpec(tuple(t.shape), str(on_wire(t).dtype)[6:])
                            for n, t in model.items()}, tie_word_embeddings=False)


# ------------------------------------------------------------------ planner


@pytest.mark.parametrize("bucket", [ALIGN, 1000, BUCKET, 50_000])
def test_every_bucket_fits_and_chunks_cover_each_tensor_once(bucket):
    model = random_model()
    buckets = plan_buckets(plan_of(model), WIRE, bucket)
    covered: dict[str, int] = {}
    for b in buckets:
        assert 0 < b.nbytes <= bucket
        end = 0
        for s in b.params:
            assert s.offset >= end and s.offset % ALIGN == 0  # no overlap, aligned start
            end = s.offset + s.length
            assert covered.get(s.name, 0) == (s.chunk_offset or 0)  # in order, no gap
            covered[s.name] = covered.get(s.name, 0) + s.length
        assert end == b.nbytes
    want = {n: on_wire(t).numel() * on_wire(t).element_size() for n, t in model.items()}
    assert covered == want
    # A tensor that fits in a bucket is never split.
    for s in (s for b in buckets for s in b.params):
        assert (s.chunk_offset is None) == (want[s.name] <= bucket), s


def test_without_split_a_big_tensor_gets_a_bucket_of_its_own():
    params = [ParamInfo("small", (10,), torch.float32), ParamInfo("big", (10_000,), torch.float32)]
    buckets = plan_buckets(params, torch.float32, bucket_bytes=1000, split=False)
    assert [[s.name for s in b.params] for b in buckets] == [["small"], ["big"]]
    assert buckets[1].nbytes == 40_000


def test_manifest_keeps_unsplit_entries_as_before():
    buckets = plan_buckets(plan_of(random_model()), WIRE, BUCKET)
    entries = [p for b in manifest(buckets) for p in b["params"]]
    small = next(p for p in entries if p["name"] == "small.0")
    assert small == {"name": "small.0", "dtype": "bfloat16", "shape": [7],
                     "offset": small["offset"]}  # the four keys an unsplit entry always had
    chunks = [p for p in entries if p["name"] == "embed"]
    assert len(chunks) > 20 and all(p["shape"] == [397, 131] for p in chunks)
    assert [p["chunk_offset"] for p in chunks] == [0] + [sum(c["nbytes"] for c in chunks[:i])
                                                        for i in range(1, len(chunks))]


# ------------------------------------------------------------------ manifest check


def begin(buckets: list[dict]) -> BeginRequest:
    return BeginRequest(version=1, buckets=buckets)


def test_manifest_check_accepts_the_planned_chunks():
    model = random_model()
    check_manifest(begin(manifest(plan_buckets(plan_of(model), WIRE, BUCKET))),
                   index_of(model), "bfloat16")


def _chunked_request(edit) -> BeginRequest:
    """`w` (400 bf16 bytes) in 4 chunks of 100 bytes over 2 buckets, then `v`;
    `edit` changes the list of entries of bucket 0 + 1 before it is sent."""
    w = {"name": "w", "dtype": "bfloat16", "shape": [10, 20]}
    entries = [dict(w, offset=0, chunk_offset=0, nbytes=100),
               dict(w, offset=128, chunk_offset=100, nbytes=100),
               dict(w, offset=0, chunk_offset=200, nbytes=100),
               dict(w, offset=128, chunk_offset=300, nbytes=100),
               {"name": "v", "dtype": "bfloat16", "shape": [4], "offset": 256}]
    entries = edit(entries)
    # Bucket 1 ends with v (8 bytes at 256), or with w's last chunk where v is left out.
    return begin([{"index": 0, "nbytes": 228, "params": entries[:2]},
                  {"index": 1, "nbytes": 264 if any(e["name"] == "v" for e in entries[2:])
                   else 228,
                   "params": entries[2:]}])


SPLIT_INDEX = CheckpointIndex({"w": TensorSpec((10, 20), "bfloat16"),
                               "v": TensorSpec((4,), "bfloat16")}, tie_word_embeddings=False)


def _set(i: int, **kw):
    return lambda es: [dict(e, **kw) if j == i else e for j, e in enumerate(es)]


@pytest.mark.parametrize("edit, field, words", [
    (_set(2, chunk_offset=210), "buckets[1].params[0].chunk_offset", "a gap"),
    (_set(2, chunk_offset=190), "buckets[1].params[0].chunk_offset", "an overlap"),
    (_set(0, chunk_offset=100), "buckets[0].params[0].chunk_offset", "a gap"),  # 0..100 never
    (_set(3, nbytes=120), "buckets[1].params[1].nbytes", "does not fit"),  # past the end
    (_set(1, nbytes=0), "buckets[0].params[1].nbytes", "does not fit"),
    (lambda es: es[:3] + es[4:], "buckets", "0..300 of 400"),  # tail lost
    (lambda es: es[:4], "buckets", "missing v"),  # w complete, v never sent
    (_set(1, nbytes=None), "buckets[0].params[1].chunk_offset", "both"),
    (lambda es: [*es[:3], dict(es[0], offset=128), es[4]], "buckets[1].params[1].chunk_offset",
     "an overlap"),  # a second copy of w's first chunk
    (lambda es: [*es[:3], dict(es[4], offset=128), es[4]],
     "buckets[1].params[2].name", "sent twice"),  # v whole, twice
])
def test_manifest_check_refuses_chunks_that_do_not_tile_the_tensor(edit, field, words):
    with pytest.raises(BadRequest) as e:
        check_manifest(_chunked_request(edit), SPLIT_INDEX, "bfloat16")
    assert e.value.field == field
    assert words in str(e.value)
    assert e.value.field == "buckets" or str(e.value).startswith(("w:", "parameter '"))


def test_manifest_check_refuses_a_tensor_whose_last_chunks_never_come():
    req = begin([{"index": 0, "nbytes": 100, "params": [
        {"name": "v", "dtype": "bfloat16", "shape": [4], "offset": 0},
        {"name": "w", "dtype": "bfloat16", "shape": [10, 20], "offset": 64, "chunk_offset": 0,
         "nbytes": 36}]}])
    with pytest.raises(BadRequest) as e:
        check_manifest(req, SPLIT_INDEX, "bfloat16")
    assert e.value.field == "buckets" and "w: chunks cover only bytes 0..36 of 400" in str(e.value)


def test_manifest_check_accepts_the_example_as_is():
    check_manifest(_chunked_request(lambda es: es), SPLIT_INDEX, "bfloat16")


def test_manifest_check_accepts_chunks_in_any_order_between_other_tensors():
    """Each trainer rank's own rows (trainer/gather/own_rows.py): one tensor's
    chunks interleave with another tensor, last chunk first."""
    w = {"name": "w", "dtype": "bfloat16", "shape": [10, 20]}
    check_manifest(begin([
        {"index": 0, "nbytes": 228, "params": [dict(w, offset=0, chunk_offset=300, nbytes=100),
                                                dict(w, offset=128, chunk_offset=100, nbytes=100)]},
        {"index": 1, "nbytes": 8, "params": [{"name": "v", "dtype": "bfloat16", "shape": [4],
                                              "offset": 0}]},
        {"index": 2, "nbytes": 228, "params": [dict(w, offset=0, chunk_offset=0, nbytes=100),
                                                dict(w, offset=128, chunk_offset=200,
                                                     nbytes=100)]}]),
        SPLIT_INDEX, "bfloat16")


# ------------------------------------------------------------------ round trip


class LoopbackTransport:
    """Keeps a copy of every bucket as sent (the send buffers are reused)."""

    buffer_device = torch.device("cpu")
    checksum_in_request = False
    bucket_macs = None
    slot_pieces = False

    def __init__(self) -> None:
        self.sent: dict[int, bytes] = {}

    def send(self, index: int, buf: torch.Tensor, push_ids: list[str], checksum: int | None,
             pieces: object = None) -> None:
        self.sent[index] = bytes(buf.numpy())


class Drawn:
    """The gathers, counting how often each tensor is drawn."""

    def __init__(self, model: dict[str, torch.Tensor]) -> None:
        self.model, self.draws = model, []

    def __iter__(self):
        for n, t in self.model.items():
            self.draws.append(n)
            yield n, t


def push_and_stage(model: dict[str, torch.Tensor], bucket: int
                   ) -> tuple[Staging, list, BucketSender, dict[int, bytes]]:
    """Pushed by the trainer's sender, staged by the server's staging: and
    the bytes each bucket carried."""
    buckets = plan_buckets(plan_of(model), WIRE, bucket)
    req = begin(manifest(buckets))
    check_manifest(req, index_of(model), "bfloat16")
    sender, wire, drawn = BucketSender(), LoopbackTransport(), Drawn(model)
    checksums, err = sender.send_all(buckets, iter(drawn), wire, ["push"])
    assert err is None
    assert drawn.draws == list(model)  # each tensor drawn once, split or not
    staging = Staging()
    staging.allocate(req.buckets, torch.device("cpu"))  # as the server
    for k, b in enumerate(staging.buckets):
        staging.stage(k, torch.frombuffer(bytearray(wire.sent[b.index]), dtype=torch.uint8),
                      "crc32")
    staging.check(checksums)
    assert checksums == [zlib.crc32(wire.sent[i]) for i in range(len(buckets))]
    return staging, buckets, sender, wire.sent


@pytest.mark.parametrize("bucket", [ALIGN, 1000, BUCKET, 1 << 20])
def test_round_trip_is_bit_identical(bucket):
    model = random_model()
    staging, buckets, sender, _ = push_and_stage(model, bucket)
    got = list(staging.tensors())
    assert [n for n, _ in got] == list(model)
    for name, t in got:
        want = on_wire(model[name])
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t.view(torch.uint8) if t.dtype == WIRE else t,
                           want.contiguous().view(torch.uint8) if t.dtype == WIRE else want), name
    # Rank 0's two send buffers: 2 x bucket, not 2 x the embedding.
    assert all(b.numel() == max(b.nbytes for b in buckets) <= bucket for b in sender._buffers)


def test_every_tensor_is_a_view_of_the_staged_copy_and_the_load_copies_nothing():
    staging, _, _, sent = push_and_stage(random_model(), BUCKET)
    kept = [b for b in staging.buckets if not b.scattered]
    ranges = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in kept]
    # A bucket holding a chunk is not kept: its slots went to their places on arrival.
    assert all(b.buffer.numel() == 0 for b in staging.buckets if b.scattered)
    assert all(b.scattered == any(p.chunk_offset is not None for p in b.params)
               for b in staging.buckets)
    assert "exact" in {p.name for b in kept for p in b.params}  # one whole bucket: kept
    first = dict(staging.tensors())
    for name, t in staging.tensors():
        assert t.data_ptr() == first[name].data_ptr(), name  # the same memory at every load
        inside = any(lo <= t.data_ptr() < hi for lo, hi in ranges)
        place = staging.places.buffers.get(name)
        assert inside == (place is None), name
        if place is not None:
            assert t.data_ptr() == place.data_ptr() and t.untyped_storage().nbytes() == \
                place.numel(), name
    # What a peer reads of any bucket is the trainer's bytes (alignment aside).
    for k, b in enumerate(staging.buckets):
        for p in b.params:
            got = staging.bucket_bytes(k)[p.offset: p.offset + p.length]
            assert bytes(got.numpy()) == sent[b.index][p.offset: p.offset + p.length], p.name


def test_nan_in_a_later_chunk_is_refused_and_every_tensor_still_drawn():
    model = random_model()
    model["embed"][-1, -1] = float("nan")  # in the embedding's last chunk
    buckets = plan_buckets(plan_of(model), WIRE, BUCKET)
    drawn = Drawn(model)
    _, err = BucketSender().send_all(buckets, iter(drawn), LoopbackTransport(), ["push"])
    assert err is not None and err[0] == "nonfinite" and "embed" in err[1]
    assert drawn.draws == list(model)


def test_the_wire_counts_every_torch_dtype_as_torch_does():
    """The schema sizes slots without torch (the client imports it): its
    itemsize, read off the dtype's name, is torch's for every dtype."""
    from rollout_sidecar.protocol.data_plane.wire_format import dtype_name
    from rollout_sidecar.protocol.precisions import dtype_itemsize

    dtypes = {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    assert len(dtypes) > 20
    for d in dtypes:
        assert dtype_itemsize(dtype_name(d)) == d.itemsize, d
    with pytest.raises(ValueError, match="unknown dtype 'floaty'"):
        dtype_itemsize("floaty")
