"""Several trainer ranks sending over NCCL (data_plane/chain_steps.py), on one
GPU: four processes, each a host of its own to NCCL (`NCCL_HOSTID`, as in
test_data_plane_gpu.py), two senders and two receivers, the receivers running
the worker's own `receive_chain`. Proves the ctypes `ncclSend`/`ncclRecv`
inside one `ncclGroupStart`/`ncclGroupEnd`, the fused steps' pairing, host
staging through device slots, and device staging under `sum64`. Marked gpu.
The schedule itself is proven on gloo in tests/test_chain_steps_units.py."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import time
import zlib

import pytest
import torch

from tests.gpu.test_data_plane_gpu import _as_host, _store, join_or_kill

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEADLINE_S = 150
SENDERS, RECEIVERS = 2, 2
MiB = 1 << 20
SIZES = [40 * MiB, 5 * MiB + 3, 17 * MiB, 1]
SOURCES = [0, 1, 1, 0]


def _bucket(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, 256, (SIZES[k],), dtype=torch.uint8, generator=g)


def _rank(port: int, rank: int, staging: str, out: mp.Queue) -> None:
    faulthandler.dump_traceback_later(DEADLINE_S - 10, exit=True)
    _as_host(f"rank{rank}")
    from rollout_sidecar.protocol.data_plane.bucket_check import sum64
    from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group, send_bucket
    from rollout_sidecar.server.weights.worker.bucket_receive import receive_chain
    from rollout_sidecar.server.weights.worker.staging import StagedBucket, Staging

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    world = SENDERS + RECEIVERS
    try:
        group = broadcast_group("127.0.0.1", port, "chain-gpu", rank, world, "nccl", 60,
                                op_timeout_s=30, device=device)
        if rank < SENDERS:
            works = [send_bucket(group, _bucket(k).to(device), "chain", first_receiver=SENDERS)
                     for k, s in enumerate(SOURCES) if s == rank]
            for w in works:
                w.wait()
            torch.cuda.synchronize()
            out.put((rank, "sent"))
        else:
            on_device = staging == "device"
            buckets = [StagedBucket(k, n, [], torch.zeros(n, dtype=torch.uint8, device=device)
                                    if on_device else torch.zeros(n, dtype=torch.uint8,
                                                                  pin_memory=True),
                                    source=SOURCES[k]) for k, n in enumerate(SIZES)]
            check = "sum64" if on_device else "crc32"
            staged = Staging(buckets, device=device if on_device else torch.device("cpu"))
            receive_chain(group, staged, rank, world, None, SENDERS, check, "nccl", device)
            torch.cuda.synchronize()
            expect = [sum64(_bucket(k)) if on_device else zlib.crc32(_bucket(k).numpy())
                      for k in range(len(SIZES))]
            out.put((rank, {"checks_ok": [b.checksum == e
                                          for b, e in zip(buckets, expect, strict=True)],
                            "bytes_ok": [torch.equal(b.buffer.cpu(), _bucket(k))
                                         for k, b in enumerate(buckets)]}))
        group.close()
    except BaseException as e:  # noqa: BLE001 - reported, then the test fails on it
        out.put((rank, f"error: {e!r}"))


@pytest.mark.parametrize("staging", ["host", "device"])
def test_two_senders_reach_two_relays_over_nccl(staging: str) -> None:
    from tests.conftest import free_port

    port = free_port()
    store = _store(port, master=True)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(port, r, staging, out))
             for r in range(SENDERS + RECEIVERS)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                rank, what = out.get(timeout=1)
                results[rank] = what
            except Exception:  # noqa: BLE001 - queue.Empty
                if not any(p.is_alive() for p in procs):
                    break
    finally:
        join_or_kill(procs)
        del store
    print(f"nccl chain, {staging} staging:", results)
    for r in range(SENDERS, SENDERS + RECEIVERS):
        got = results.get(r)
        assert isinstance(got, dict), results
        assert all(got["checks_ok"]) and all(got["bytes_ok"]), results
    assert all(results.get(r) == "sent" for r in range(SENDERS)), results
