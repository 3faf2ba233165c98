"""Who stages a push where: decided once, at start, from what every worker
sees of its host, so that no push is the first to find out.

With TP >= 2 the workers that share a /dev/shm share one staged copy there
(worker/host_share.py): their first worker (the leader) joins the data plane
and receives, the others read their shards from its files. That copy needs
the push's bytes in /dev/shm, which Docker caps at 64 MB and our compose file
and chart size from one value. So each worker reports its /dev/shm (which
mount, how much room; `host_share.host_view`), and here

- workers are grouped by engine and by the /dev/shm they see, which is right
  on one host, across vLLM's multi-node executor, under Ray (where vLLM's
  `nnodes_within_dp` stays 1 across hosts) and across containers;
- a group of two or more shares when sharing is allowed and its /dev/shm
  holds a staged copy (`need_bytes`); otherwise each of its workers stages its
  own copy, with a warning that names the size needed and the settings that
  give it, or, when sharing was required (`share_host_staging=true`), the
  server refuses to start with that message;
- every leader (a sharing group's first worker, or every worker of a group
  that does not share) gets the next data-plane rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_sidecar.server.weights import ops
from rollout_sidecar.server.weights.ops import SideOp
from rollout_sidecar.server.weights.worker_replies import Host
from rollout_sidecar.server.weights.worker_requests import Layout

if TYPE_CHECKING:
    from rollout_sidecar.server.engine.vllm_surface import WorkerRpc

GIB = 2**30
MIB = 2**20
# Room kept free beside a staged copy: bucket alignment, a LoRA adapter's
# factors (also shared), and what else lands in /dev/shm after the start
# (NCCL's shared-memory transport, a sidecar trainer's torch multiprocessing).
HEADROOM_SHARE = 0.05
HEADROOM_MIN = 64 * MIB
SHM_SETTINGS = ("docker compose: SHM_SIZE; docker run: --shm-size; Helm: shm.sizeLimit "
                "(the chart adds it to the memory limit)")


class StagingDoesNotFit(RuntimeError):
    """Sharing was required and some host's /dev/shm cannot hold the copy."""


@dataclass(frozen=True)
class WorkerHost:
    """One worker's report (SideOp.HOST): its rank across the server's
    engines (dp_index * world_size + rank, vLLM's numbering) and its host."""

    rank: int
    dp_index: int
    host: str
    shm: str | None
    shm_free: int
    shm_total: int
    net: str = ""  # equal for workers on one network stack (host_share.host_view)


@dataclass(frozen=True)
class Group:
    """Workers of one engine that see one /dev/shm; `ranks[0]` leads if shared."""

    dp_index: int
    ranks: list[int]
    host: str
    shared: bool


@dataclass(frozen=True)
class StagingLayout:
    groups: list[Group]
    need_bytes: int  # a shared copy's room in /dev/shm
    warnings: list[str] = field(default_factory=list)

    @property
    def leaders(self) -> list[int]:
        """The workers that join the data plane, in data-plane rank order."""
        return sorted(r for g in self.groups for r in (g.ranks[:1] if g.shared else g.ranks))

    @property
    def ranks(self) -> int:
        """This server's ranks in the data-plane group."""
        return len(self.leaders)

    @property
    def shared(self) -> bool:
        return any(g.shared for g in self.groups)

    def roles(self) -> dict[str, dict]:
        """Each worker's role (SideOp.LAYOUT), keyed by its rank as a string
        (it crosses vLLM's RPC): `plane_rank`, its data-plane rank (None: a
        follower), and `leader`, the rank whose staged copy it reads, itself
        unless it follows."""
        plane = {r: i for i, r in enumerate(self.leaders)}
        roles = {}
        for g in self.groups:
            for r in g.ranks:
                leader = g.ranks[0] if g.shared else r
                roles[str(r)] = {"plane_rank": plane.get(r), "leader": leader,
                                 "shared": g.shared}
        return roles

    def describe(self) -> str:
        if not self.shared:
            return "per worker: every worker receives and keeps its own staged copy"
        parts = [f"engine {g.dp_index} on {g.host}: "
                 + (f"ranks {g.ranks} share one copy in /dev/shm (rank {g.ranks[0]} receives)"
                    if g.shared else f"ranks {g.ranks} stage their own")
                 for g in self.groups]
        return "; ".join(parts)


def need_bytes(staged_bytes: int) -> int:
    """Room in /dev/shm that one shared staged copy of `staged_bytes` needs."""
    return staged_bytes + max(HEADROOM_MIN, math.ceil(staged_bytes * HEADROOM_SHARE))


def plan(hosts: list[WorkerHost], share: bool | None, device_staging: bool,
         staged_bytes: int) -> StagingLayout:
    """The layout (module docstring). `share`: the setting (None: where it
    fits; True: required; False: never). `device_staging`: NCCL pushes stage
    in GPU memory, one copy per GPU, so nothing is shared."""
    need = need_bytes(staged_bytes)
    by_key: dict[tuple[int, str | None], list[WorkerHost]] = {}
    for h in sorted(hosts, key=lambda h: h.rank):
        by_key.setdefault((h.dp_index, h.shm), []).append(h)
    groups: list[Group] = []
    warnings: list[str] = []
    refused: list[tuple[WorkerHost, str]] = []
    for members in by_key.values():
        first = members[0]
        ranks = [h.rank for h in members]
        shared = len(members) > 1 and share is not False and not device_staging
        if shared and (first.shm is None or first.shm_free < need):
            why = _no_room(first, len(members), staged_bytes, need)
            if share:
                refused.append((first, why))
            else:
                warnings.append(why + "; they stage a copy each in ordinary memory instead ("
                                f"{len(members)} x {_size(staged_bytes)}). To share one copy, "
                                f"{_fix(first, need)}, or set ROLLOUT_SIDECAR_SHARE_HOST_STAGING"
                                "=false to stage per worker without this warning")
            shared = False
        groups.append(Group(first.dp_index, ranks, first.host, shared))
    if refused:
        tightest = min((h for h, _ in refused), key=lambda h: h.shm_free)
        raise StagingDoesNotFit(
            "; ".join(why for _, why in refused) + ". share_host_staging=true requires one "
            f"shared staged copy per host: {_fix(tightest, need)}, or unset it to stage per "
            "worker")
    return StagingLayout(groups, need, warnings)


def _no_room(h: WorkerHost, workers: int, staged: int, need: int) -> str:
    if h.shm is None:
        return f"{h.host} has no /dev/shm for the {workers} workers there to share a staged copy"
    return (f"/dev/shm on {h.host} has {_size(max(h.shm_free, 0))} free of "
            f"{_size(h.shm_total)} (less what its files claim: vLLM's queues), and "
            f"one staged copy shared by the {workers} workers there needs {_size(need)} "
            f"({_size(staged)} of weights in the serving dtype plus headroom)")


def _fix(h: WorkerHost, need: int) -> str:
    used = h.shm_total - h.shm_free if h.shm is not None else 0
    return (f"give /dev/shm at least {math.ceil((used + need) / GIB)} GiB ({SHM_SETTINGS}; "
            "docs/deploy.md, \"Sizing /dev/shm\")")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.0f} MiB"


async def survey(llm: WorkerRpc) -> list[WorkerHost]:
    """Every worker's report of its host (SideOp.HOST)."""
    replies: list[Host] = await ops.call(llm, SideOp.HOST)
    return [WorkerHost(r.rank, r.dp_index, r.host, r.shm, r.shm_free, r.shm_total, r.net)
            for r in replies]


async def assign(llm: WorkerRpc, layout: StagingLayout, boot_id: str) -> None:
    """Give every worker its role (SideOp.LAYOUT; worker/host_share.py)."""
    await ops.send(llm, Layout(roles=layout.roles(), boot_id=boot_id))
