"""Run under torchrun (2 ranks, gloo): verl's weight sync into a sidecar.

The policy is an FSDP2 model in fp32. Its weights reach the checkpoint
engine the way verl's actor hands them over: verl's own
`FSDPEngine.get_per_tensor_param` (HF names through `convert_weight_keys`,
one `full_tensor()` per tensor on every rank, `unfuse_moe_params`), run on a
stand-in for the engine object that holds only what the method reads (verl
0.9.1 has no CPU platform: its device lookup and memory log are pointed at
the CPU). The
engine is verl's: loaded by name from the registry after verl's own
`import_external_libs` of our module, and driven through the actor half of
verl's sequence (prepare, build_topology, init_process_group, send_weights,
finalize), as `SidecarCheckpointManager` runs it. Rounds, reported by rank 0
with the served logprobs' gap to a transformers fp32 forward of torch's own
full state dict:

- global_steps 0, before training: nothing pushed, the servers' checkpoint;
- steps 1 and 2, each after an optimizer step: pushed as versions 1, 2;
- step 3 with one tensor misnamed in the stream: refused on every rank by
  name, version 2 still served, bit for bit;
- step 3 from a dict of those tensors on rank 0 alone (`every_rank=False`),
  with the post-push probe run on the FSDP2 policy's forward.
"""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import torch

from rollout_sidecar.trainer.collectives import all_gather_object
from tests.fidelity.fidelity_worker import (
    build,
    gap_max,
    reference,
    scored_logprobs,
    step,
)
from tests.fsdp_wrap import full_state_dict
from tests.rank_worker import main, server_info

SCORED = [[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 77, 200, 11, 12, 13, 14],
          [5, 6, 7, 8, 9, 10, 11, 12, 100, 101, 102, 103]]


def per_tensor_param(model: torch.nn.Module):
    """verl's own generator of (HF name, full tensor), as its actor makes it."""
    from verl.workers.engine.fsdp import transformer_impl

    # verl 0.9.1 has no CPU platform: its device and its memory log, on the CPU.
    transformer_impl.get_device_id = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None
    engine = SimpleNamespace(
        module=model, model_config=SimpleNamespace(lora={}, hf_config=model.config),
        _uses_fsdp2_cpu_offload_policy=True, _is_offload_param=False, _qat_enabled=False)
    weights, peft = transformer_impl.FSDPEngine.get_per_tensor_param(engine)
    assert peft is None
    return weights


def sync(engine, weights, global_steps: int, rank: int) -> dict:
    """The actor half of verl's CheckpointEngineManager.update_weights."""
    metadata = all_gather_object(engine.prepare())
    kwargs, _ = type(engine).build_topology(2, 0, metadata)
    engine.init_process_group(**{k: v[rank] for k, v in kwargs.items()})
    try:
        return asyncio.run(engine.send_weights(weights, global_steps=global_steps))
    finally:
        engine.finalize()


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)


def body(args: argparse.Namespace, rank: int) -> dict:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from rollout_sidecar.trainer import WeightPushError

    import_external_libs("rollout_sidecar.trainer.integrations.verl")
    engine = CheckpointEngineRegistry.new("rollout_sidecar", bucket_size=1 << 20,
                                          is_master=rank == 0, url=args.url)
    client, info = server_info(args.url)
    model = build(args.model, "fsdp2")
    rounds: list[dict] = []

    def observe(run: dict, state: dict | None) -> None:
        if rank != 0:
            return
        served = client.score(SCORED)
        got = [lp for r in served.results for lp in r.prompt_logprobs[1:]]
        want = scored_logprobs(reference(args.model, state), SCORED)
        run.update(served_version=served.weight_version, scored=got,
                   fp32_gap_max=gap_max(want, got))
        rounds.append(run)

    def push(global_steps: int, weights, name: str) -> dict:
        run: dict = {"round": name, "global_steps": global_steps}
        try:
            run.update(error=None, metrics=sync(engine, weights, global_steps, rank))
        except WeightPushError as e:
            run.update(error=str(e))
        run["errors_by_rank"] = all_gather_object(run["error"] is not None)
        return run

    observe(push(0, per_tensor_param(model), "step 0 (before training)"), None)
    for s in (1, 2):
        step(model, info["vocab_size"])
        state = full_state_dict(model, "fsdp2")
        observe(push(s, per_tensor_param(model), f"step {s}"), state)
    served_state = state
    step(model, info["vocab_size"])
    state = full_state_dict(model, "fsdp2")
    renamed: list[str] = []

    def misnamed():  # the first up_proj renamed: a name the served model lacks
        for n, t in per_tensor_param(model):
            if not renamed and "up_proj" in n:
                renamed.append(n)
                n = n.replace("up_proj", "up")
            yield n, t

    observe(push(3, misnamed(), "step 3, a tensor misnamed"), served_state)
    run: dict = {"round": "step 3, rank 0's tensors"}
    try:
        named = dict(per_tensor_param(model))  # (every rank: its all-gathers)
        res = engine.pusher.push_tensors(named.items() if rank == 0 else None, 3,
                                         every_rank=False, probe=model)
        run.update(error=None, senders=res.senders, senders_reason=res.senders_reason,
                   probe_passed=res.probe.passed, probe_gap=res.probe.mean_abs_dlogp)
    except WeightPushError as e:
        run.update(error=str(e))
    observe(run, state)
    engine.pusher.close()
    return {"rounds": rounds}


if __name__ == "__main__":
    main(body, arguments)
