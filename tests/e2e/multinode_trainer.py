"""Run by test_multinode.py in a network namespace of its own (a third host):
a plain trainer that moves the checkpoint's weights by a seeded step, pushes
them over gloo to the server at argv[1] (whose engine spans two hosts), and
prints one JSON line: the version pushed, how the push went, and the oracle,
a transformers fp32 forward's logprobs of TOKENS under the pushed weights."""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from rollout_sidecar.trainer import WeightPusher

TOKENS = [3, 17, 101, 55, 200, 9, 42, 77, 128, 250, 31, 64, 5, 190, 222, 13]


def main() -> None:
    url, model_path, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    with WeightPusher(url, bucket_mb=2) as pusher:  # admin token from the environment
        r = pusher.push(model, version=version)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    print(json.dumps({"version": r.version, "encoding": r.encoding, "bytes": r.nbytes,
                      "probe_passed": r.probe.passed if r.probe else None,
                      "timings": r.timings, "reference": lp.tolist()}), flush=True)


if __name__ == "__main__":
    main()
