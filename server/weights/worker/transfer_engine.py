"""Our vLLM `WeightTransferEngine`: receive into staging, check, load on commit.

Runs inside the vLLM worker process. The API process drives it with
`WorkerOp`s and `SideOp`s through the worker method our plugin adds, which
answers every call with a value (worker_calls.py, ops.py); a `WorkerOp`'s typed
request (worker_requests.py) reaches `receive_weights` through vLLM's
`update_weights`, inside its update session, which dispatches on its type.
The model changes only in a `Load`, and only with a complete,
CRC-checked set of buckets; the load itself is all-or-nothing (reload.py).
`finish_weight_update` releases the patches and forgets the push, so a later
`discard` leaves the staged copy alone: it stays, the base of the next delta.
The `SideOp`s, outside the session, are side_channel.py's.

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
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from rollout_sidecar.protocol.data_plane.bucket_check import DEFAULT_CHECK
from rollout_sidecar.protocol.failpoints import fire
from rollout_sidecar.protocol.schema import Check as CheckName  # a request is `Check` here
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.server.weights.ops import WorkerOp
from rollout_sidecar.server.weights.worker.adapter_loading import (
    split_adapter,
    stage_adapter,
)
from rollout_sidecar.server.weights.worker.bucket_receive import ReceiveThread
from rollout_sidecar.server.weights.worker.draft_loading import draft_load, split_draft
from rollout_sidecar.server.weights.worker.group_membership import GroupMembership, StagedInitInfo
from rollout_sidecar.server.weights.worker.host_share import StagingRole
from rollout_sidecar.server.weights.worker.load_failpoints import (
    corrupt_arrived,
    loaded_with_failpoints,
)
from rollout_sidecar.server.weights.worker.patching import ResidentCopy, apply_patches
from rollout_sidecar.server.weights.worker.receive_paths import HttpStage, ReceivePath
from rollout_sidecar.server.weights.worker.reload import LoadRefused, load_all_or_nothing
from rollout_sidecar.server.weights.worker.side_channel import SideChannel
from rollout_sidecar.server.weights.worker.staging import Staging
from rollout_sidecar.server.weights.worker_requests import (
    Check,
    Load,
    Open,
    Patch,
    SideRequest,
    Stage,
    WorkerRequest,
    parse,
)

log = logging.getLogger(__name__)


class StagedWeightTransferEngine(SideChannel, WeightTransferEngine[StagedInitInfo, Any]):
    init_info_cls = StagedInitInfo
    # vLLM loads a drafter in a session of its own; ours loads with the target
    # (draft_loading.py), so vLLM's separate draft update stays off.
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
        self._push: Open | None = None  # the request that opened the push
        self.connection = GroupMembership()
        self._receiver: ReceiveThread | None = None  # this push's, once it receives
        self._patched = False  # a delta's patches are in the staged copy (PATCH)
        self._checked = False
        # The speculative drafter's model and config, if any (draft_loading.py);
        # worker_calls.py binds it, since vLLM hands an engine the target alone.
        self.drafter: tuple[torch.nn.Module, Any] | None = None

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
        return self._push is not None and self._push.adapter_only

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

    def update_weights(self, update_info: WorkerRequest | dict[str, Any]) -> None:
        # Overrides the base, which calls torch.accelerator.synchronize(): that
        # raises on CPU, and our receive is synchronous per bucket anyway.
        request = (update_info if not isinstance(update_info, dict)
                   else self.parse_update_info(update_info))
        try:
            self.receive_weights(request)
        except BaseException:
            self.discard()
            raise

    def parse_update_info(self, update_dict: dict[str, Any]) -> WorkerRequest:
        """A dict as vLLM's own routes would pass it: `{"op": ..., **fields}`."""
        fields = dict(update_dict)
        request = parse(WorkerOp(fields.pop("op")), fields)
        if isinstance(request, SideRequest):  # parse gives a WorkerOp its own request
            raise ValueError(f"{request.op.value} is not a weight update")
        return request

    def receive_weights(self, request: WorkerRequest) -> None:
        if self._follower and isinstance(request, Open | Stage | Check):
            # The leader receives and checks; a follower only keeps the layout.
            if isinstance(request, Open):
                self._allocate(request, torch.device("cpu"))
            self._checked = isinstance(request, Check)
            return
        match request:
            case Open():  # the push's transport's receive path (protocol/transports.py)
                path: ReceivePath = transport(request.transport).receive_class()(
                    self.connection, self.device)
                self._allocate(request, path.staging_device(small=request.small))
                self._receiver = path.start(self.incoming, request.check)
            case Stage():
                HttpStage.stage(self.incoming, request.bucket, request.data, self._check_name,
                                self._mac_key)
            case Patch():
                self._patch()
            case Check():
                self._check(request)
            case Load():
                self._load_push(request)

    def _check(self, request: Check) -> None:
        if not self._join_receiver(timeout=request.timeout_s):
            raise TimeoutError(f"buckets still arriving after {request.timeout_s:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"receive failed: {self._error}")
        check = self._check_name
        corrupt_arrived(self.incoming, self._worker_rank(), check)
        self._check_macs(request)  # first: a forger fixes the CRC up too
        self.incoming.check(request.checksums, check)
        self._checked = True

    def _load_push(self, request: Load) -> None:
        if not self._checked:
            raise RuntimeError("load before every bucket arrived and passed its CRC")
        self.staging.lent.idle()  # the load's peak: the staged copy and one layer
        self.staging.attach()  # a follower maps the leader's buffers
        self.patches.attach()
        try:
            if self._push is not None and self._push.adapter is not None:
                self._load_adapter(request)
            else:
                self._load()
        finally:
            self.staging.detach()
            self.patches.detach()
        if fire("load.crash", self._worker_rank()) is not None:
            raise RuntimeError("failpoint load.crash: the load failed after the model changed")

    def _allocate(self, request: Open, device: torch.device) -> None:
        if request.delta_base is not None:
            self.resident.require(request.delta_base)
            if not self._follower:  # a follower never reads a delta's patches
                self.delta.allocate(request.buckets(), device)
        elif request.adapter_only:
            self.patches.allocate(request.buckets(), device)  # the staged copy stays
        else:
            self.resident.version = None  # overwritten from here on
            self.staging.allocate(request.buckets(), device)
        self._push = request

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
        target, draft = split_draft(loaded_with_failpoints(
            self.staging.tensors(), self.model_config.model, self._worker_rank()))
        load_all_or_nothing(self.model, self.model_config, target,
                            draft_load(self.drafter, draft))
        self.resident.version = version  # kept: the next delta's base
        self._release_patches()

    def _load_adapter(self, request: Load) -> None:
        """An adapter push: built (and checked) first, then its base weights
        if it carries them; vLLM builds it again at its first request."""
        assert self._push is not None and self._push.adapter is not None
        if request.lora_id is None or request.keep_ids is None:
            raise LoadRefused("an adapter load needs lora_id and keep_ids")
        base, factors = split_adapter(self.incoming.tensors())
        stage_adapter(self.model, factors, self._push.adapter["scaling"], request.lora_id,
                      request.keep_ids)
        if not self._adapter_only:  # the staged copy now holds base + factors: no delta base
            self.resident.version = None
            target, draft = split_draft(loaded_with_failpoints(
                base, self.model_config.model, self._worker_rank()))
            load_all_or_nothing(self.model, self.model_config, target,
                                draft_load(self.drafter, draft))
        self.patches.release()

    def finish_weight_update(self) -> None:
        self._release_patches()  # the staged copy stays resident
        self._push = None

    def _release_patches(self) -> None:
        self.patches.release()
        self.delta.release()

    def _check_macs(self, request: Check) -> None:
        """With a connection secret, every bucket's tag must match: bytes the
        trainer that holds the secret did not send never load."""
        j, key = self.connection.joiner, self._mac_key
        if request.macs is None or request.version is None:
            if key is not None:
                raise ValueError("this connection has a secret: the check needs each bucket's "
                                 "tag (macs) and the version")
            return
        if key is None:
            raise ValueError("bucket tags (macs) sent, but this connection was not made with "
                             "a secret and bucket_macs")
        assert j is not None  # it holds the key
        self.incoming.check_macs(request.macs, key, j.info.connection_id, request.version)

    @property
    def _check_name(self) -> CheckName:
        """The push's bucket check (a trainer from before `check`: CRC-32)."""
        return self._push.check if self._push is not None else DEFAULT_CHECK.name

    @property
    def _mac_key(self) -> bytes | None:
        """The connection's secret, if its buckets are tagged."""
        j = self.connection.joiner
        return j.info.mac_key if j is not None else None

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

