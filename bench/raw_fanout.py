"""The floor under a push to N receivers: bytes only, through the product's
own group and fan-out (protocol/data_plane/bucket_group.py), no server, no pack, no CRC, no
load. Rank 0 floats like the trainer; receiver i is pinned to core i like the
replicas in push_replicas.py. Returns the median seconds to deliver
`nbytes` in `bucket`-sized sends to every receiver."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.multiprocessing as mp


def _run(rank: int, world: int, port: int, fanout: str, nbytes: int, bucket: int,
         repeats: int, out: Any) -> None:
    import torch.distributed as dist

    from rollout_sidecar.protocol.data_plane.bucket_group import (
        broadcast_group,
        receive_broadcast_bucket,
        relay_buckets,
        send_bucket,
    )
    from rollout_sidecar.protocol.data_plane.landing import InPlace
    from rollout_sidecar.protocol.data_plane.ring_route import route

    torch.set_num_threads(1)
    if rank:
        os.sched_setaffinity(0, {(rank - 1) % (os.cpu_count() or 1)})
    else:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    group = broadcast_group("127.0.0.1", port, "raw", rank, world, "gloo", 120)
    bufs = [torch.ones(bucket, dtype=torch.uint8) for _ in range(2 if rank == 0 else 1)]
    n = -(-nbytes // bucket)
    times = []
    for _ in range(repeats + 1):
        group.barrier().wait()
        t0 = time.perf_counter()
        if rank == 0:  # double-buffered, as the pusher sends
            works = [None, None]
            for k in range(n):
                if works[k % 2] is not None:
                    works[k % 2].wait()
                works[k % 2] = send_bucket(group, bufs[k % 2], fanout)
            for w in works:
                if w is not None:
                    w.wait()
        elif fanout == "broadcast":
            for _ in range(n):
                receive_broadcast_bucket(group, bufs[0])
        else:
            relay_buckets(group, [route(k, rank, 0, 1, world, None) for k in range(n)],
                          InPlace([bufs[0]] * n))
        group.barrier().wait()  # every receiver has everything
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.send(sorted(times[1:])[len(times[1:]) // 2])
    group.close()  # its gloo threads joined here, not left to interpreter exit


def raw_seconds(receivers: int, fanout: str, nbytes: int, bucket: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rx, tx = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_run, args=(r, receivers + 1, port, fanout, nbytes, bucket,
                                            repeats, tx)) for r in range(receivers + 1)]
    for p in procs:
        p.start()
    try:
        if not rx.poll(600):
            raise RuntimeError(f"raw {fanout} to {receivers} did not finish")
        return rx.recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
