"""SkyRL 0.4.0's own HTTP clients against a sidecar server (a subprocess:
SkyRL is installed apart, tests/integrations/frameworks.txt).

1. `RemoteInferenceClient` (SkyRL's client for external inference servers:
   `external_proxy_url` and `external_server_urls`) generates through
   vLLM's token route on the sidecar, greedy. The same prompt ids sent
   straight to /generate through our client must give the same tokens and
   logprobs. Then the control calls SkyRL makes around a weight sync.
2. SkyRL's delta weight sync, its trainer side as shipped
   (`DeltaTrainerWeightTransferEngine` over the policy, an fp32 copy of the
   served model, and SkyRL's `SkyrlWeightSyncClient`, which carries the
   admin token from a netrc file): after each optimizer step it publishes
   the deltas and drives the server's fetch, start, update and finish; the
   served logprobs must then be a transformers forward of the policy's
   weights rounded to the checkpoint's dtype (the bytes SkyRL ships).
   Then SkyRL's trainer restarts (a new engine and client: its init call
   again, while the server serves version 2) and changes one tensor only:
   the served weights must be version 2's with that change, not the
   checkpoint's (a base read back from disk reverted every other tensor).
3. Refusals: an update out of order (409), SkyRL's NCCL transfer (501).

Writes what it saw to --out.

SkyRL 0.4.0 declares Python >= 3.12. Its `skyrl.backends` package imports
the Tinker backend on import, whose pydantic models need 3.12's TypedDict.
Nothing used here needs that backend, so the package's `__init__` is
skipped (`backends_without_tinker`); everything else is SkyRL's code as
shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import types


def backends_without_tinker() -> None:
    import skyrl

    pkg = types.ModuleType("skyrl.backends")
    pkg.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
    sys.modules.setdefault("skyrl.backends", pkg)


PROMPTS = [[1, 2, 3, 4, 5], [104, 101, 108, 108, 111], [50, 60, 70]]


async def drive(url: str, model: str) -> dict:
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )
    from transformers import AutoTokenizer

    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1,
                                   model_name=model,
                                   tokenizer=AutoTokenizer.from_pretrained(model))
    try:
        out = await client.generate({"prompt_token_ids": PROMPTS, "sampling_params": {
            "max_tokens": 10, "temperature": 0.0, "logprobs": 1}})
        calls = {}
        for name, call in (("world_size", client.get_world_size()), ("pause", client.pause()),
                           ("reset_prefix_cache", client.reset_prefix_cache()),
                           ("resume", client.resume()), ("sleep", client.sleep()),
                           ("wake_up", client.wake_up())):
            calls[name] = await call
        return dict(response_ids=out["response_ids"], response_logprobs=out["response_logprobs"],
                    stop_reasons=out["stop_reasons"], calls=calls)
    finally:
        await client.teardown()


SCORED = [[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 200, 11, 12, 13, 14]]


def served_gap(url: str, policy, model: str) -> tuple[float, list[float], int]:
    """Max |served - oracle| over SCORED, the served logprobs, their version:
    the oracle is a transformers fp32 forward of the policy's weights rounded
    to the checkpoint's dtype (bf16), the bytes SkyRL's deltas carry."""
    import torch

    from rollout_sidecar.client import GenerationClient
    from tests.fidelity.fidelity_worker import gap_max, reference, scored_logprobs

    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    want = scored_logprobs(reference(model, state, torch.bfloat16), SCORED)
    served = GenerationClient(url).score(SCORED)
    got = [lp for r in served.results for lp in r.prompt_logprobs[1:]]
    return gap_max(want, got), got, served.weight_version


def delta_sync(url: str, model: str, work: str) -> list[dict]:
    import torch
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient
    from skyrl.backends.skyrl_train.weight_sync.delta.trainer import (
        DeltaTrainerInitInfo,
        DeltaTrainerWeightTransferEngine,
    )
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    client = SkyrlWeightSyncClient([url], 1)
    info = DeltaTrainerInitInfo(base_model_path=model, sync_dir=f"{work}/sync",
                                local_checkpoint_dir=f"{work}/local",
                                publish_staging_dir=f"{work}/staging", rank=0)
    engine = DeltaTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                           source=ModuleSource(policy))
    engine.skyrl_set_reset_prefix_cache(True)
    opt = torch.optim.Adam(policy.parameters(), lr=2e-3)
    batch = torch.randint(0, policy.config.vocab_size, (4, 32),
                          generator=torch.Generator().manual_seed(1))
    rounds = []
    for step in (1, 2):
        policy(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        engine.send_weights()
        gap, scored, version = served_gap(url, policy, model)
        rounds.append(dict(step=step, served_version=version, fp32_gap_max=gap,
                           scored=scored))
    client.close()
    # SkyRL's init again while version 2 serves, the publisher's state kept
    # (version 2's bytes), then a delta touching one tensor.
    publisher = engine._publisher
    client = SkyrlWeightSyncClient([url], 1)
    engine = DeltaTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                           source=ModuleSource(policy))
    engine._publisher = publisher
    with torch.no_grad():
        policy.model.norm.weight.mul_(1.5)
    engine.send_weights()
    gap, scored, version = served_gap(url, policy, model)
    rounds.append(dict(step="reinit", served_version=version, fp32_gap_max=gap, scored=scored))
    # A publisher that starts over: version 1 again, against the checkpoint.
    engine = DeltaTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                           source=ModuleSource(policy))
    try:
        engine.send_weights()
        rounds.append(dict(step="over", refused=None))
    except Exception as e:  # noqa: BLE001 - what SkyRL's trainer sees
        rounds.append(dict(step="over", refused=str(e)))
    client.close()
    return rounds


def refusals(url: str) -> dict:
    import httpx

    token = os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"]
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as http:
        early = http.post(f"{url}/update_weights", json={"update_info": {"target_version": 9}})
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient

    try:
        SkyrlWeightSyncClient([url]).init_weight_transfer_engine(
            {"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1,
             "world_size": 2})
        nccl = None
    except Exception as e:  # noqa: BLE001 - what SkyRL's trainer would see
        nccl = f"{type(e).__name__}: {e}"
    return dict(early=[early.status_code, early.text], nccl=nccl)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True, help="a folder for SkyRL's store")
    args = ap.parse_args()
    backends_without_tinker()
    from rollout_sidecar.client import GenerationClient

    report = asyncio.run(drive(args.url, args.model))
    direct = GenerationClient(args.url).generate(prompt_token_ids=PROMPTS, sampling=dict(
        max_tokens=10, temperature=0.0, logprobs=True))
    report["direct"] = dict(ids=[r.samples[0].token_ids for r in direct.results],
                            logprobs=[r.samples[0].logprobs for r in direct.results],
                            version=direct.weight_version)
    report["delta"] = delta_sync(args.url, args.model, args.work)
    report["refusals"] = refusals(args.url)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
