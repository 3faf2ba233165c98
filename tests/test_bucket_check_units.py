"""A bucket's check (protocol/data_plane/bucket_check.py) against oracles
of its own: zlib for CRC-32, a pure-Python reading of sum64's definition;
and which ranks send (trainer/pack/bucket_senders.py, trainer/sending_ranks.py)."""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout_sidecar.protocol.data_plane import bucket_check
from rollout_sidecar.protocol.data_plane.bucket_check import MODULUS, crc32, preferred_check, sum64
from rollout_sidecar.protocol.schema import CAPABILITIES, SENDERS, SENDERS_NCCL, BucketManifest
from rollout_sidecar.trainer.pack.bucket_senders import assign_senders
from rollout_sidecar.trainer.sending_ranks import choose_senders


def sum64_by_definition(data: bytes) -> int:
    """Little-endian int16 words; A = sum, B = sum of word i x ((i mod 65521) + 1);
    an odd last byte is one more word, zero-extended; (A mod 2^32) << 32 | B mod 2^32."""
    a = b = 0
    for i in range(0, len(data) - len(data) % 2, 2):
        word, k = int.from_bytes(data[i: i + 2], "little", signed=True), i // 2
        a, b = a + word, b + word * (k % MODULUS + 1)
    if len(data) % 2:
        k = len(data) // 2
        a, b = a + data[-1], b + data[-1] * (k % MODULUS + 1)
    return ((a & 0xFFFFFFFF) << 32) | (b & 0xFFFFFFFF)


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4097, 2 * MODULUS + 1])
def test_sum64_is_its_definition(n):
    buf = random_bytes(n, n)
    assert sum64(buf) == sum64_by_definition(bytes(buf.numpy()))


def test_sum64_is_the_same_across_chunk_boundaries(monkeypatch):
    buf = random_bytes(5 * MODULUS * 2 + 3)
    whole = sum64(buf)
    monkeypatch.setattr(bucket_check, "CHUNK_WORDS", MODULUS)  # five chunks and a tail
    bucket_check._weights.cache_clear()
    try:
        assert sum64(buf) == whole == sum64_by_definition(bytes(buf.numpy()))
    finally:
        bucket_check._weights.cache_clear()


def test_sum64_sees_a_flipped_bit_a_swap_and_a_stale_range():
    buf = random_bytes(1 << 16)
    good = sum64(buf)
    flipped = buf.clone()
    flipped[12345] ^= 0x01
    swapped = buf.clone()
    swapped[100:102], swapped[900:902] = buf[900:902].clone(), buf[100:102].clone()
    stale = buf.clone()
    stale[4096:8192] = 0
    assert len({good, sum64(flipped), sum64(swapped), sum64(stale)}) == 4


def test_crc32_is_zlibs_whatever_computes_it():
    buf = random_bytes(3 << 20)
    want = zlib.crc32(buf.numpy())
    assert crc32(buf) == want
    assert crc32(buf[1 << 20:], crc32(buf[: 1 << 20])) == want  # piece by piece, as relayed


def test_a_trainer_checks_on_the_device_only_where_every_replica_can():
    assert preferred_check(on_device=True, offered=True) == "sum64"
    assert preferred_check(on_device=True, offered=False) == "crc32"
    assert preferred_check(on_device=False, offered=True) == "crc32"


def test_every_check_is_a_row_its_callers_ask():
    """The wire's names are the table's; a check that runs piece by piece gives
    a whole bucket's value over pieces; a device check needs no host copy
    unless the bucket is tagged; and no check name is compared outside the table."""
    from typing import get_args

    from rollout_sidecar.protocol.schema import Check

    assert set(get_args(Check)) == set(bucket_check.CHECKS)
    buf = random_bytes((1 << 20) + 3)
    for chk in bucket_check.CHECKS.values():
        assert chk.compute(buf) == bucket_check.checksum(buf, chk.name)
        if chk.running is not None:
            assert chk.running(buf[7:], chk.running(buf[:7], 0)) == chk.compute(buf)
        assert chk.needs_host_copy(tagged=True)
        assert chk.needs_host_copy(tagged=False) == (not chk.on_device)
    with pytest.raises(ValueError, match="check must be one of"):
        bucket_check.bucket_check("md5")
    root = Path(__file__).resolve().parents[1]
    compared = re.compile(r"""[=!]= *["'](crc32|sum64)["']|["'](crc32|sum64)["'] *[=!]=""")
    found = [f"{f.relative_to(root)}:{i}" for d in ("trainer", "server", "protocol", "client")
             for f in sorted((root / d).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if compared.search(line)]
    assert found == []


def _buckets(sizes: list[int]) -> list[BucketManifest]:
    return [BucketManifest(index=i, nbytes=n, params=[]) for i, n in enumerate(sizes)]


def test_buckets_are_shared_out_by_bytes_and_alternate():
    out = assign_senders(_buckets([100] * 8 + [40]), 4)
    assert [b.sender for b in out] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    loads = [sum(b.nbytes for b in out if b.sender == r) for r in range(4)]
    assert max(loads) <= sum(loads) / 4 + 100  # at most one bucket over the even share
    uneven = assign_senders(_buckets([300, 100, 100, 100, 100]), 2)
    assert [b.sender for b in uneven] == [0, 1, 1, 1, 0]


def _status(*caps: str) -> SimpleNamespace:
    return SimpleNamespace(capabilities=list(caps))


def test_every_rank_sends_only_where_every_part_can_and_says_why_not():
    new = [_status(*CAPABILITIES), _status(*CAPABILITIES)]
    assert choose_senders("all", "gloo", 4, new) == (4, None)
    assert choose_senders("all", "nccl", 4, new) == (4, None)  # point to point, chain_steps.py
    before_nccl = _status(*(c for c in CAPABILITIES if c != SENDERS_NCCL))
    for setting, name, world, statuses, why in [
            ("one", "gloo", 4, new, "senders='one'"),
            ("all", "gloo", 1, new, "one trainer rank"),
            ("all", "nccl", 4, [new[0], before_nccl], "replica 1 predates every-rank sending "
             "over nccl"),
            ("all", "http", 4, new, "transport http"),
            ("all", "gloo", 4, [new[0], _status()], "replica 1 predates")]:
        senders, reason = choose_senders(setting, name, world, statuses)
        assert senders == 1 and why in reason, (setting, name, reason)
    assert choose_senders("all", "gloo", 4, [before_nccl])[0] == 4
    assert SENDERS in CAPABILITIES
