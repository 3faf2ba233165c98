"""verl's agent loop generating through a sidecar server (a subprocess: Ray
keeps process-wide state).

verl's own driver objects, from verl's own `ppo_trainer.yaml` with the
overrides a user sets (`rollout.name=rollout_sidecar`, $ROLLOUT_SIDECAR_URL):
`LLMServerManager` builds our replica from verl's registry, its load
balancer and `LLMServerClient` call our Ray actor, and `AgentLoopManager`
with verl's single-turn agent loop renders chat prompts, generates and pads
a `DataProto`. Ray runs on this machine (Ray 2.60 has no local mode). The
batch is greedy (verl's validation sampling), so the same prompt ids sent
straight to the server through our client must give the same tokens and
logprobs. Writes what it saw to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import numpy as np

PROMPTS = ["hello there", "count to five"]
EXAMPLE = Path(__file__).parents[2] / "examples" / "verl" / "sidecar.yaml"


def config(model: str):
    """verl's own ppo_trainer.yaml, this machine's sizes, then the example's
    settings (examples/verl/sidecar.yaml) merged over them as a user would."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    folder = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "actor_rollout_ref.rollout.prompt_length=32",
            "actor_rollout_ref.rollout.response_length=12",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=2",  # two replicas of verl's
            "actor_rollout_ref.rollout.nnodes=1",
            "trainer.n_gpus_per_node=2"])
    OmegaConf.set_struct(cfg, False)  # the manager class is a key verl reads if present
    return OmegaConf.merge(cfg, OmegaConf.load(EXAMPLE))


def manager_backend(cfg) -> list[str]:
    """What verl's trainer builds from the example's checkpoint settings
    (ray_trainer.py: the manager class by its name, then the backend)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    rollout = cfg.actor_rollout_ref.rollout
    manager = load_class_from_fqn(rollout.checkpoint_manager_class)
    built = manager(omega_conf_to_dataclass(rollout.checkpoint_engine), None, [])
    return [manager.__name__, built.backend_cls.__name__]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.protocol import DataProto
    from verl.workers.rollout.llm_server import LLMServerManager

    import rollout_sidecar.trainer.integrations.verl  # noqa: F401 - registers our names
    from rollout_sidecar.client import GenerationClient

    cfg = config(args.model)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    try:
        manager = LLMServerManager.create(config=cfg)
        client = manager.get_client()
        direct = asyncio.run(client.generate("one", prompt_ids=[1, 2, 3, 4],
                                             sampling_params={"temperature": 0.0,
                                                              "logprobs": True}))
        loop = AgentLoopManager.create(config=cfg, llm_client=client)
        batch = DataProto.from_dict(non_tensors={"raw_prompt": np.array(
            [[{"role": "user", "content": p}] for p in PROMPTS], dtype=object)},
            meta_info={"validate": True, "global_steps": 4})
        out = loop.generate_sequences(batch)
        mask = out.batch["response_mask"].bool()
        rows = []
        for i in range(len(PROMPTS)):
            prompt = out.batch["prompts"][i][out.batch["attention_mask"][i][
                :out.batch["prompts"].shape[1]].bool()].tolist()
            rows.append(dict(prompt_ids=prompt,
                             tokens=out.batch["responses"][i][mask[i]].tolist(),
                             logprobs=out.batch["rollout_log_probs"][i][mask[i]].tolist(),
                             min_global_steps=int(out.non_tensor_batch["min_global_steps"][i]),
                             max_global_steps=int(out.non_tensor_batch["max_global_steps"][i])))
        # The oracle: the same prompt ids straight to the server, greedy.
        server = GenerationClient(os.environ["ROLLOUT_SIDECAR_URL"].split(",")[0])

        def straight(prompt_ids: list[int]) -> dict:
            r = server.generate(prompt_token_ids=[prompt_ids], sampling=dict(
                temperature=0.0, max_tokens=12, logprobs=True))
            return dict(tokens=r.results[0].samples[0].token_ids,
                        logprobs=r.results[0].samples[0].logprobs, version=r.weight_version)

        for row in rows:
            row["direct"] = straight(row["prompt_ids"])
        report = dict(addresses=manager.get_addresses(), rows=rows,
                      checkpoint=manager_backend(cfg),
                      one=dict(tokens=direct.token_ids, logprobs=direct.log_probs,
                               stop_reason=direct.stop_reason, extra_fields=direct.extra_fields,
                               direct=straight([1, 2, 3, 4])))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
