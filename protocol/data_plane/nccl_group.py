"""The data plane's NCCL group, on our own communicator (nccl_library.py):
formed through the connection's rendezvous store, every wait bounded by our
deadline, every failure ended by `ncclCommAbort`, and no PyTorch watchdog or
heartbeat monitor anywhere near it, so a failed push can never take a
trainer or a vLLM worker down.

Forming it, every rank:
1. writes its presence and its NCCL version (`nccl/rank/<r>`);
2. rank 0 waits for every rank's, then either publishes a fresh unique id
   (`nccl/id`) or, if the versions differ, the reason (NCCL >= 2.23 refuses
   peers of another version, init.cc); the others wait for it. So rank 0 never
   enters NCCL's bootstrap for ranks that will not come (a refused connect
   ends on the store's abort marker, which the waits poll), and no bootstrap
   thread is left waiting for them (`ncclGetUniqueId` starts one that waits
   until every rank connected);
3. all init the communicator, nonblocking, on this thread's CUDA device, and
   poll it until ready or the deadline.

Every operation runs on the group's own stream after the caller's current
stream, and returns a work whose `wait()` polls the stream's event and the
communicator's async error (a peer that died on the socket transport reports
`ncclRemoteError`; on P2P or shared memory nothing does, and the deadline
finds it) until done, a failure or `op_timeout_s`; a failure aborts the
communicator, which makes a kernel still waiting on the dead peer return, and
raises naming it. One lock per communicator: NCCL has none, and an abort
frees it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from typing import Any

import torch

from rollout_sidecar.protocol.data_plane.nccl_library import (
    IN_PROGRESS,
    SUCCESS,
    NcclError,
    UniqueId,
    library,
)

SENDER_RANK = 0
ID_KEY = "nccl/id"
_ID, _REFUSED = b"I", b"E"  # what `ID_KEY` holds: a unique id, or why there is none
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.005
ABORT_JOIN_S = 5.0  # an abort that takes longer goes on in its thread


class NcclVersionMismatch(NcclError):
    """The ranks load different NCCL versions, which cannot connect."""


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() > self.at


def _check_bucket(buf: torch.Tensor) -> None:
    if not buf.is_cuda or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError("an NCCL bucket is a contiguous uint8 CUDA tensor")


def rank_key(rank: int) -> str:
    return f"nccl/rank/{rank}"


class NcclGroup:
    """A formed communicator with the interface of bucket_group's groups."""

    def __init__(self, comm: Any, device: torch.device, op_timeout_s: float) -> None:
        self._comm = comm
        self._lock = threading.Lock()
        self.device = device
        self.op_timeout_s = op_timeout_s
        self.stream = torch.cuda.Stream(device)
        self.error: str | None = None

    def broadcast(self, buf: torch.Tensor) -> NcclWork:
        """Start a broadcast of `buf` (a flat uint8 CUDA tensor) from rank 0."""
        _check_bucket(buf)
        return self._launch("broadcast", [buf], lambda lib, comm, stream: lib.broadcast(
            buf.data_ptr(), buf.numel(), SENDER_RANK, comm, stream))

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> NcclWork:
        """Start sends and receives, each `(flat uint8 CUDA tensor, peer
        rank)`, as one fused NCCL group: they progress side by side (a relay
        passes the last pieces on while the next ones arrive, from several
        senders at once). Between two ranks NCCL matches them in the order
        they are posted, as gloo does."""
        for buf, _ in sends + recvs:
            _check_bucket(buf)
        return self._launch(
            "send/receive", [b for b, _ in sends + recvs],
            lambda lib, comm, stream: lib.exchange(
                [(b.data_ptr(), b.numel(), peer) for b, peer in sends],
                [(b.data_ptr(), b.numel(), peer) for b, peer in recvs], comm, stream))

    def send(self, piece: torch.Tensor, to_rank: int) -> NcclWork:
        return self.exchange([(piece, to_rank)], [])

    def recv(self, piece: torch.Tensor, from_rank: int) -> NcclWork:
        return self.exchange([], [(piece, from_rank)])

    def barrier(self) -> NcclWork:
        return self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))

    def _launch(self, what: str, buffers: list[torch.Tensor], call: Any) -> NcclWork:
        """Run `call` on the group's stream, after the caller's current one."""
        deadline = Deadline(self.op_timeout_s)
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            for buf in buffers:  # the allocator keeps them until our stream is done
                buf.record_stream(self.stream)
            self._call(lambda lib, comm: call(lib, comm, self.stream.cuda_stream), what,
                       deadline)
            event = torch.cuda.Event()
            event.record(self.stream)
        return NcclWork(self, event, deadline, what)

    def _call(self, call: Any, what: str, deadline: Deadline) -> None:
        """Run one NCCL call on the communicator and wait until NCCL took it
        (nonblocking: a call may return in progress, and the next one must
        not start before it is done)."""
        with self._lock:
            comm = self._live(what)
            try:
                result = call(library(), comm)
            except NcclError as e:
                self._abort_locked(f"{what}: {e}")
                raise
        while result == IN_PROGRESS:
            result = self._state(what, deadline)

    def _state(self, what: str, deadline: Deadline) -> int:
        """The communicator's async state; a failure or the deadline aborts it."""
        with self._lock:
            comm = self._live(what)
            try:
                state = library().async_error(comm)
                if state not in (SUCCESS, IN_PROGRESS):
                    library().check(state, what, comm)
            except NcclError as e:
                self._abort_locked(f"{what}: {e}")
                raise
            if state == IN_PROGRESS and deadline.passed:
                why = f"{what}: not done within {deadline.seconds:.0f}s (a peer stalled or died)"
                self._abort_locked(why)
                raise TimeoutError(why)
        if state == IN_PROGRESS:
            time.sleep(POLL_MIN_S)
        return state

    def _live(self, what: str) -> Any:
        if self._comm is None:
            raise NcclError(f"{what}: the NCCL group was aborted"
                            + (f" ({self.error})" if self.error else ""))
        return self._comm

    def _abort_locked(self, why: str) -> None:
        comm, self._comm = self._comm, None
        if comm is None:
            return
        self.error = self.error or why
        # ncclCommAbort waits for the kernels to leave (they poll its flag);
        # one stuck behind other GPU work must not hold the caller forever.
        t = threading.Thread(target=library().abort, args=(comm,), daemon=True,
                             name="rollout-sidecar-nccl-abort")
        t.start()
        t.join(ABORT_JOIN_S)

    def abort(self, why: str = "aborted") -> None:
        with self._lock:
            self._abort_locked(why)

    def close(self) -> None:
        """End the group now (idempotent): abort, as a destroy could wait on
        a kernel that will never finish."""
        self.abort("closed")


class NcclWork:
    """One operation in flight on the group's stream."""

    def __init__(self, group: NcclGroup, event: torch.cuda.Event, deadline: Deadline,
                 what: str = "broadcast") -> None:
        self.group = group
        self.event = event
        self.deadline = deadline
        self.what = what

    def wait(self, timeout: Any = None) -> None:
        """Until the operation is done; raises (the group aborted) if the
        communicator failed or the group's deadline passed first."""
        pause = POLL_MIN_S
        while not self.event.query():
            self.group._state(self.what, self.deadline)
            if self.deadline.passed:  # the kernel waits on a peer that sends nothing
                self.group.abort(f"{self.what}: not done within {self.deadline.seconds:.0f}s "
                                 "(a peer stalled or died)")
                raise TimeoutError(self.group.error)
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        # Done on the device: the caller's stream may use the buffer now.
        torch.cuda.current_stream(self.group.device).wait_event(self.event)


def form(store: Any, rank: int, world_size: int, device: torch.device, timeout_s: float,
         op_timeout_s: float) -> NcclGroup:
    """Rendezvous through `store` (module docstring) and init the
    communicator on `device`; raises on a version mismatch, the deadline, an
    abort marker (a signed store's wait reports it) or NCCL's own error."""
    lib = library()
    deadline = Deadline(timeout_s)
    uid = rendezvous(store, rank, world_size, lib, timeout_s)
    with torch.cuda.device(device):  # NCCL inits on the calling thread's device
        comm, result = lib.init_rank(world_size, uid, rank)
        group = NcclGroup(comm, device, op_timeout_s)
        with contextlib.ExitStack() as failed:
            failed.callback(group.abort, "init failed")
            while result == IN_PROGRESS:
                result = group._state("ncclCommInitRankConfig", deadline)
            failed.pop_all()
    return group


def rendezvous(store: Any, rank: int, world_size: int, lib: Any, timeout_s: float
               ) -> UniqueId:
    """Steps 1 and 2 of the module docstring: the communicator's unique id,
    once every rank is there with the same NCCL version."""
    store.set(rank_key(rank), str(lib.version))
    if rank == SENDER_RANK:
        store.wait([rank_key(r) for r in range(world_size)],
                   datetime.timedelta(seconds=timeout_s))
        versions = {r: int(store.get(rank_key(r))) for r in range(world_size)}
        if len(set(versions.values())) > 1:
            why = _mismatch(versions)
            store.set(ID_KEY, _REFUSED + why.encode())
            raise NcclVersionMismatch(why)
        store.set(ID_KEY, _ID + lib.unique_id().to_bytes())
    got = bytes(store.get(ID_KEY))
    if got[:1] == _REFUSED:
        raise NcclVersionMismatch(got[1:].decode(errors="replace"))
    return UniqueId.from_bytes(got[1:])


def _mismatch(versions: dict[int, int]) -> str:
    def text(v: int) -> str:
        major, rest = divmod(v, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"

    seen = ", ".join(f"rank {r}: {text(v)}" for r, v in sorted(versions.items()))
    return (f"the data-plane ranks load different NCCL versions ({seen}), and NCCL connects "
            "only ranks of one version: give the trainer the NCCL of the server's torch "
            "(or point VLLM_NCCL_SO_PATH at one copy on both sides), or push over gloo "
            "(WeightPusher(transport=\"gloo\"))")
