"""A push from named tensors, the trainer's side without a server: the layout
planned from the served index, the stream put in the manifest's order, and
every way a stream can be wrong refused by name. The served proof is
tests/integrations/test_verl.py (FSDP2 ranks through verl's checkpoint
engine) and tests/e2e/test_push_tensors.py."""

from __future__ import annotations

import pytest
import torch

from rollout_sidecar.protocol.schema import WeightIndex
from rollout_sidecar.trainer.gather.named_tensors import (
    NamedLayout,
    NamedTensors,
    first_push_order,
)

NAMES = ["model.embed_tokens.weight"] + [
    f"model.layers.{i}.{p}.weight" for i in range(12)
    for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "input_layernorm")
] + ["model.norm.weight", "lm_head.weight"]


def index(names: list[str] = NAMES, tied: bool = False, draft: tuple[str, ...] = ()
          ) -> WeightIndex:
    return WeightIndex(tensors={n: {"shape": [2, 3], "dtype": "float32"} for n in names},
                       ignored=["model.rotary_emb.inv_freq"], tie_word_embeddings=tied,
                       draft=list(draft))


def stream(names: list[str]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.full((2, 3), float(i))) for i, n in enumerate(names)]


def test_the_first_push_guesses_module_order_from_names():
    shuffled = sorted(NAMES)  # a safetensors file's order: lm_head first, layer 10 before 2
    order = first_push_order(shuffled)
    assert order[0] == "model.embed_tokens.weight" and order[-1] == "lm_head.weight"
    layers = [int(n.split(".")[2]) for n in order if ".layers." in n]
    assert layers == sorted(layers)


def test_in_module_order_the_first_push_holds_at_most_a_layer_then_nothing():
    layout = NamedLayout()
    plan = [p.name for p in layout.plan(index())]
    got = list(layout.ordered(NamedTensors(stream(NAMES)), plan, index()))
    assert [n for n, _ in got] == plan and sorted(plan) == sorted(NAMES)
    by_name = dict(stream(NAMES))
    assert all(torch.equal(t, by_name[n]) for n, t in got)
    assert 0 < layout.held_bytes <= 3 * 24  # within one layer's four tensors
    # The order is learned: the next push plans the stream's own and holds nothing.
    plan = [p.name for p in layout.plan(index())]
    assert plan == NAMES
    assert [n for n, _ in layout.ordered(NamedTensors(stream(NAMES)), plan, index())] == NAMES
    assert layout.held_bytes == 0


def test_any_order_is_pushed_whole():
    backwards = NAMES[::-1]
    layout = NamedLayout()
    plan = [p.name for p in layout.plan(index())]
    got = dict(layout.ordered(NamedTensors(stream(backwards)), plan, index()))
    assert set(got) == set(NAMES) and layout.held_bytes > 0


def test_wrapper_names_ignored_tensors_a_tied_head_and_the_drafter():
    names = [n for n in NAMES if n != "lm_head.weight"]
    idx = index(names + ["draft.model.norm.weight"], tied=True,
                draft=("draft.model.norm.weight",))
    layout = NamedLayout()
    plan = [p.name for p in layout.plan(idx)]
    assert "draft.model.norm.weight" not in plan  # a stream is the policy's: drafter frozen
    wrapped = [("_fsdp_wrapped_module." + n, t) for n, t in stream(names)]
    extra = [("model.rotary_emb.inv_freq", torch.ones(4)), ("lm_head.weight", torch.ones(2, 3))]
    got = list(layout.ordered(NamedTensors(wrapped + extra), plan, idx))
    assert [n for n, _ in got] == plan


@pytest.mark.parametrize("case, message", [
    ("unknown", "'model.extra.weight' is not a tensor of the served model"),
    ("shape", "model.norm.weight has shape [3, 2]; the served model's is [2, 3]"),
    ("missing", "the tensors ended without 1 the served checkpoint has: ['model.norm.weight']"),
    ("twice", "'model.layers.0.mlp.down_proj.weight' came twice"),
    ("meta", "model.norm.weight is on the meta device"),
])
def test_a_wrong_stream_fails_by_name_and_is_drawn_to_its_end(case, message):
    items = stream(NAMES)
    at = NAMES.index("model.norm.weight")
    if case == "unknown":
        items.insert(at, ("model.extra.weight", torch.zeros(2, 3)))
    elif case == "shape":
        items[at] = (items[at][0], torch.zeros(3, 2))
    elif case == "missing":
        del items[at]
    elif case == "twice":
        items.append(items[3])
    elif case == "meta":
        items[at] = (items[at][0], torch.empty(2, 3, device="meta"))
    drawn: list[str] = []

    def source():  # each item a collective, in a real stream: every one must be drawn
        for n, t in items:
            drawn.append(n)
            yield n, t

    layout = NamedLayout()
    plan = [p.name for p in layout.plan(index())]
    ordered = layout.ordered(NamedTensors(source()), plan, index())
    with pytest.raises((KeyError, ValueError), match=message.replace("[", r"\[")
                       .replace("]", r"\]")):
        for _ in ordered:
            pass
    assert drawn == [n for n, _ in items]
    assert layout.order is None  # a failed push teaches nothing
