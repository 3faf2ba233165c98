"""What checking and authenticating the data plane cost: a bucket set pushed
over gloo to one receiver with no check at all, CRC-32 by zlib (what every
bucket paid before issue 44), CRC-32 by ISA-L (now), and ISA-L plus the keyed
BLAKE2b tags (`authenticate_buckets`), side by side in one run, plus each
hash's own throughput. Target (issue 44): the checks add at most 10% to the
push of a dense 100M bf16 model (200 MB, the default `--mb`).

Both ends do what the product does: rank 0 sends each bucket (double
buffered) and hashes it while it is on the wire (pack/sender.py); the
receiver hashes each bucket while the next arrives (transfer_engine.py), and
the receiver's last bucket is hashed after it lands, as at the check. The
group is built through the signed rendezvous. Modes alternate per repeat so
drift hits both alike. No server, no pack, no load: this isolates the hash.

    .venv/bin/python bench/data_plane_mac.py [--mb 512] [--bucket-mb 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, table  # noqa: E402

MODES = ("none", "crc32 zlib", "crc32 isal", "crc32 isal + mac")


def _run(rank: int, port: int, secret: bytes, nbytes: int, bucket: int, repeats: int,
         out: Any) -> None:
    import torch.distributed as dist

    from rollout_sidecar.protocol.data_plane import bucket_check
    from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group
    from rollout_sidecar.protocol.data_plane.bucket_mac import BucketMac, PushMacs

    torch.set_num_threads(1)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    group = broadcast_group("127.0.0.1", port, "bench", rank, 2, "gloo", 120, secret)
    n = -(-nbytes // bucket)
    gen = torch.Generator().manual_seed(0)
    if rank == 0:
        bufs = [torch.randint(0, 256, (bucket,), dtype=torch.uint8, generator=gen)
                for _ in range(2)]
    else:
        bufs = [torch.empty(bucket, dtype=torch.uint8) for _ in range(n)]  # staging
    times: dict[str, list[float]] = {m: [] for m in MODES}
    def zlib_crc(buf: torch.Tensor) -> int:
        return zlib.crc32(memoryview(buf.numpy()))

    for r in range(repeats + 1):
        for mode in MODES:
            mac = mode.endswith("mac")
            crc32 = (lambda buf: 0) if mode == "none" else (
                zlib_crc if "zlib" in mode else bucket_check.crc32)
            group.barrier().wait()
            t0 = time.perf_counter()
            if rank == 0:
                macs = PushMacs(secret, "bench", r) if mac else None
                works: list[Any] = [None, None]
                for k in range(n):
                    buf = bufs[k % 2]
                    if works[k % 2] is not None:
                        works[k % 2].wait()
                    works[k % 2] = group.broadcast(buf)
                    crc32(buf)  # while it is on the wire
                    if macs is not None:
                        macs.add(k, buf)
                for w in works:
                    if w is not None:
                        w.wait()
            else:
                pending = None
                for k in range(n):
                    work = group.broadcast(bufs[k])
                    if pending is not None:
                        crc32(pending)
                        if mac:
                            BucketMac(secret).update(pending)
                    work.wait()
                    pending = bufs[k]
                crc32(pending)
                if mac:
                    BucketMac(secret).update(pending)
            group.barrier().wait()  # the receiver has checked everything
            if r:  # the first round warms up
                times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        out.send(times)
    group.close()  # its gloo threads joined here, not left to interpreter exit


def hash_rates(nbytes: int) -> dict[str, float]:
    """GB/s of each hash alone over one buffer, one core."""
    buf = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    key = os.urandom(32)
    from rollout_sidecar.protocol.data_plane.bucket_check import _crc32

    fns = {"crc32 (zlib)": lambda: zlib.crc32(buf), "crc32 (ISA-L)": lambda: _crc32(buf),
           "blake2b-128 keyed": lambda: hashlib.blake2b(buf, key=key, digest_size=16).digest()}
    out = {}
    for name, fn in fns.items():
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = nbytes / median(ts) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    nbytes, bucket = a.mb << 20, a.bucket_mb << 20
    print(machine())
    rates = hash_rates(bucket)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    secret = os.urandom(32)
    procs = [ctx.Process(target=_run, args=(r, port, secret, nbytes, bucket, a.repeats, child))
             for r in range(2)]
    for p in procs:
        p.start()
    times = parent.recv()
    for p in procs:
        p.join(60)
    gb = nbytes / 1e9
    med = {m: median(times[m]) for m in MODES}
    none = med["none"]
    print(f"\nhash alone, one core, {a.bucket_mb} MiB buffer:")
    print(table(["hash", "GB/s"], [[k, f"{v:.2f}"] for k, v in rates.items()]))
    print(f"\npush of {a.mb} MiB in {a.bucket_mb} MiB buckets over gloo to 1 receiver, each "
          f"bucket checked on both sides (median of {a.repeats}):")
    print(table(["check", "s", "GB/s", "vs none"],
                [[m, f"{med[m]:.3f}", f"{gb / med[m]:.2f}", f"{med[m] / none:.2f}x"]
                 for m in MODES]))


if __name__ == "__main__":
    main()
