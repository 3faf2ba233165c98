"""Run under torchrun (2 ranks, gloo): a delta push end to end without a server.

Rank 0 stages a dense push of the model as the server would (the resident
copy, in small buckets so large tensors are split); every rank keeps its shard
copy; after optimizer steps the delta is planned from every rank's diff, the
patches are packed by the pusher's own sender, checked against the manifest
check, and applied into the resident copy by the server's own code. The
oracle is torch's full state dict (FSDP2: `get_model_state_dict`; FSDP1:
`summon_full_params`), cast to the wire dtype: every tensor must equal it bit
for bit. Rank 0 writes a JSON report; tests/test_delta_push_units.py asserts.

`--wrap`: plain (every rank holds everything, rank 0 diffs), fsdp2, fsdp1.
`--nan`: a NaN in rank 1's shard; the pack must refuse it.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from rollout_sidecar.trainer.collectives import all_gather_object
from tests.fsdp_wrap import full_state_dict, wrap
from tests.rank_worker import main

BUCKET = 4096  # bytes: the embedding and the head are split in the resident copy
WIRE = torch.bfloat16


def build(wrapper: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return wrap(LlamaForCausalLM(cfg), wrapper)


def full_state(m: nn.Module, wrapper: str) -> dict[str, torch.Tensor]:
    """torch's own full state dict, names as the pusher's, in the wire dtype."""
    from rollout_sidecar.trainer.gather.names import normalize_name

    return {normalize_name(n): t.to(WIRE) for n, t in full_state_dict(m, wrapper).items()}


def stage(buckets: list, sent: dict[int, bytes]):
    from rollout_sidecar.server.weights.worker.staging import Staging

    staging = Staging()
    staging.allocate(buckets, torch.device("cpu"))
    for k, b in enumerate(staging.buckets):
        staging.stage(k, torch.frombuffer(bytearray(sent[b.index]), dtype=torch.uint8), "crc32")
    return staging


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--wrap", default="fsdp2")
    ap.add_argument("--nan", action="store_true")


def body(args: argparse.Namespace, rank: int) -> dict:
    from rollout_sidecar.protocol.data_plane.bucket_check import crc32
    from rollout_sidecar.protocol.data_plane.delta_codec import bits
    from rollout_sidecar.protocol.schema import BeginRequest
    from rollout_sidecar.server.weights.worker.patching import apply_patches
    from rollout_sidecar.trainer.delta.delta_push import DeltaPush
    from rollout_sidecar.trainer.pack.buckets import manifest, plan_buckets
    from rollout_sidecar.trainer.pack.sender import BucketSender
    from rollout_sidecar.trainer.push_opening import Opening
    from tests.test_split_buckets import LoopbackTransport, index_of, plan_of

    model = build(args.wrap)
    opening = Opening(False, "bfloat16", {}, [], None, None)
    report: dict = {"pushes": []}

    # The first push: dense, from torch's own state dict, staged as the server does.
    before = full_state(model, args.wrap)
    resident = None
    if rank == 0:
        dense = plan_buckets(plan_of(before), WIRE, BUCKET)
        wire = LoopbackTransport()
        _, err = BucketSender().send_all(dense, iter(before.items()), wire, ["dense"])
        assert err is None, err
        resident = stage(dense, wire.sent)
        report["split"] = sum(1 for b in dense for s in b.params if s.chunk_offset is not None)
    delta = DeltaPush("host", dense_above=0.25)
    delta.committed(model, opening, 1)
    report["copy_bytes_by_rank"] = all_gather_object(delta.copy.nbytes)

    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 301, (2, 12), generator=g)
    for version in (2, 3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if args.nan and version == 3:
            with torch.no_grad():
                p = dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"]
                local = p.to_local() if hasattr(p, "to_local") else p
                if rank == 1 or args.wrap == "plain":
                    local.view(-1)[3] = float("nan")
        after = full_state(model, args.wrap)
        plan, why = delta.plan(model, Opening(False, "bfloat16", {}, [], version - 1, None),
                               BUCKET)
        assert plan is not None, why
        patches = plan.diff.patches(plan.buckets, plan.plans)
        if rank != 0:
            for _ in patches:
                pass
            dist.barrier()
            if not (args.nan and version == 3):
                delta.committed(model, opening, version)
            continue
        wire = LoopbackTransport()
        checksums, err = BucketSender().send_all(plan.buckets, patches, wire, ["delta"])
        for _ in patches:
            pass
        dist.barrier()
        row: dict = {"version": version, "error": err}
        if err is None and not args.nan:
            req = BeginRequest(version=version, buckets=manifest(plan.buckets),
                               delta_base=version - 1)
            from rollout_sidecar.server.weights.manifest_check import check_manifest

            check_manifest(req, index_of(after), "bfloat16")
            staged = stage(req.buckets, wire.sent)
            staged.check(checksums)
            row["written"] = apply_patches(staged, resident)
            got = dict(resident.tensors())
            row["mismatched"] = sorted(n for n, t in after.items()
                                       if not torch.equal(bits(got[n]), bits(t)))
            row["unchanged_before"] = sum(int((bits(before[n]) == bits(t)).sum())
                                          for n, t in after.items())
            row["elements"] = sum(t.numel() for t in after.values())
            row["changed"] = sum(p.changed for p in plan.plans if p.form.value != "dense")
            row["forms"] = sorted({p.form.value for p in plan.plans})
            row["delta_bytes"] = sum(b.nbytes for b in plan.buckets)
            row["dense_bytes"] = sum(t.numel() * t.element_size() for t in after.values())
            row["crc"] = [crc32(torch.frombuffer(bytearray(wire.sent[i]), dtype=torch.uint8))
                          for i in sorted(wire.sent)] == checksums
        if err is None:
            delta.committed(model, opening, version)
        report["pushes"].append(row)
        before = after
    return report


if __name__ == "__main__":
    main(body, arguments)
