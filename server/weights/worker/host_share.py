"""One staged copy per host: the TP workers of one engine share the leader's.

Every worker loads its own shard of a push, but each used to receive and keep
the whole unsharded push (the staged copy stays after the load: the next
delta's base), so a host held TP copies: a 70B model at TP=8 over a terabyte.
Now, when an engine's workers all run on one host and stage in host memory,
only its first worker (the leader) joins the data plane and receives, into
buffers backed by files in /dev/shm; at a load the other workers (followers)
map the same files and read their shards from them. A delta's patches are
applied by the leader alone, in a step before the load (WorkerOp.PATCH), so no
follower reads a half-patched copy.

One writer per file: the leader. When it cannot be sure a buffer has no
writer left (a receive still blocked on a dead trainer), it unlinks the file
and makes the next push a new one, so a late write lands in memory nobody
reads; followers map the files afresh at every load and unmap them after it.

Who shares is decided once, at start (server/weights/staging_layout.py), from
what each worker reports of its host here (`host_view`): workers share exactly
when they see the same /dev/shm (the same boot and the same mount), which
holds across vLLM's multi-node executor, Ray and containers, where vLLM's own
`nnodes_within_dp` stays 1 under Ray even across hosts. A host whose /dev/shm
cannot hold a staged copy is found then, not by a push: its workers stage
their own copies (or the server refuses to start, if sharing was required).

Not shared: device staging (each GPU needs its copy in its own memory).
/dev/shm must hold the staged copy: Docker caps it at 64 MB unless
`shm_size` is set (deploy/docker-compose.yml sets it from SHM_SIZE; the
chart mounts a memory volume of `shm.sizeLimit` there).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollout_sidecar.server.weights.worker_requests import Layout

SHM = Path("/dev/shm")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
NET_NS = Path("/proc/self/ns/net")


def host_view() -> dict:
    """What this process sees of its host: `shm`, an id equal for exactly the
    processes that share one /dev/shm (the kernel's boot id, which differs
    between hosts and is the host's inside a container, and the mount's
    device number, which differs between two tmpfs mounts on one host), or
    None without one; the room there (`shm_free`, `shm_total`, bytes); `net`,
    an id equal for exactly the processes that share a network stack (boot id
    and network namespace: loopback reaches between them); and the host's
    name, for messages.

    `shm_free` is what is free less what files there already claim without
    holding it yet (below 0 when they claim more than is free): vLLM's
    message queues are sparse segments (at TP=2 on CPU, 664 MiB of them held
    0.1 MiB after the start), whose pages fill as its ring buffers go round;
    a staged copy that took those pages would turn vLLM's later writes into
    SIGBUS. Ours are reserved at once (posix_fallocate in
    `SharedBuffers.buffer`)."""
    host = socket.gethostname()
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:  # not Linux: the name has to do
        boot = host
    try:
        net = f"{boot}:{os.stat(NET_NS).st_ino}"
    except OSError:
        net = boot
    try:
        st, vfs = os.stat(SHM), os.statvfs(SHM)
    except OSError:
        return {"host": host, "net": net, "shm": None, "shm_free": 0, "shm_total": 0}
    free = vfs.f_bavail * vfs.f_frsize - _claimed(SHM)
    return {"host": host, "net": net, "shm": f"{boot}:{st.st_dev}", "shm_free": free,
            "shm_total": vfs.f_blocks * vfs.f_frsize}


def _claimed(directory: Path) -> int:
    """Bytes the files in `directory` may still take: their holes."""
    held = 0
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for e in entries:
            with contextlib.suppress(OSError):
                if e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    held += max(st.st_size - st.st_blocks * 512, 0)
    return held


class StagingRoot:
    """This server's shared staging directory: created at start, removed at
    exit, and held under an exclusive lock for the server's life, so that a
    server starting later removes the directories of servers that died
    without cleaning up (SIGKILL) and never one still running (a lock, not a
    pid: containers sharing /dev/shm have pid namespaces of their own)."""

    LOCK = "owner.lock"

    def __init__(self, boot_id: str) -> None:
        self.path = SHM / f"rollout-sidecar-{boot_id}"
        self._lock_fd: int | None = None

    def create(self) -> None:
        for d in SHM.glob("rollout-sidecar-*"):
            if d != self.path and _unowned(d):
                shutil.rmtree(d, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / self.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def adopt(self) -> None:
        """A leader worker on a host the API process is not on (a node of a
        multi-node engine): create the directory there and hold it as the
        API process holds its own, unless a process of this server already
        does (the API process on its host, or another engine's leader)."""
        with contextlib.suppress(BlockingIOError):
            if not (self.path / self.LOCK).exists():
                self.create()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _unowned(directory: Path) -> bool:
    """Whether no running server holds `directory`'s lock."""
    try:
        fd = os.open(directory / StagingRoot.LOCK, os.O_RDWR)
    except OSError:
        return True  # never locked: a server that died while creating it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


class SharedBuffers:
    """One kind of bucket ("staging" or "patches") of one engine, as files."""

    def __init__(self, directory: Path, kind: str, leader: bool) -> None:
        self.directory = directory
        self.kind = kind
        self.leader = leader
        self.mapped: dict[int, torch.Tensor] = {}  # bucket index -> buffer

    def _path(self, index: int) -> Path:
        return self.directory / f"{self.kind}-{index}"

    def buffer(self, index: int, nbytes: int) -> torch.Tensor:
        """The leader's buffer for a bucket: last push's if the size matches."""
        assert self.leader
        old = self.mapped.get(index)
        if old is not None and old.numel() == nbytes:
            return old
        path = self._path(index)
        path.unlink(missing_ok=True)  # any mapping of the old file keeps its own memory
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserved now: a full tmpfs raises here, not SIGBUS at the first write.
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as e:
            path.unlink(missing_ok=True)
            raise OSError(e.errno, f"/dev/shm has no room for a {nbytes}-byte staged bucket "
                          "(the TP workers share one staged copy there; raise the "
                          "container's shm_size or the chart's shm volume)") from e
        finally:
            os.close(fd)
        self.mapped[index] = buf = _map(path, nbytes)
        return buf

    def keep_only(self, indices: set[int]) -> None:
        """The leader: free the buffers of buckets the new layout lacks."""
        for index in [i for i in self.mapped if i not in indices]:
            self._path(index).unlink(missing_ok=True)
            del self.mapped[index]

    def attach(self, index: int, nbytes: int) -> torch.Tensor:
        """A follower's view of the leader's buffer, mapped afresh."""
        path = self._path(index)
        if not path.exists() or path.stat().st_size < nbytes:
            raise RuntimeError(f"the leader's staged bucket {self.kind}-{index} is missing "
                               f"from {self.directory}")
        self.mapped[index] = buf = _map(path, nbytes)
        return buf

    def drop(self) -> None:
        """Forget every mapping; the leader also unlinks its files, so a late
        write through an old mapping reaches nothing the next push reads."""
        if self.leader:
            for index in self.mapped:
                self._path(index).unlink(missing_ok=True)
        self.mapped = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.mapped.values())


def _map(path: Path, nbytes: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


@dataclass(frozen=True)
class StagingRole:
    """This worker's part in the server's staging layout (SideOp.LAYOUT;
    server/weights/staging_layout.py): its data-plane rank, or None when it
    follows `leader`, whose staged copy in `directory` it reads at a load."""

    plane_rank: int | None
    leader: int
    directory: Path | None = None  # the group's shared staging; None: its own copy
    root: StagingRoot | None = field(default=None, repr=False, compare=False)  # held, if made

    @classmethod
    def alone(cls, rank: int) -> StagingRole:
        """Before any layout: its own copy, as its own data-plane rank."""
        return cls(rank, rank)

    @classmethod
    def assigned(cls, layout: Layout, rank: int) -> StagingRole:
        """Its role in the layout: `roles[rank]` is {"plane_rank", "leader",
        "shared"}. A leader of a shared group on a host where this server
        holds no directory yet makes it."""
        role = layout.roles[str(rank)]
        if not role["shared"]:
            return cls(role["plane_rank"], role["leader"])
        root = StagingRoot(layout.boot_id)
        if role["plane_rank"] is not None:
            root.adopt()
        return cls(role["plane_rank"], role["leader"], root.path / f"g{role['leader']}", root)

    @property
    def follows(self) -> bool:
        return self.plane_rank is None

    def buffers(self, kind: str) -> SharedBuffers | None:
        """The shared buffers of one kind of bucket, if this worker shares."""
        if self.directory is None:
            return None
        return SharedBuffers(self.directory, kind, leader=not self.follows)
