"""The speculative drafter beside the target (`serve --speculative-config`):
which checkpoint it loads, which version its weights are, its acceptance.

A drafter goes stale silently: after a push that leaves it out, it still
proposes what the old policy would have said, the target rejects more of it,
and rollouts slow down with no error (sglang 31674, vllm-ascend 13209). The
output stays exact, since the target verifies every token. So the server
keeps, and says in `/info`, `/weights/status` and each commit's reply, the
version whose push last loaded the drafter, and the acceptance since the
served version was committed: a falling acceptance with `synced: false` is a
frozen drafter, not a bug in the target.

Pushable drafters are those with a checkpoint of their own in a local dir
(`draft_model`, the EAGLE family): its tensors are indexed under `draft.`
names (server/model/checkpoint_index.py) and the worker loads them in the
same commit as the target's (server/weights/worker/reload.py). MTP heads live
in the target's checkpoint, and an n-gram drafter has no weights: both stay
as they are (`pushable: false`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_sidecar.protocol.schema import DrafterStatus, DraftOutcome
from rollout_sidecar.server.metrics.collectors import Acceptance
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex


def draft_checkpoint(speculative: dict[str, Any] | None) -> Path | None:
    """The drafter's own checkpoint, if it is a local HF dir."""
    model = (speculative or {}).get("model")
    if not model or (speculative or {}).get("method") in ("ngram", "suffix"):
        return None
    path = Path(model)
    return path if path.is_dir() and any(path.glob("*.safetensors")) else None


def draft_index(speculative: dict[str, Any] | None) -> CheckpointIndex | None:
    path = draft_checkpoint(speculative)
    return CheckpointIndex.from_checkpoint(path) if path is not None else None


class Drafter:
    """The API process's record of the drafter (none without one)."""

    def __init__(self, speculative: dict[str, Any], index: CheckpointIndex,
                 acceptance: Acceptance) -> None:
        self.method = str(speculative.get("method") or "draft_model")
        path = draft_checkpoint(speculative)
        self.model = str(path) if path is not None else speculative.get("model")
        self.num_speculative_tokens = int(speculative.get("num_speculative_tokens") or 0)
        self.pushable = bool(index.draft)
        self.version = 0  # its checkpoint's weights, as the target's at start
        self.acceptance = acceptance

    def committed(self, version: int, carried: bool) -> DraftOutcome:
        """A load published `version`; `carried`: it loaded the drafter too."""
        if carried:
            self.version = version
        return self._published(version)

    def relabeled(self, base: int, version: int) -> DraftOutcome:
        """Unchanged weights published as `version`: a drafter synced with
        `base` is synced with it too (its weights are the same)."""
        if self.version == base:
            self.version = version
        return self._published(version)

    def _published(self, version: int) -> DraftOutcome:
        self.acceptance.reset()  # acceptance is the served version's
        return "synced" if self.version == version else "frozen"

    def status(self, served: int) -> DrafterStatus:
        a = self.acceptance
        return DrafterStatus(
            method=self.method, model=self.model,
            num_speculative_tokens=self.num_speculative_tokens, pushable=self.pushable,
            version=self.version, synced=self.version == served, draft_tokens=a.drafted,
            accepted_tokens=a.accepted,
            acceptance=a.accepted / a.drafted if a.drafted else None)
