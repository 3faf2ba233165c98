"""The drafter's share of a load (server/engine/drafter.py says what a
drafter is and why it is pushed with the target).

The staged copy holds the drafter's tensors under `draft.` names; here they
are told apart from the target's and handed to reload.py with the drafter's
model, which loads both or neither. The drafter is found as vLLM's own draft
weight updates find it (`Worker._set_draft_weight_update_target`,
vllm/v1/worker/gpu_worker.py): `model_runner.get_draft_model()` and
`speculative_config.draft_model_config`. We do not go through vLLM's
`start_draft_weight_update()`: it runs the drafter's update as a session of
its own, so target and drafter would load in two pauses, and a failure of the
second would leave the first loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from rollout_sidecar.protocol.schema import DRAFT_PREFIX, is_draft
from rollout_sidecar.server.weights.worker.reload import DraftLoad, LoadRefused

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.worker.vllm_worker import VllmWorker

Weights = list[tuple[str, torch.Tensor]]


def drafter_of(worker: VllmWorker) -> tuple[torch.nn.Module, Any] | None:
    """This worker's drafter model and its model config, if it has one."""
    get = getattr(getattr(worker, "model_runner", None), "get_draft_model", None)
    model = get() if callable(get) else None
    spec = getattr(worker, "speculative_config", None)
    config = getattr(spec, "draft_model_config", None)
    return (model, config) if model is not None and config is not None else None


def split_draft(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[Weights, Weights]:
    """(the target's tensors, the drafter's with their own names)."""
    target: Weights = []
    draft: Weights = []
    for name, tensor in weights:
        if is_draft(name):
            draft.append((name[len(DRAFT_PREFIX):], tensor))
        else:
            target.append((name, tensor))
    return target, draft


def draft_load(drafter: tuple[torch.nn.Module, Any] | None, weights: Weights
               ) -> DraftLoad | None:
    """The drafter's part of this load: None when the push left it out."""
    if not weights:
        return None
    if drafter is None:
        raise LoadRefused("the push carries a drafter's tensors, but this worker runs no "
                          "drafter")
    return DraftLoad(drafter[0], drafter[1], weights)
