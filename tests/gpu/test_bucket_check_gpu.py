"""A bucket's check where its bytes are (protocol/data_plane/bucket_check.py),
on CUDA, torch only. Marked gpu.

- sum64 of a bucket in GPU memory equals sum64 of the same bytes on the host
  (integer reductions, exact on both), for sizes across the chunking.
- The trainer's sender checks an NCCL-like device bucket without copying it
  to the host: `Tensor.cpu` raises while it sends, and the values it returns
  are the host's sum64 of the bytes that went out.
- The cost, printed side by side (not asserted): sum64 on the GPU against a
  host copy plus CRC-32 (ISA-L, zlib), per GiB.
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from rollout_sidecar.protocol.data_plane import bucket_check
from rollout_sidecar.protocol.data_plane.bucket_check import sum64
from rollout_sidecar.protocol.schema import BucketManifest, TensorSlot
from rollout_sidecar.trainer.pack.sender import BucketSender

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n", [1, 4097, 2 * bucket_check.CHUNK_WORDS + 3, 300 << 20])
def test_sum64_in_gpu_memory_is_the_hosts(n):
    host = torch.randint(0, 256, (n,), dtype=torch.uint8)
    assert sum64(host.cuda()) == sum64(host)


class _Done:
    def wait(self) -> None:
        pass


class _DeviceWire:
    """A transport whose buffers live on the GPU and which keeps what it sent."""

    name, checksum_in_request, bucket_macs, slot_pieces = "nccl", False, None, False
    buffer_device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, index, buf, push_ids, checksum, pieces=None):
        self.sent[index] = buf.clone()  # on the device
        return _Done()


def test_the_sender_checks_a_device_bucket_without_a_host_copy(monkeypatch):
    tensors = [(f"w{i}", torch.randn(256, 512, device="cuda")) for i in range(4)]
    per = 256 * 512 * 2  # bf16 on the wire
    buckets = [BucketManifest(index=i, nbytes=per, params=[TensorSlot(
        name=f"w{i}", dtype="bfloat16", shape=[256, 512], offset=0)]) for i in range(4)]
    wire = _DeviceWire()

    def no_host_copy(self, *a, **k):
        raise AssertionError("a device bucket was copied to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    values, err = BucketSender().send_all(buckets, iter(tensors), wire, ["p"], check="sum64")
    monkeypatch.undo()
    assert err is None, err
    assert values == [sum64(wire.sent[i].cpu()) for i in range(4)]


def _rate(fn, buf: torch.Tensor, repeats: int = 5) -> float:
    fn(buf)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(buf)
    torch.cuda.synchronize()
    return repeats * buf.numel() / (time.perf_counter() - t0) / 2**30


def test_print_the_cost_of_each_check_per_gib():
    buf = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)

    def copy_then(crc):
        def run(b):
            pinned.copy_(b)
            return crc(memoryview(pinned.numpy()))
        return run

    rates = {"sum64 on the GPU": _rate(sum64, buf),
             "host copy (pinned) + CRC-32 ISA-L": _rate(copy_then(bucket_check._crc32), buf),
             "host copy (pinned) + CRC-32 zlib": _rate(copy_then(zlib.crc32), buf),
             "host copy (pinned) alone": _rate(lambda b: pinned.copy_(b), buf)}
    print("\ncheck of a 256 MiB device bucket, GiB/s:")
    for name, rate in rates.items():
        print(f"  {name:36s} {rate:8.1f}")
    print(f"  isal loaded: {bucket_check._crc32 is not zlib.crc32}")
    assert all(r > 0 for r in rates.values())
