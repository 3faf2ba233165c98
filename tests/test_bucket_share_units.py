"""Unit tests of how a dense push with several senders shares its bytes out
(trainer/push_layout.py, pack/bucket_senders.py): by buckets small enough
that every rank's link carries about its share, however small the model is
against the bucket size. Issue 58 measured the default (256 MiB buckets) on
a 101 MB model: one bucket, all of it out of rank 0's link, while
`PushResult.senders` said two. A plain module and a status stand in for the
servers: what is tested is the layout rank 0 sends in `begin`; the bytes on
real links are bench/push_links.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollout_sidecar.protocol.schema import TensorInfo, WeightIndex, WeightStatus
from rollout_sidecar.trainer.control.serving_state import ServingState
from rollout_sidecar.trainer.gather.named_tensors import NamedLayout
from rollout_sidecar.trainer.pack.bucket_senders import PER_SENDER
from rollout_sidecar.trainer.push_config import PushConfig
from rollout_sidecar.trainer.push_layout import lay_out
from rollout_sidecar.trainer.push_opening import Opening
from rollout_sidecar.trainer.push_plan import PushPlan
from rollout_sidecar.trainer.push_sends import Begun


def model() -> nn.Module:
    torch.manual_seed(0)
    # 42 MB in fp32: 1/6 of one default bucket, large enough that 4 senders' shared
    # buckets stay above the smallest one (MIN_BUCKET).
    return nn.Sequential(nn.Embedding(8192, 512), nn.Linear(512, 2048), nn.Linear(2048, 512),
                         nn.Linear(512, 8192, bias=False))


def serving(m: nn.Module) -> ServingState:
    s = ServingState()
    s.statuses = [WeightStatus(weight_version=0, dtype="float32", vocab_size=8192,
                               max_model_len=64, boot_id="b", push_state="idle",
                               push_in_progress=False, connected=None, data_plane_port=1,
                               transports=["gloo"], push_timeout_s=1, commit_drain_s=1)]
    s.index = WeightIndex(tensors={n: TensorInfo(shape=list(t.shape), dtype="float32")
                                   for n, t in m.state_dict().items()},
                          ignored=[], tie_word_embeddings=False)
    return s


def layout(m: nn.Module, senders: int, bucket_mb: float):
    opening = Opening(restarted=False, serve_dtype="float32", wire_dtypes={}, buffers=[],
                      delta_base=None, why_dense=None, senders=senders)
    plan = PushPlan(opening, None, None, why_gathered="own_rows=False")
    return lay_out(m, plan, None, serving(m), PushConfig(bucket_mb=bucket_mb), NamedLayout())


@pytest.mark.parametrize("senders", [2, 4])
def test_a_model_smaller_than_a_bucket_is_shared_out_over_every_sender(senders):
    m = model()
    total = sum(t.numel() * 4 for t in m.state_dict().values())  # fp32 on the wire
    lay = layout(m, senders, bucket_mb=256)  # the default
    assert lay.senders == senders and lay.senders_reason is None
    assert Begun(lay.buckets, ["p"], lay.senders).sending() == (senders, None)
    assert sum(b.nbytes for b in lay.buckets) == total  # every byte once
    loads = [sum(b.nbytes for b in lay.buckets if b.sender == r) for r in range(senders)]
    assert max(loads) <= total / senders * (1 + 1 / PER_SENDER) + 4096, loads
    assert min(loads) > 0


def test_a_large_model_keeps_the_configured_bucket_size():
    m = model()
    total = sum(t.numel() * 4 for t in m.state_dict().values())
    bucket = total / (2 * PER_SENDER) / 2**20 / 2  # already small enough to share
    lay = layout(m, 2, bucket_mb=bucket)
    assert max(b.nbytes for b in lay.buckets) <= bucket * 2**20


def test_a_model_below_the_smallest_shared_bucket_says_why_fewer_ranks_sent():
    """`PushResult.senders` counts the ranks that sent bytes, not the connection's."""
    tiny = nn.Sequential(nn.Linear(64, 64))
    lay = layout(tiny, 2, bucket_mb=256)
    begun = Begun(lay.buckets, ["p"], lay.senders, lay.senders_reason)
    assert begun.sending() == (1, "1 bucket(s) for 2 sending ranks")
    m = model()
    lay = layout(m, 2, bucket_mb=256)
    assert Begun(lay.buckets, ["p"], lay.senders, lay.senders_reason).sending() == (2, None)


def test_one_sender_keeps_one_bucket():
    lay = layout(model(), 1, bucket_mb=256)
    assert lay.senders == 1 and len(lay.buckets) == 1


@pytest.mark.parametrize("senders", [2, 4])
def test_own_rows_are_cut_into_several_buckets_a_rank(senders):
    """Each rank sends its own rows whatever the bucket size, but a chain over
    several replicas relays in manifest order: one bucket a rank made the
    ring's relays take turns (bench/push_scaling.py), several let them run
    side by side."""
    from rollout_sidecar.protocol.schema import CAPABILITIES

    m = model()
    total = sum(t.numel() * 4 for t in m.state_dict().values())
    s = serving(m)
    s.statuses = [st.model_copy(update={"capabilities": list(CAPABILITIES)}) for st in s.statuses]
    opening = Opening(restarted=False, serve_dtype="float32", wire_dtypes={}, buffers=[],
                      delta_base=None, why_dense=None, senders=senders)
    lay = lay_out(m, PushPlan(opening, None, None, why_gathered=None), None, s,
                  PushConfig(bucket_mb=256), NamedLayout())
    assert lay.own_rows and sum(b.nbytes for b in lay.buckets) == total
    per_rank = [[b for b in lay.buckets if b.sender == r] for r in range(senders)]
    assert all(len(mine) >= 2 for mine in per_rank), [len(mine) for mine in per_rank]
    assert max(b.nbytes for b in lay.buckets) <= total / (senders * PER_SENDER) + 4096
