"""Run under torchrun (2 ranks, gloo): a speculative drafter kept in sync.

The server (tests/e2e/test_drafter.py) serves a tiny Llama in fp32 with a
`draft_model` drafter that starts as a copy of it. The policy is the same
checkpoint under FSDP2. Rounds, each reported by rank 0 with the drafter's
acceptance over greedy rollouts of PROMPTS and those rollouts' tokens against
a transformers fp32 greedy decode of torch's own full state dict:

- v0: nothing pushed; the drafter is the target, bit for bit.
- v1: trained, pushed alone: the drafter is frozen at v0.
- v2: the same weights, pushed with `draft=model`: the drafter is synced.
- v3: trained again, pushed with the drafter, one of the drafter's tensors
  dropped at the load (`load.drop`): the push fails, both keep v2.
- v3 again, nothing armed: both load.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rollout_sidecar.trainer.collectives import all_gather_object
from tests.fidelity.fidelity_worker import build, reference
from tests.fsdp_wrap import full_state_dict
from tests.rank_worker import main, server_info

PROMPTS = [[104, 101, 108, 108, 111], [119, 111, 114, 108, 100], [1, 2, 3, 4], [50, 60, 70],
           [200, 17, 9, 33, 81, 4]]
NEW_TOKENS = 24
SCORED = [[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 200, 11, 12, 13, 14]]
DROPPED = "draft.model.layers.1.mlp.down_proj.weight"


def train(model: torch.nn.Module, steps: int, offset: int) -> None:
    """Adam on a fixed token pattern: enough to move the greedy choices
    (a drafter left behind then proposes tokens the target rejects)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.arange(64).remainder(20).add(offset).repeat(4, 1)
    for _ in range(steps):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def greedy(model: torch.nn.Module, prompt: list[int], eos: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    return ids[len(prompt):]


def observe(client, version: int, oracle: torch.nn.Module) -> dict:
    """Greedy rollouts at `version`: the drafter's acceptance over them and
    whether their tokens are the oracle's."""
    before = client.info().drafter
    served = [client.generate(prompt_token_ids=[p], min_weight_version=version,
                              sampling=dict(max_tokens=NEW_TOKENS, temperature=0.0)
                              ).results[0].samples[0].token_ids for p in PROMPTS]
    info = client.info()
    after = info.drafter
    eos = oracle.config.eos_token_id
    want = [greedy(oracle, p, eos) for p in PROMPTS]
    drafted = after.draft_tokens - before.draft_tokens
    return dict(served_version=info.weight_version, drafter_version=after.version,
                synced=after.synced, drafted=drafted,
                acceptance=(after.accepted_tokens - before.accepted_tokens) / drafted,
                tokens_equal_oracle=served == want, tokens=served,
                scored=client.score(SCORED).results[0].prompt_logprobs[1:])


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--failpoints", required=True, help="the server's failpoint file")


def body(args: argparse.Namespace, rank: int) -> dict:
    from rollout_sidecar.trainer import WeightPusher, WeightPushError

    client, _ = server_info(args.url)
    model = build(args.model, "fsdp2")
    pusher = WeightPusher(args.url, bucket_mb=1)
    rounds: list[dict] = []
    serving: list[dict | None] = [None]  # the served weights' state dict (None: checkpoint)

    def push(version: int, name: str, draft: bool, drop: str | None = None) -> None:
        state = full_state_dict(model, "fsdp2")  # every rank: a collective
        if rank == 0:
            Path(args.failpoints).write_text(f"load.drop:{drop}" if drop else "")
        run: dict = {"round": name, "version": version, "with_draft": draft}
        try:
            res = pusher.push(model, version, draft=model if draft else None)
            run.update(error=None, drafter=res.drafter, senders=res.senders,
                       probe_gap=res.probe_gap)
        except WeightPushError as e:
            run.update(error=str(e), drafter=None)
        run["errors_by_rank"] = all_gather_object(run["error"] is not None)
        if run["error"] is None:
            serving[0] = state
        if rank == 0:
            Path(args.failpoints).write_text("")
            served = client.info().weight_version
            run.update(observe(client, served, reference(args.model, serving[0])))
            rounds.append(run)

    if rank == 0:
        rounds.append({"round": "checkpoint", "version": 0, "error": None,
                       **observe(client, 0, reference(args.model, None))})
    train(model, 30, offset=30)
    push(1, "target only", draft=False)
    push(2, "with the drafter", draft=True)
    train(model, 30, offset=90)
    push(3, "drafter load refused", draft=True, drop=DROPPED)
    push(3, "with the drafter", draft=True)
    pusher.close()
    return {"rounds": rounds}


if __name__ == "__main__":
    main(body, arguments)
