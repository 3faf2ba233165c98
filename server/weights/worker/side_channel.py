"""The side channel of our transfer engine: the `SideOp`s, which run outside
vLLM's weight-update session while generation goes on (connection and
receive state, polled; a relabel; the staging layout; the host survey; a
peer's read of the staged copy). One handler per op, in one table
(`SideChannel.side_call`); each answers with its op's reply fields
(server/weights/worker_replies.py), which worker_calls.py wraps.

A mixin of transfer_engine.StagedWeightTransferEngine: it reads and sets the
engine's staging, resident copy, role and connection (declared below), and
the receive state the engine keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout_sidecar.server.weights.ops import SideOp
from rollout_sidecar.server.weights.worker.host_share import StagingRole, host_view
from rollout_sidecar.server.weights.worker_requests import Layout, Read, Relabel, parse_as

if TYPE_CHECKING:
    from vllm.config import ParallelConfig

    from rollout_sidecar.server.weights.worker.group_membership import (
        GroupMembership,
        StagedInitInfo,
    )
    from rollout_sidecar.server.weights.worker.patching import ResidentCopy
    from rollout_sidecar.server.weights.worker.staging import Staging
    from rollout_sidecar.server.weights.worker_requests import Open


class SideChannel:
    # The engine's (transfer_engine.py).
    staging: Staging
    patches: Staging
    delta: Staging
    resident: ResidentCopy
    role: StagingRole
    connection: GroupMembership
    parallel_config: ParallelConfig
    _push: Open | None

    def side_call(self, op: str, payload: dict) -> dict:
        handlers: dict[SideOp, Callable[[dict], dict]] = {
            SideOp.CONNECT: self._connect, SideOp.STATE: lambda _: self._state(),
            SideOp.DISCONNECT: self._disconnect, SideOp.RELABEL: self._relabel,
            SideOp.LAYOUT: self._layout, SideOp.HOST: self._host, SideOp.READ: self._read}
        return handlers[SideOp(op)](payload)

    def _connect(self, payload: dict) -> dict:
        self.init_transfer_engine(self.parse_init_info(payload))
        return self._state()

    def _disconnect(self, _: dict) -> dict:
        self.shutdown()
        return self._state()

    def _relabel(self, payload: dict) -> dict:
        """An unchanged push: the staged copy of `base` is `version` too."""
        r = parse_as(Relabel, payload)
        if self._push is not None:
            raise RuntimeError("relabel while a push is staged")
        self.resident.require(r.base)
        self.resident.version = r.version
        return self._state()

    def _layout(self, payload: dict) -> dict:
        """Stage as this worker's role says from now on (host_share.py);
        between pushes."""
        layout = parse_as(Layout, payload)
        if self._push is not None:
            raise RuntimeError("layout while a push is staged")
        role = StagingRole.assigned(layout, self._worker_rank())
        self.shutdown()
        for s in (self.staging, self.patches, self.delta):
            s.drop_pool()
        self.resident.version = None
        self.role = role
        self.staging.share(role.buffers, "staging")
        self.patches.share(role.buffers, "patches")
        return self._state()

    def _host(self, _: dict) -> dict:
        return {**host_view(), "dp_index": self.parallel_config.data_parallel_index}

    def _read(self, payload: dict) -> dict:
        """The staged copy for a peer (worker_requests.Read), from worker rank
        0 (the others answer empty): it holds version `resident.version` bit
        for bit, or there is nothing to read."""
        if self._worker_rank() != 0:
            return {}
        request = parse_as(Read, payload)
        version = self.resident.version
        if self._push is not None or version is None:
            raise RuntimeError("no complete version is staged here (a push is under way, or "
                               "none since the start)")
        if request.bucket is None:
            return {"version": version, "manifest": [
                {"index": b.index, "nbytes": b.nbytes,
                 "params": [p.model_dump(exclude_none=True) for p in b.params]}
                for b in self.staging.buckets]}
        if not 0 <= request.bucket < len(self.staging.buckets):
            raise ValueError(f"bucket {request.bucket} is not in the staged copy "
                             f"({len(self.staging.buckets)} buckets)")
        self.staging.attach()  # shared staging: the leader's files, mapped
        try:
            data = self.staging.bucket_bytes(request.bucket)  # scattered: read back
            return {"version": version, "data": data.cpu().numpy().tobytes()}
        finally:
            self.staging.detach()

    def _state(self) -> dict:
        error = self._error
        recv = "failed" if error else "running" if self._receiving() else "idle"
        return {"connection": self.connection.state(), "receive": recv,
                "receive_error": str(error) if error else None,
                "staged_bytes": self.staged_bytes}

    @property
    def staged_bytes(self) -> int:
        """Staging buffers held: the staged copy, patches, pooled buffers."""
        return self.staging.held_bytes + self.patches.held_bytes + self.delta.held_bytes

    # The engine's, used here.
    if TYPE_CHECKING:
        @property
        def _error(self) -> BaseException | None: ...

        def init_transfer_engine(self, init_info: StagedInitInfo) -> None: ...
        def parse_init_info(self, init_dict: dict[str, Any]) -> StagedInitInfo: ...
        def shutdown(self) -> None: ...
        def _worker_rank(self) -> int: ...
        def _receiving(self) -> bool: ...
