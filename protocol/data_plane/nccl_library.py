"""libnccl through ctypes: the few calls the weight data plane makes, and
nothing of PyTorch's process group around them.

Why not `ProcessGroupNCCL`: its watchdog, on any failed or timed-out work
item, sets a process-wide dump flag (`broadcastDumpSignal`), and the heartbeat
monitor of the process's first NCCL group (in a vLLM worker, vLLM's world
group; in a trainer, FSDP's) then dumps and, `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`
later (480 s), calls `terminateProcess`: a trainer dying mid-push killed a vLLM
worker minutes later, whatever our own group's error handling said
(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: `Watchdog::runLoop`,
`HeartbeatMonitor::runLoop`; every variable involved is read in a
constructor, group 0's before our code runs). vLLM's own NCCL weight
transfer uses its ctypes wrapper (`pynccl_wrapper.py`) for the same reason,
but a trainer has no vLLM, and that wrapper only inits blocking, so a peer
that never comes holds the thread forever. Here the communicator is
nonblocking (`blocking=0`), every call is bounded by our deadline, and a
failure ends in `ncclCommAbort`, which makes a kernel stuck on a dead peer
return (NCCL polls its abort flag in the device loops).

Declarations as in NCCL's nccl.h.in, unchanged from 2.18 to 2.29. The config
is the 2.18 layout with version 2.18.0: NCCL copies min(size, its own) bytes
over its defaults and resets fields newer than `version`, so bytes 44..47
(padding here, `trafficClass` since 2.26) are ignored (init.cc,
`parseCommConfig`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

SUCCESS, IN_PROGRESS = 0, 7
UINT8 = 1  # ncclDataType_t: buckets are flat bytes
UNIQUE_ID_BYTES = 128
_UNDEF_INT = -(2**31)
_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21800  # NCCL_VERSION(2, 18, 0)
_ERRORS = {1: "unhandled CUDA error", 2: "system error", 3: "internal error",
           4: "invalid argument", 5: "invalid usage", 6: "remote error (a peer failed)"}
# Where to find libnccl, as vLLM reads it (vllm/utils/nccl.py, find_nccl_library).
SO_PATH_ENV = "VLLM_NCCL_SO_PATH"


class NcclError(RuntimeError):
    """An NCCL call failed; the message is NCCL's own where it has one."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]

    @classmethod
    def from_bytes(cls, data: bytes) -> UniqueId:
        if len(data) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, not {len(data)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), data, UNIQUE_ID_BYTES)
        return uid

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), UNIQUE_ID_BYTES)


class _Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint),
                ("version", ctypes.c_uint), ("blocking", ctypes.c_int),
                ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p),
                ("splitShare", ctypes.c_int)]


def nonblocking_config() -> _Config:
    c = _Config()  # zero-filled, padding included
    c.size, c.magic, c.version, c.blocking = ctypes.sizeof(c), _MAGIC, _CONFIG_VERSION, 0
    c.cgaClusterSize = c.minCTAs = c.maxCTAs = c.splitShare = _UNDEF_INT
    return c


_COMM = ctypes.c_void_p
_STREAM = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    # The unique id goes by value.
    "ncclCommInitRankConfig": (ctypes.c_int, [ctypes.POINTER(_COMM), ctypes.c_int, UniqueId,
                                              ctypes.c_int, ctypes.POINTER(_Config)]),
    "ncclCommGetAsyncError": (ctypes.c_int, [_COMM, ctypes.POINTER(ctypes.c_int)]),
    "ncclCommAbort": (ctypes.c_int, [_COMM]),
    "ncclBroadcast": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_int, ctypes.c_int, _COMM, _STREAM]),
    "ncclGetLastError": (ctypes.c_char_p, [_COMM]),
    # Point to point (NCCL >= 2.7), for a chain of several senders; fused
    # between ncclGroupStart and ncclGroupEnd, the way vLLM's pynccl.py
    # `batch_isend_irecv` runs a list of them (pynccl_wrapper.py declares the same).
    "ncclSend": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                _COMM, _STREAM]),
    "ncclRecv": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                _COMM, _STREAM]),
    "ncclGroupStart": (ctypes.c_int, []),
    "ncclGroupEnd": (ctypes.c_int, []),
}


def loaded_path() -> str | None:
    """The libnccl already mapped into this process (torch's), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "/libnccl.so" in path:
                    return path
    except OSError:
        pass
    return None


class Library:
    """The loaded libnccl (ctypes releases the GIL around every call)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        v = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value  # e.g. 22809 for 2.28.9

    @property
    def version_text(self) -> str:
        major, rest = divmod(self.version, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"

    def check(self, result: int, call: str, comm: Any = None) -> int:
        """`result` if it is success or in progress, else raise naming the call."""
        if result in (SUCCESS, IN_PROGRESS):
            return result
        detail = self._lib.ncclGetLastError(comm) if hasattr(self, "version") else b""
        raise NcclError(f"{call}: NCCL {_ERRORS.get(result, f'error {result}')}"
                        + (f": {detail.decode(errors='replace')}" if detail else ""))

    def unique_id(self) -> UniqueId:
        uid = UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def init_rank(self, world_size: int, uid: UniqueId, rank: int) -> tuple[Any, int]:
        """Start a nonblocking init on the calling thread's CUDA device:
        (comm, result); poll `async_error` until it is not in progress."""
        comm = _COMM()
        config = nonblocking_config()
        result = self._lib.ncclCommInitRankConfig(ctypes.byref(comm), world_size, uid, rank,
                                                  ctypes.byref(config))
        if result not in (SUCCESS, IN_PROGRESS) and comm.value:
            self._lib.ncclCommAbort(comm)
        return comm, self.check(result, "ncclCommInitRankConfig")

    def async_error(self, comm: Any) -> int:
        state = ctypes.c_int()
        self.check(self._lib.ncclCommGetAsyncError(comm, ctypes.byref(state)),
                   "ncclCommGetAsyncError", comm)
        return state.value

    def broadcast(self, ptr: int, nbytes: int, root: int, comm: Any, stream: int) -> int:
        return self.check(self._lib.ncclBroadcast(ptr, ptr, nbytes, UINT8, root, comm, stream),
                          "ncclBroadcast", comm)

    def exchange(self, sends: list[tuple[int, int, int]], recvs: list[tuple[int, int, int]],
                 comm: Any, stream: int) -> int:
        """One fused launch of point-to-point calls, each `(ptr, nbytes,
        peer)`: they progress side by side. On a nonblocking communicator the
        group's end may return in progress (NCCL's "Nonblocking group
        operation" docs): poll `async_error` before the next call."""
        self.check(self._lib.ncclGroupStart(), "ncclGroupStart", comm)
        try:
            for ptr, nbytes, peer in sends:
                self.check(self._lib.ncclSend(ptr, nbytes, UINT8, peer, comm, stream),
                           "ncclSend", comm)
            for ptr, nbytes, peer in recvs:
                self.check(self._lib.ncclRecv(ptr, nbytes, UINT8, peer, comm, stream),
                           "ncclRecv", comm)
        finally:  # a group left open would swallow the communicator's next call
            ended = self._lib.ncclGroupEnd()
        return self.check(ended, "ncclGroupEnd", comm)

    def abort(self, comm: Any) -> None:
        self._lib.ncclCommAbort(comm)  # frees the comm: the handle is never used again


@functools.cache
def library() -> Library:
    """libnccl: `VLLM_NCCL_SO_PATH` if set (as vLLM), else the one torch loaded,
    else the soname. Call after torch's CUDA is up (it loads torch's copy)."""
    return Library(os.environ.get(SO_PATH_ENV) or loaded_path() or "libnccl.so.2")
