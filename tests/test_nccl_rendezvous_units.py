"""The NCCL data plane's rendezvous and binding, the parts a CPU can run
(protocol/data_plane/nccl_group.py, nccl_library.py): real TCPStores and signed
stores, with a fake NCCL library that says so (no libnccl on a CPU machine).
The communicator itself runs in tests/gpu/test_data_plane_gpu.py."""

from __future__ import annotations

import ctypes
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from rollout_sidecar.protocol.data_plane import nccl_group, nccl_library
from rollout_sidecar.protocol.data_plane.signed_store import (
    RendezvousAborted,
    SignedStore,
    abort_connection,
    group_prefix,
)
from tests.conftest import free_port
from tests.polling import until

SECRET = b"k" * 32


class FakeLibrary:
    """Stands in for libnccl (a fake): a version, and a unique id to hand out."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.ids = 0

    def unique_id(self) -> nccl_library.UniqueId:
        self.ids += 1
        return nccl_library.UniqueId.from_bytes(bytes(range(128)))


def _store(port: int, master: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _rendezvous(port: int, versions: list[int], timeout_s: float = 20.0) -> dict:
    out: dict = {}

    def rank(r: int) -> None:
        store = SignedStore(dist.PrefixStore(group_prefix("c1"), _store(port, False)), SECRET,
                            f"127.0.0.1:{port}", timeout_s)
        t0 = time.monotonic()
        try:
            out[r] = nccl_group.rendezvous(store, r, len(versions), FakeLibrary(versions[r]),
                                           timeout_s).to_bytes()
        except Exception as e:  # noqa: BLE001
            out[r] = e
        out[f"{r}_s"] = time.monotonic() - t0

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(versions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_gets_rank_0s_unique_id_once_all_are_there():
    port = free_port()
    master = _store(port, True)
    out = _rendezvous(port, [22809, 22809, 22809])
    assert out[0] == out[1] == out[2] == bytes(range(128))
    del master


def test_ranks_of_different_nccl_versions_all_fail_at_once_naming_both():
    """NCCL >= 2.23 refuses peers of another version at init; here every rank
    learns it from the store, in a message that names each and the way out."""
    port = free_port()
    master = _store(port, True)
    out = _rendezvous(port, [22809, 22809, 22907])
    for r in range(3):
        assert isinstance(out[r], nccl_group.NcclVersionMismatch), out[r]
        for part in ("rank 0: 2.28.9", "rank 2: 2.29.7", "gloo", "VLLM_NCCL_SO_PATH"):
            assert part in str(out[r]), (part, out[r])
        assert out[f"{r}_s"] < 10, out  # at once, not at the timeout
    del master


def test_rank_0_never_starts_nccl_for_a_rank_that_will_not_come():
    """A replica that refused the connect never joins: rank 0 waits in the
    store for its presence (not in NCCL's bootstrap), the trainer's abort
    marker ends that wait within a poll, and no unique id (with its bootstrap
    thread) was ever made."""
    port = free_port()
    master = _store(port, True)
    lib = FakeLibrary(22809)
    out: dict = {}

    def trainer_rank_0() -> None:
        store = SignedStore(dist.PrefixStore(group_prefix("c2"), _store(port, False)), SECRET,
                            f"127.0.0.1:{port}", 60)
        try:
            nccl_group.rendezvous(store, 0, 2, lib, 60)
        except Exception as e:  # noqa: BLE001
            out["error"] = e
        out["ended"] = time.monotonic()

    t = threading.Thread(target=trainer_rank_0)
    t.start()
    until(lambda: any(k.startswith(group_prefix("c2")) and k.endswith(nccl_group.rank_key(0))
                      for k in master.list_keys()), "rank 0 is there, waiting for rank 1")
    refused = time.monotonic()
    abort_connection(master, "c2", SECRET, "here", "another trainer is pushing")
    t.join(30)
    assert isinstance(out["error"], RendezvousAborted), out
    assert "another trainer is pushing" in str(out["error"])
    assert out["ended"] - refused < 5 and lib.ids == 0, (out, lib.ids)


def test_the_config_struct_is_ncclConfig_t_as_nccl_2_18_lays_it_out():
    """NCCL copies min(size, its own) bytes of it and resets fields newer
    than `version`: the layout and version must be 2.18's (nccl.h.in)."""
    c = nccl_library.nonblocking_config()
    assert ctypes.sizeof(c) == c.size == 48
    offsets = {name: getattr(type(c), name).offset for name, _ in c._fields_}
    assert offsets == {"size": 0, "magic": 8, "version": 12, "blocking": 16,
                       "cgaClusterSize": 20, "minCTAs": 24, "maxCTAs": 28, "netName": 32,
                       "splitShare": 40}
    assert (c.magic, c.version, c.blocking) == (0xCAFEBEEF, 21800, 0)
    assert c.cgaClusterSize == c.minCTAs == c.maxCTAs == c.splitShare == -(2**31)
    with pytest.raises(nccl_library.NcclError, match="128 bytes"):
        nccl_library.UniqueId.from_bytes(b"short")
