"""Run under torchrun (2 ranks, gloo, FSDP2): the same trained weights reach
two bf16 servers, replica A by delta pushes (the default) and replica B by
dense ones (`delta=False`); after each push both must answer the same seeded
request and score the same tokens with bit-identical logprobs. Rank 0 writes a
JSON report; tests/e2e/test_delta_push.py asserts.
"""

from __future__ import annotations

import argparse

import torch

from rollout_sidecar.trainer.collectives import broadcast_object
from tests.fidelity.fidelity_worker import build
from tests.rank_worker import main

SCORED = [list(range(40, 100)), list(range(3, 250, 4))]


def answers(client, version: int) -> dict:
    # Two seeded requests of one sample each, one after the other: the two
    # samples of one n=2 request reach vLLM's scheduler one by one and may
    # prefill in one step or in two, and bf16 rounds a prompt differently in
    # another batch shape (one sample's logprobs 0.002 apart, tokens equal,
    # with identical weights: seen 1 run in 4), which is no weight difference.
    gs = [client.generate(prompt_token_ids=[[5, 6, 7, 8]], min_weight_version=version,
                          sampling=dict(n=1, max_tokens=16, temperature=1.0, seed=seed))
          for seed in (3, 4)]
    s = client.score(SCORED, min_weight_version=version)
    return dict(version=s.weight_version,
                samples=[(x.token_ids, x.logprobs) for g in gs for x in g.results[0].samples],
                scored=[r.prompt_logprobs[1:] for r in s.results])


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--delta-url", required=True)
    ap.add_argument("--dense-url", required=True)
    ap.add_argument("--dense-tokens", required=True, help="admin,api of the dense server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--pushes", type=int, default=3)


def body(args: argparse.Namespace, rank: int) -> dict:
    from rollout_sidecar.client import GenerationClient
    from rollout_sidecar.trainer import WeightPusher

    model = build(args.model, "fsdp2")
    by_delta = WeightPusher(args.delta_url, bucket_mb=1)
    dense_admin, dense_api = args.dense_tokens.split(",")
    by_dense = WeightPusher(args.dense_url, dense_admin, bucket_mb=1, delta=False)
    clients = [GenerationClient(args.delta_url),
               GenerationClient(args.dense_url, api_token=dense_api)] if rank == 0 else []
    version = broadcast_object(max(c.info().weight_version for c in clients)
                               if clients else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(2)
    report: dict = {"pushes": []}
    for _ in range(args.pushes):
        batch = torch.randint(0, 256, (4, 32), generator=g)
        opt.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        version += 1
        a = by_delta.push(model, version=version)
        b = by_dense.push(model, version=version)
        if rank == 0:
            got = [answers(c, version) for c in clients]
            report["pushes"].append(dict(
                version=version, encoding=[a.encoding, b.encoding], nbytes=[a.nbytes, b.nbytes],
                delta_base=a.delta_base, why_dense=a.delta_reason, changed=a.changed,
                elements=a.elements, probe=[a.probe_gap, b.probe_gap],
                versions=[x["version"] for x in got],
                same_samples=got[0]["samples"] == got[1]["samples"],
                same_scored=got[0]["scored"] == got[1]["scored"],
                samples=[x["samples"] for x in got],
                push_s=[a.timings["total_s"], b.timings["total_s"]]))
    return report


if __name__ == "__main__":
    main(body, arguments)
