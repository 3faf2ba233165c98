"""Put the sidecar into an existing FSDP training script: the ~20 lines that matter.

Run next to a server (`rollout-sidecar serve`), e.g.:
  ROLLOUT_SIDECAR_URL=http://127.0.0.1:8000 ROLLOUT_SIDECAR_ADMIN_TOKEN=... \
  torchrun --nproc-per-node 2 examples/fsdp_grpo_step.py --model PATH
The full loop with rewards, advantages and a report is rollout_sidecar.demo.loop.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.trainer import WeightPusher

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    # --- the sidecar: one client for rollouts, one pusher for weights --------
    client, pusher = GenerationClient(), WeightPusher()
    version = client.info().weight_version
    for step in range(args.steps):
        box = [None]
        if dist.get_rank() == 0:  # one rank asks; all ranks train on the same rollouts
            box = [client.generate(["Say a: "], sampling=dict(n=4, max_tokens=8),
                                   min_weight_version=version)]
        dist.broadcast_object_list(box, src=0)
        sample = box[0].results[0].samples[0]
        ids = torch.tensor([box[0].results[0].prompt_token_ids + sample.token_ids])
        loss = model(input_ids=ids, labels=ids).loss  # your RL loss goes here
        loss.backward()
        opt.step()
        opt.zero_grad()
        version = pusher.push(model, version=version + 1).version  # every rank
        if dist.get_rank() == 0:
            print(f"step {step}: pushed weight_version {version}")
    dist.destroy_process_group()
