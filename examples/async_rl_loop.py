"""An asynchronous RL loop on the sidecar, in one process (docs/async-rl.md).

Step t+1's rollouts are generated while step t trains and pushes, with commit
policy `keep`: the push lands under the running requests, which go on on the
new weights. Each token's version comes from its sample's `weight_versions`
spans; the importance ratio is against the served logprob of each token (the
exact probability it was sampled with), and tokens more than MAX_LAG versions
behind the trainer are masked out.

    rollout-sidecar serve &          # or any running server
    ROLLOUT_SIDECAR_URL=http://127.0.0.1:8000 python examples/async_rl_loop.py

`rollout-sidecar demo --async` is the same loop under torchrun with FSDP2.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.trainer import WeightPusher

PROMPTS = ["Write words: ", "hello ", "Once upon a time", "The cat "]
STEPS, MAX_LAG, CLIP = 8, 1, 0.2


def reward(tokens: list[int]) -> float:  # the demo's task: lowercase letters
    return sum(ord("a") <= t <= ord("z") for t in tokens) / max(1, len(tokens))


def main() -> None:
    client, pusher = GenerationClient(), WeightPusher(commit_policy="keep", probe=False)
    info = client.info()
    model = AutoModelForCausalLM.from_pretrained(info.model, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    version = info.weight_version
    pool = ThreadPoolExecutor(1)

    def rollouts(step: int):  # noqa: ANN202
        return client.generate(PROMPTS, sampling=dict(n=8, max_tokens=16, seed=step))

    pending = pool.submit(rollouts, 0)
    for step in range(1, STEPS + 1):
        batch = pending.result()
        pending = pool.submit(rollouts, step)  # overlaps this step's training and push
        loss, rewards = torch.zeros(()), []
        for res in batch.results:
            group = [reward(s.token_ids) for s in res.samples]
            mean, std = sum(group) / len(group), torch.tensor(group).std().item() + 1e-4
            rewards += group
            for s, r in zip(res.samples, group, strict=True):
                ids = torch.tensor([res.prompt_token_ids + s.token_ids])
                logits = model(input_ids=ids).logits[0, len(res.prompt_token_ids) - 1:-1]
                logp = torch.log_softmax(logits.float(), -1).gather(
                    -1, torch.tensor(s.token_ids)[:, None])[:, 0]
                # Per token: its version from the spans, its ratio against the served logprob.
                lag = torch.tensor([version - v for v in s.token_versions()])
                keep = (lag <= MAX_LAG).float()
                ratio = torch.exp(logp - torch.tensor(s.logprobs))
                adv = (r - mean) / std
                per_token = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
                loss = loss + (per_token * keep).sum() / keep.sum().clamp(min=1)
        (loss / len(rewards)).backward()
        opt.step()
        opt.zero_grad()
        version = pusher.push(model, version=version + 1).version
        print(f"step {step}: reward {sum(rewards) / len(rewards):.3f}, pushed v{version}, "
              f"rollouts from {batch.versions_used}", flush=True)
    pending.result()
    pool.shutdown()
    pusher.close()


if __name__ == "__main__":
    main()
