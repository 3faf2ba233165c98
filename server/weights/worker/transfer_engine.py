"""Our vLLM `WeightTransferEngine`: receive into staging, check, load on commit.

Runs inside the vLLM worker process. The API process drives it with
`WorkerOp`s and `SideOp`s through the worker method our plugin adds, which
answers every call with a value (worker_calls.py, ops.py); `WorkerOp`s reach
`receive_weights` through vLLM's `update_weights`, inside its update session.
The model changes only in `WorkerOp.LOAD`, and only with a complete,
CRC-checked set of buckets; the load itself is all-or-nothing (reload.py).
`finish_weight_update` releases the patches and forgets the push, so a later
`discard` leaves the staged copy alone: it stays, the base of the next delta.

How the bytes arrive is the receive path's (receive_paths.py: the trainer's
group, or HTTP bodies). Blocking work (joining the group, receiving buckets)
runs in background threads (bucket_receive.py), so the engine core keeps
scheduling generation meanwhile; each sets this worker's CUDA device first.

Roles: when TP workers share a staged copy (host_share.py; who does is decided
at start, server/weights/staging_layout.py, and arrives as SideOp.LAYOUT), the
first worker (the leader) joins the group, receives, checks and patches; the
others (followers) take part in every op but only map the leader's buffers at
the load. Otherwise every worker is its own leader. A delta's patches stay in
the leader's own memory: only it reads them (PATCH), so /dev/shm holds one
staged copy and an adapter's factors, never a delta besides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferUpdateInfo,
)

from rollout_sidecar.protocol.schema import BucketManifest
from rollout_sidecar.server.weights.ops import SideOp, WorkerOp
from rollout_sidecar.server.weights.worker.adapter_loading import (
    split_adapter,
    stage_adapter,
)
from rollout_sidecar.server.weights.worker.bucket_receive import Receive
from rollout_sidecar.server.weights.worker.fault_injection import (
    apply_test_faults,
    corrupt_arrived,
    crash_after_load,
)
from rollout_sidecar.server.weights.worker.group_membership import GroupMembership, StagedInitInfo
from rollout_sidecar.server.weights.worker.host_share import StagingRole, host_view
from rollout_sidecar.server.weights.worker.patching import ResidentCopy, apply_patches
from rollout_sidecar.server.weights.worker.receive_paths import GroupReceive, HttpStage
from rollout_sidecar.server.weights.worker.reload import LoadRefused, load_all_or_nothing
from rollout_sidecar.server.weights.worker.staging import Staging

log = logging.getLogger(__name__)


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    op: str
    manifest: list[dict] | None = None
    checksums: list[int] | None = None
    bucket: int | None = None
    data: bytes | None = None
    timeout_s: float = 300.0
    macs: list[str] | None = None  # CHECK: each bucket's tag (with a secret)
    version: int | None = None  # CHECK: bound into the tags; RECEIVE/ALLOCATE, LOAD
    delta_base: int | None = None  # RECEIVE/ALLOCATE: a delta push's base (patching.py)
    adapter: dict | None = None  # RECEIVE/ALLOCATE: a LoRA adapter push's AdapterSpec
    lora_id: int | None = None  # LOAD of an adapter push: its vLLM LoRA id
    keep_ids: list[int] | None = None  # LOAD of an adapter push: the ids kept loaded


class StagedWeightTransferEngine(WeightTransferEngine[StagedInitInfo, StagedUpdateInfo]):
    init_info_cls = StagedInitInfo
    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `staging` holds a dense push's buckets, and after its load stays
        # resident: the version a delta applies to. `delta` holds a delta's
        # patches (the leader's alone), `patches` an adapter's factors.
        self.staging = Staging(pinned=True)  # the only one copied to the GPU whole
        self.patches = Staging()
        self.delta = Staging()
        self.role = StagingRole.alone(self._worker_rank())
        self.resident = ResidentCopy()
        self._push: StagedUpdateInfo | None = None  # the push's RECEIVE/ALLOCATE
        self.connection = GroupMembership()
        self._receiver: Receive | None = None  # this push's, once it receives
        self._patched = False  # a delta's patches are in the staged copy (PATCH)
        self._checked = False

    # ------------------------------------------------------------ side channel

    def side_call(self, op: str, payload: dict) -> dict:
        op = SideOp(op)
        if op is SideOp.CONNECT:
            self.init_transfer_engine(self.parse_init_info(payload))
        elif op is SideOp.DISCONNECT:
            self.shutdown()
        elif op is SideOp.RELABEL:
            if self._push is not None:
                raise RuntimeError("relabel while a push is staged")
            self.resident.require(payload["base"])
            self.resident.version = payload["version"]
        elif op is SideOp.HOST:
            return {**host_view(), "dp_index": self.parallel_config.data_parallel_index}
        elif op is SideOp.LAYOUT:
            self._take_role(StagingRole.assigned(payload, self._worker_rank()))
        return self._state()

    def _take_role(self, role: StagingRole) -> None:
        """Stage as `role` says from now on (host_share.py); between pushes."""
        if self._push is not None:
            raise RuntimeError("layout while a push is staged")
        self.shutdown()
        for s in (self.staging, self.patches, self.delta):
            s.drop_pool()
        self.resident.version = None
        self.role = role
        self.staging.shared = role.buffers("staging")
        self.patches.shared = role.buffers("patches")

    def _state(self) -> dict:
        recv = "failed" if self._error else "running" if self._receiving() else "idle"
        return {"connection": self.connection.state(), "receive": recv,
                "receive_error": str(self._error) if self._error else None,
                "staged_bytes": self.staged_bytes}

    @property
    def staged_bytes(self) -> int:
        """Staging buffers held: the staged copy, patches, pooled buffers."""
        return self.staging.held_bytes + self.patches.held_bytes + self.delta.held_bytes

    # --------------------------------------------------------------- connection

    def init_transfer_engine(self, init_info: StagedInitInfo) -> None:
        """Start joining the trainer's group and return at once."""
        self.shutdown()
        self.connection.open(init_info, self.role.plane_rank, self.device)

    def _worker_rank(self) -> int:
        # vLLM's numbering (nccl_common.worker_init_process_group): unique
        # across data-parallel groups, TP x PP ranks within each.
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    @property
    def _follower(self) -> bool:
        """This worker's buffers are another worker's (host_share.py)."""
        return self.role.follows

    @property
    def _error(self) -> BaseException | None:
        return self._receiver.error if self._receiver is not None else None

    @property
    def group(self) -> Any:
        return self.connection.group

    @property
    def backend(self) -> str:
        return self.connection.backend

    def shutdown(self) -> None:
        self._join_receiver(timeout=1.0)
        self.connection.close()

    # ------------------------------------------------------------------ session

    @property
    def _delta_base(self) -> int | None:
        return self._push.delta_base if self._push is not None else None

    @property
    def _adapter_only(self) -> bool:
        """An adapter over the weights already loaded: the staged copy stays."""
        a = self._push.adapter if self._push is not None else None
        return a is not None and a.get("base_version") is not None

    @property
    def incoming(self) -> Staging:
        """Where this push's buckets land."""
        if self._delta_base is not None:
            return self.delta
        return self.patches if self._adapter_only else self.staging

    def start_weight_update(self) -> None:
        self._receiver = None  # a stale one ends alone, on its dropped group
        self._checked = False
        self._patched = False
        self._push = None
        self._release_patches()  # the staged copy stays: a delta may apply to it

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Overrides the base, which calls torch.accelerator.synchronize(): that
        # raises on CPU, and our receive is synchronous per bucket anyway.
        info = self.parse_update_info(update_info)
        try:
            self.receive_weights(info)
        except BaseException:
            self.discard()
            raise

    def receive_weights(self, info: StagedUpdateInfo) -> None:
        op = WorkerOp(info.op)
        if self._follower and op in (WorkerOp.RECEIVE, WorkerOp.STAGE, WorkerOp.CHECK):
            # The leader receives and checks; a follower only keeps the layout.
            if op is WorkerOp.RECEIVE:
                self._allocate(info, torch.device("cpu"))
            self._checked = op is WorkerOp.CHECK
            return
        if op is WorkerOp.ALLOCATE:
            self._allocate(info, HttpStage.staging_device)
        elif op is WorkerOp.RECEIVE:
            path = GroupReceive(self.connection, self.device)
            # Patches (a delta's, an adapter's) are small and applied on the host.
            self._allocate(info, path.staging_device(
                small=info.delta_base is not None or info.adapter is not None))
            self._receiver = path.start(self.incoming.buckets)
        elif op is WorkerOp.STAGE:
            HttpStage.stage(self.incoming.buckets, info.bucket, info.data)
        elif op is WorkerOp.PATCH:
            self._patch()
        elif op is WorkerOp.CHECK:
            if not self._join_receiver(timeout=info.timeout_s):
                raise TimeoutError(f"buckets still arriving after {info.timeout_s:.0f}s")
            if self._error is not None:
                raise RuntimeError(f"receive failed: {self._error}")
            if self.incoming.buckets and corrupt_arrived(self.incoming.buckets[0].buffer,
                                                         self._worker_rank()):
                self.incoming.buckets[0].checksum = None  # recomputed: sees the fault
            self._check_macs(info)  # first: a forger fixes the CRC up too
            self.incoming.check(info.checksums or [])
            self._checked = True
        elif op is WorkerOp.LOAD:
            if not self._checked:
                raise RuntimeError("load before every bucket arrived and passed its CRC")
            self.staging.attach()  # a follower maps the leader's buffers
            self.patches.attach()
            try:
                if self._push is not None and self._push.adapter is not None:
                    self._load_adapter(info)
                else:
                    self._load()
            finally:
                self.staging.detach()
                self.patches.detach()
            crash_after_load(self._worker_rank())

    def _allocate(self, info: StagedUpdateInfo, device: torch.device) -> None:
        if info.delta_base is not None:
            self.resident.require(info.delta_base)
            if not self._follower:  # a follower never reads a delta's patches
                self.delta.allocate(_manifest(info), device)
        elif info.adapter is not None and info.adapter.get("base_version") is not None:
            self.patches.allocate(_manifest(info), device)  # the staged copy stays
        else:
            self.resident.version = None  # overwritten from here on
            self.staging.allocate(_manifest(info), device)
        self._push = info

    def _patch(self) -> None:
        """Apply a delta into the staged copy, which then holds neither version
        until the load ends; a step of its own before the load, so that no
        follower reads the leader's copy half patched. The model is untouched."""
        base = self._delta_base
        if base is None or not self._checked:
            raise RuntimeError("patch: no checked delta push is staged")
        self.resident.require(base)
        self.resident.version = None
        if not self._follower:
            apply_patches(self.delta, self.staging)
        self._patched = True

    def _load(self) -> None:
        """Load every staged tensor (a delta's patched in by PATCH)."""
        version = self._push.version if self._push else None
        if self._delta_base is not None and not self._patched:
            raise LoadRefused("a delta's load needs its patches applied first (PATCH)")
        self.resident.version = None
        weights = apply_test_faults(self.staging.tensors(), self.model_config.model,
                                    self._worker_rank())
        load_all_or_nothing(self.model, self.model_config, weights)
        self.resident.version = version  # kept: the next delta's base
        self._release_patches()

    def _load_adapter(self, info: StagedUpdateInfo) -> None:
        """An adapter push: built (and checked) first, then its base weights
        if it carries them; vLLM builds it again at its first request."""
        assert self._push is not None and self._push.adapter is not None
        if info.lora_id is None or info.keep_ids is None:
            raise LoadRefused("an adapter load needs lora_id and keep_ids")
        base, factors = split_adapter(self.incoming.tensors())
        stage_adapter(self.model, factors, self._push.adapter["scaling"], info.lora_id,
                      info.keep_ids)
        if not self._adapter_only:  # the staged copy now holds base + factors: no delta base
            self.resident.version = None
            load_all_or_nothing(self.model, self.model_config,
                                apply_test_faults(base, self.model_config.model,
                                                  self._worker_rank()))
        self.patches.release()

    def finish_weight_update(self) -> None:
        self._release_patches()  # the staged copy stays resident
        self._push = None

    def _release_patches(self) -> None:
        self.patches.release()
        self.delta.release()

    def _check_macs(self, info: StagedUpdateInfo) -> None:
        """With a connection secret, every bucket's tag must match: bytes the
        trainer that holds the secret did not send never load."""
        j = self.connection.joiner
        key = j.info.mac_key if j is not None else None
        if info.macs is None or info.version is None:
            if key is not None:
                raise ValueError("this connection has a secret: the check needs each bucket's "
                                 "tag (macs) and the version")
            return
        if key is None:
            raise ValueError("bucket tags (macs) sent, but this connection was not made with "
                             "a secret and bucket_macs")
        self.incoming.check_macs(info.macs, key, j.info.connection_id, info.version)

    # ---------------------------------------------------------------- internals

    def _receiving(self) -> bool:
        return self._receiver is not None and self._receiver.is_alive()

    def discard(self) -> None:
        """Drop the staged push, if any. A receive thread still blocked in recv
        may yet write into its buffers, so those are not pooled, and the group
        (now out of step with the trainer) is dropped: the trainer reconnects."""
        if self._push is None:  # nothing staged: the resident copy stays a delta's base
            self._receiver = None
            return
        self._checked = False
        if self._delta_base is None and not self._adapter_only:
            self.resident.version = None  # a dense push's receive overwrote it
        rx, self._receiver = self._receiver, None
        if rx is None or not rx.is_alive():
            self.incoming.release()
        else:
            self.incoming.drop_pool()
            if rx.group is self.group:  # out of step with the trainer; a stale one's is gone
                self.connection.drop_group()
        self._release_patches()
        self._push = None

    def _join_receiver(self, timeout: float) -> bool:
        if self._receiver is not None:
            self._receiver.join(timeout)
        return not self._receiving()


def _manifest(info: StagedUpdateInfo) -> list[BucketManifest]:
    # Dicts across vLLM's RPC (validated once already, at begin).
    return [BucketManifest.model_validate(b) for b in info.manifest or []]
