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

Not shared: device staging (each GPU needs its copy in its own memory) and an
engine spanning several hosts (every worker receives, as before). /dev/shm
must hold the staged copy: Docker caps it at 64 MB unless `shm_size` is set
(deploy/docker-compose.yml sets it; the chart mounts a memory volume there).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import torch

SHM = Path("/dev/shm")


def shares_host_staging(parallel_config: Any, settings: Any) -> bool:
    """Whether an engine's workers share one staged copy (module docstring)."""
    return (settings.share_host_staging and parallel_config.world_size > 1
            and parallel_config.nnodes_within_dp == 1 and settings.weight_staging != "device"
            and SHM.is_dir())


def receivers(parallel_config: Any, shared: bool) -> int:
    """This server's ranks in the data-plane group: one per engine (its
    leader) when shared, else every worker."""
    return parallel_config.data_parallel_size if shared else \
        parallel_config.world_size_across_dp


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
        self._lock_fd = os.open(self.path / self.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

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
