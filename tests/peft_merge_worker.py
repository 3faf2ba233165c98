"""Run under torchrun (2 ranks, gloo): a PEFT model under FSDP2 and FSDP1
goes through the pusher's own gather-and-send path into a loopback
transport, and rank 0 compares the bytes with PEFT's `merge_and_unload()` of
an unsharded copy built from the same seed. Rank 0 writes a JSON report;
tests/test_peft_merge_fsdp.py asserts on it.

Wrappers: fsdp2 (`fully_shard` on every decoder layer, then the PeftModel;
a 32 KiB bucket, so weights over 8 KiB, LoRA-targeted ones included, come as
row blocks), fsdp1 (decoder layers as units, use_orig_params=True) and
fsdp1_peft_policy (PEFT's own `fsdp_auto_wrap_policy`: every LoRA factor its
own unit, gathered after its decoder layer's base weights).
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
import torch.distributed as dist

from rollout_sidecar.trainer.collectives import settled
from tests.fsdp_wrap import wrap
from tests.rank_worker import main


def shard(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    layers = model.get_base_model().model.layers
    if wrapper != "fsdp1_peft_policy":
        return wrap(model, wrapper, layers)
    # PEFT's own FSDP1 policy: the LoRA modules wrapped apart, original params off.
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model),
                device_id=torch.device("cpu"), use_orig_params=False)


def local_state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for p in model.parameters()]


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--wrappers", default="fsdp2,fsdp1,fsdp1_peft_policy")


def body(args: argparse.Namespace, rank: int) -> dict:
    from rollout_sidecar.trainer.gather import row_blocks
    from rollout_sidecar.trainer.gather.checkpoint_layout import CheckpointLayout
    from rollout_sidecar.trainer.gather.full_tensors import param_plan
    from rollout_sidecar.trainer.gather.peft_merge import PeftMerge
    from rollout_sidecar.trainer.pack.buckets import plan_buckets
    from rollout_sidecar.trainer.probe import trainer_logprobs
    from rollout_sidecar.trainer.push_sends import Begun
    from rollout_sidecar.trainer.pusher import WeightPusher
    from tests.row_blocks_worker import reassemble
    from tests.test_peft_merge import BUCKET, DENSE, peft_llama
    from tests.test_split_buckets import LoopbackTransport

    warnings.simplefilter("ignore")
    materialized: list[str] = []  # LoRA-targeted weights that came as row blocks
    materialize = row_blocks.RowBlocks.materialize

    def recorded(self):  # noqa: ANN001, ANN202
        materialized.append(f"{tuple(self.shape)}")
        return materialize(self)

    row_blocks.RowBlocks.materialize = recorded
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    report: dict = {}
    for wrapper in args.wrappers.split(","):
        materialized.clear()
        model = peft_llama()  # same seed on every rank
        want = copy.deepcopy(model).merge_and_unload().eval()
        model = shard(model, wrapper)
        before = local_state(model)
        pusher = WeightPusher("http://127.0.0.1:9", admin_token="t", probe=False,
                              bucket_mb=BUCKET / 2**20)
        begun = None
        if rank == 0:
            merge = PeftMerge(model)
            plan = CheckpointLayout(merge.base_model).plan(merge.plan(param_plan(model)))
            begun = Begun(plan_buckets(plan, torch.float32, pusher.config.bucket_bytes),
                           ["p"])
            pusher.transport = LoopbackTransport()
        err = pusher._gather_and_send(model, begun, DENSE).error
        # every rank's shards, bit for bit (before the forward, which may
        # leave FSDP2's root unsharded)
        same = torch.tensor([int(all(torch.equal(a, b) for a, b in zip(
            before, local_state(model), strict=True)))])
        settled(lambda t=same: dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True), [same])
        # the adapted forward, sharded (a collective), against the merged copy's
        got_lp, _ = trainer_logprobs(model, ids, None)
        with torch.no_grad():
            lp = torch.log_softmax(want(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        want_lp = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        if rank == 0:
            sd = want.state_dict()
            got = reassemble(begun.buckets, pusher.transport.sent) if err is None else {}
            report[wrapper] = dict(
                error=err, names_equal=sorted(got) == sorted(sd),
                max_abs_diff=max(((got[n] - t).abs().max().item() for n, t in sd.items()
                                  if n in got), default=None),
                bitwise=all(n in got and torch.equal(got[n], t) for n, t in sd.items()),
                unchanged=bool(same.item()), materialized=sorted(set(materialized)),
                probe_gap=(torch.tensor(got_lp) - want_lp).abs().mean().item())
    return report


if __name__ == "__main__":
    main(body, arguments)
