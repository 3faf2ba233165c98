"""What a server says of its weights and of itself: GET /weights/status (the
fleet's trainers, its peers and the clients read it), GET /weights/index,
and what the status offers (the transports, the capabilities beyond the
first protocol). Read-only: nothing here changes a push.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from rollout_sidecar.protocol.schema import (
    CAPABILITIES,
    DRAFT,
    TensorInfo,
    WeightIndex,
    WeightStatus,
)
from rollout_sidecar.protocol.transports import TRANSPORTS

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.service import WeightService


@functools.cache
def transports() -> list[str]:
    """The transports this server takes. NCCL needs a GPU on the server; gloo
    and HTTP work everywhere, including one GPU shared by trainer and server.
    Asked of vLLM's platform (NVML on CUDA) once the engine runs, and once:
    never of `torch.cuda` at import, which would initialise CUDA in the
    process vLLM then forks its engine core from."""
    from vllm.platforms import current_platform

    gpu = current_platform.is_cuda_alike()
    return [t.name for t in TRANSPORTS.values() if gpu or not t.needs_gpu]


def weight_status(svc: WeightService) -> WeightStatus:
    gate, info, p = svc.engine.gate, svc.info, svc.session.current
    return WeightStatus(
        weight_version=gate.version, dtype=info.dtype, quantization=info.quantization,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len, boot_id=svc.boot_id,
        push_state=svc.session.state.value, push_in_progress=p is not None,
        push_id=p.push_id if p else None,
        connected=svc.plane.owner.id if svc.plane.owner else None,
        data_plane_port=svc.plane.port, data_plane_ranks=svc.plane.ranks,
        staging_layout=svc.layout.describe() if svc.layout else None,
        transports=transports(), capabilities=capabilities(svc),
        requires=svc.plane.requires(),
        push_timeout_s=svc.settings.push_timeout_s,
        commit_drain_s=svc.settings.commit_drain_s, last_push=svc.session.last,
        last_probe=svc.last_probe, suspect=gate.suspect.get(gate.version),
        broken=gate.broken, delta_base=svc.commits.delta_base,
        lora=svc.engine.adapters.status(), staged_bytes=svc.commits.staged_bytes,
        catch_up=dict(svc.peer_copy.timeline) or None,
        drafter=drafter.status(gate.version) if (drafter := svc.engine.drafter) else None)


def capabilities(svc: WeightService) -> list[str]:
    """What this server takes beyond the first protocol (weights_api.py).
    Every layout takes a push of own rows (`chunks:interleaved`): its chunks
    land in place (worker/placed_tensors.py), at any TP and with device
    staging, and a load copies nothing."""
    return [*CAPABILITIES, *([DRAFT] if svc.engine.index.draft else [])]


def weight_index(svc: WeightService) -> WeightIndex:
    """Every tensor a push carries, in its push dtype (checkpoint_index.py)."""
    idx, serve = svc.engine.index, svc.info.dtype
    return WeightIndex(
        tensors={n: TensorInfo(shape=list(t.shape), dtype=idx.push_dtype(t, serve))
                 for n, t in idx.tensors.items()},
        ignored=sorted(idx.ignored), tie_word_embeddings=idx.tie_word_embeddings,
        draft=sorted(idx.draft))
