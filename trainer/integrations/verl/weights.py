"""verl's weight sync through rollout-sidecar (verl 0.9.1): the trainer's side.

verl hands every actor rank a generator of `(HF name, full tensor)` after
each actor update (`engine.get_per_tensor_param()`: one `full_tensor()`
all-gather per tensor, so every rank must draw it to its end, in step) and
the step number, `global_steps`. Both routes verl offers end in
`WeightPusher.push_tensors(weights, global_steps)`: the named-tensor push
with every guarantee of the module path (buckets, checks, every rank
sending its share, two-phase commit over every replica).

- `SidecarCheckpointEngine` (backend `rollout_sidecar`): verl's
  `CheckpointEngine`; `send_weights(weights, global_steps)` pushes. The
  servers receive over their own data plane, so nothing runs on a rollout
  worker: `SidecarCheckpointManager` (verl's
  `rollout.checkpoint_manager_class`) runs the actor half of verl's
  sequence alone (prepare, topology, process group, send, finalize), where
  verl's own manager would build a worker group of the replicas' (absent)
  workers.
- `SidecarRollout`: verl's rollout adapter under the name `rollout_sidecar`
  (a hybrid actor builds one; with `checkpoint_engine.backend=naive` verl's
  actor calls its `update_weights`, which pushes the same way). Nothing of
  it sleeps or wakes: the servers' memory is not the trainer's.

Versions: the version is `global_steps`. verl syncs once before training
(`update_weights(0)`) while the servers serve their checkpoint as version 0,
the weights at the `model.path` both load: that sync draws the generator
and pushes nothing (`sidecar/skipped`). Any other step at or below the
served version is a conflict the push names (a resumed run facing servers
that went further: restart them, or set `version_offset`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
)
from verl.workers.rollout.base import BaseRollout

from rollout_sidecar.trainer.pusher import WeightPusher
from rollout_sidecar.trainer.rank_agreement import agree, rank

log = logging.getLogger(__name__)
BACKEND = "rollout_sidecar"
Weights = Iterable[tuple[str, torch.Tensor]]


def push_step(pusher: WeightPusher, weights: Weights, global_steps: int | None,
              offset: int = 0) -> dict[str, float]:
    """Push verl's weights of `global_steps` (every rank); verl's metrics."""
    version = (global_steps or 0) + offset
    # Only the step-0 sync asks what the replicas serve (the same `version` on
    # every rank, so every rank agrees or none does); any other push reads
    # their status once, in its own opening.
    if version == 0 and agree(lambda: _served(pusher) if rank() == 0 else None) == 0:
        for _ in weights:  # every rank's all-gathers, in step; nothing to push
            pass
        log.info("verl's step-0 sync: the servers serve their checkpoint (version 0), "
                 "which is the policy before training; nothing pushed")
        return {"sidecar/skipped": 1.0, "sidecar/weight_version": 0.0}
    res = pusher.push_tensors(weights, version)
    return {"sidecar/weight_version": float(res.version), "sidecar/push_s":
            res.timings.get("total_s", 0.0), "sidecar/push_mb": res.nbytes / 2**20,
            "sidecar/senders": float(res.senders), "sidecar/held_mb":
            (res.held_bytes or 0) / 2**20, "sidecar/skipped": 0.0}


def _served(pusher: WeightPusher) -> int:
    """The oldest version the replicas serve (rank 0)."""
    replicas = pusher.replicas
    assert replicas is not None, "rank 0 only"
    return min(s.weight_version for s in replicas.all(lambda a, i: a.status(), "status"))


def _pusher(url: str | None, bucket_size: int | None, **options: Any) -> WeightPusher:
    if bucket_size:
        options["bucket_mb"] = max(1, bucket_size >> 20)
    return WeightPusher(url or os.environ.get("ROLLOUT_SIDECAR_URL"), **options)


@CheckpointEngineRegistry.register(BACKEND)
class SidecarCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine, pushing through rollout-sidecar.

    Built by verl on every actor rank with `bucket_size` (verl's
    `update_weights_bucket_megabytes`) and `engine_kwargs.rollout_sidecar`:
    `url` (default $ROLLOUT_SIDECAR_URL; several replicas comma-separated or
    `dns+http://`), `version_offset` (added to `global_steps`) and any
    `PushConfig` field (`senders`, `transport`, `probe`...). The tokens come
    from $ROLLOUT_SIDECAR_ADMIN_TOKEN, never from a config file.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, url: str | None = None,
                 version_offset: int = 0, **options: Any) -> None:
        self.is_master = is_master
        self.offset = version_offset
        self.pusher = _pusher(url, bucket_size, **options)

    def prepare(self) -> dict[str, Any]:
        return {}  # the pusher connects on its first push, and keeps the connection

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}  # the servers' data plane is the pusher's to set up

    def init_process_group(self, **kwargs: Any) -> None:
        pass

    def finalize(self) -> None:
        pass  # kept across steps: the next push reuses the connection

    async def send_weights(self, weights: Weights, global_steps: int | None = None
                           ) -> dict[str, float]:
        return push_step(self.pusher, weights, global_steps, self.offset)

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError("rollout-sidecar servers receive over their own data "
                                  "plane: no rollout worker takes part")


class SidecarCheckpointManager(CheckpointEngineManager):
    """verl's sequence, the actor half alone (`rollout.checkpoint_manager_class`).
    The servers commit all or nothing and tag every token with its version, so
    nothing is aborted or released around a push."""

    def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        import ray

        wg = self.actor_wg
        if self.backend == "naive":  # the actor's rollout adapter pushes (SidecarRollout)
            ray.get(wg.update_weights(global_steps=global_steps, mode=self.backend))
            return {}
        metadata = ray.get(wg.execute_checkpoint_engine(["prepare"] * wg.world_size))
        kwargs, _ = self.backend_cls.build_topology(wg.world_size, 0, metadata)
        ray.get(wg.execute_checkpoint_engine(method=["init_process_group"] * wg.world_size,
                                             **kwargs))
        results = ray.get(wg.update_weights(global_steps=global_steps, mode=self.backend))
        ray.get(wg.execute_checkpoint_engine(["finalize"] * wg.world_size))
        return {k: v for r in results if isinstance(r, dict) for k, v in r.items()}


class SidecarRollout(BaseRollout):
    """verl's rollout adapter on a hybrid actor: weights go to the sidecar
    (`update_weights`); sleeping and waking are the servers' own business."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.pusher = _pusher(None, None)

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Weights, wire_format: str = "named_tensors",
                             **kwargs: Any) -> dict[str, float]:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"wire_format={wire_format!r}: the sidecar takes full "
                                      "named tensors")
        return push_step(self.pusher, weights, kwargs.get("global_steps"))
