"""verl 0.9.1 driven by rollout-sidecar: import this package in every verl
process (`actor_rollout_ref.model.external_lib=rollout_sidecar.trainer.integrations.verl`,
or `VERL_USE_EXTERNAL_MODULES`), and it registers

- the rollout name `rollout_sidecar` (`actor_rollout_ref.rollout.name`): the
  agent loop's replicas are sidecar servers (replica.py), and a hybrid actor's
  rollout adapter pushes (weights.py);
- the checkpoint-engine backend `rollout_sidecar`
  (`actor_rollout_ref.rollout.checkpoint_engine.backend`), with its manager
  `SidecarCheckpointManager` (`rollout.checkpoint_manager_class`).

examples/verl/ has the config; docs/verl.md what each part does.
"""

from __future__ import annotations

from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

from rollout_sidecar.trainer.integrations.verl.replica import NAME, SidecarReplica, SidecarServer
from rollout_sidecar.trainer.integrations.verl.weights import (
    BACKEND,
    SidecarCheckpointEngine,
    SidecarCheckpointManager,
    SidecarRollout,
    push_step,
)

__all__ = ["BACKEND", "NAME", "SidecarCheckpointEngine", "SidecarCheckpointManager",
           "SidecarReplica", "SidecarRollout", "SidecarServer", "push_step"]

RolloutReplicaRegistry.register(NAME, lambda: SidecarReplica)
# verl's adapter table has no register call: a hybrid actor looks its rollout
# up by (name, mode) in it (verl/workers/rollout/base.py, `get_rollout_class`).
_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{SidecarRollout.__module__}.SidecarRollout"
