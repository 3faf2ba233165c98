"""The data plane's authentication, without vLLM: bucket tags (bucket_mac.py)
and the signed rendezvous (signed_store.py) over a real TCPStore and real
gloo groups of threads on localhost."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group, close_group
from rollout_sidecar.protocol.data_plane.bucket_mac import (
    BucketMac,
    PushMacs,
    bucket_mac,
    new_secret,
    parse_secret,
)
from rollout_sidecar.protocol.data_plane.signed_store import (
    TAMPERED,
    RendezvousAborted,
    RendezvousTampered,
    SignedStore,
    delete_connection_keys,
)
from rollout_sidecar.protocol.schema import ConnectRequest

pytestmark = pytest.mark.timeout(60)


def _buf(n: int = 4096, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_mac_binds_key_connection_push_and_index() -> None:
    key, buf = new_secret(), _buf()
    tag = bucket_mac(key, buf, "c1", 7, 3)
    assert tag == bucket_mac(key, buf.clone(), "c1", 7, 3)  # deterministic
    assert len(tag) == 32
    others = [bucket_mac(new_secret(), buf, "c1", 7, 3), bucket_mac(key, buf, "c2", 7, 3),
              bucket_mac(key, buf, "c1", 8, 3), bucket_mac(key, buf, "c1", 7, 4)]
    flipped = buf.clone()
    flipped[100] ^= 1
    others.append(bucket_mac(key, flipped, "c1", 7, 3))
    assert tag not in others and len(set(others)) == len(others)
    # Piece by piece (a chain receiver) gives the bucket's tag.
    pieces = BucketMac(key)
    for i in range(0, buf.numel(), 1000):
        pieces.update(buf[i: i + 1000])
    assert pieces.finish("c1", 7, 3, buf.numel()) == tag


def test_secret_stays_out_of_reprs() -> None:
    key = new_secret()
    req = ConnectRequest(connection_id="c", secret=key.hex())
    assert key.hex() not in repr(req) and key.hex() not in str(req)
    assert parse_secret(req.secret.get_secret_value()) == key  # type: ignore[union-attr]
    assert key.hex() not in repr(PushMacs(key, "c", 1))
    with pytest.raises(ValueError) as e:
        parse_secret("zz" + key.hex())
    assert key.hex() not in str(e.value)


@pytest.fixture()
def master() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield store


def _client(master: Any) -> Any:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10))


def test_signed_store_names_an_overwritten_key(master: Any) -> None:
    key = new_secret()
    where = f"127.0.0.1:{master.port}"
    mine = SignedStore(dist.PrefixStore("rs/c/", _client(master)), key, where, 5)
    mine.set("0/0", b"addr")
    assert mine.get("0/0") == b"addr"
    # A value signed under another secret (or a raw one) is refused, naming the key.
    master.set("rs/c//0/0", b"\0" * 40)
    with pytest.raises(RendezvousTampered) as e:
        mine.get("0/0")
    assert f"{TAMPERED}: key '0/0' at {where}" in str(e.value)
    assert key.hex() not in str(e.value)
    # The other ranks' waits end at once on the signed abort marker.
    peer = SignedStore(dist.PrefixStore("rs/c/", _client(master)), key, where, 5)
    t0 = time.monotonic()
    with pytest.raises(RendezvousTampered, match="aborted by another rank"):
        peer.get("0/1")
    assert time.monotonic() - t0 < 2


def _build(master: Any, conn: str, world: int, secret: bytes | None, timeout_s: float = 20
           ) -> list[Any]:
    out: list[Any] = [None] * world

    def join(rank: int) -> None:
        try:
            out[rank] = broadcast_group("127.0.0.1", master.port, conn, rank, world, "gloo",
                                        timeout_s, secret)
        except BaseException as e:
            out[rank] = e

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out


def test_gloo_group_forms_through_signed_store_and_leaves_no_keys(master: Any) -> None:
    before = master.num_keys()
    for conn in ("a1", "a2"):  # keys never pile up across connections
        groups = _build(master, conn, 3, new_secret())
        assert all(not isinstance(g, BaseException) for g in groups), groups
        data = [torch.arange(8, dtype=torch.uint8) if r == 0 else torch.zeros(8, dtype=torch.uint8)
                for r in range(3)]
        works = [g.broadcast(d) for g, d in zip(groups, data, strict=True)]
        for w in works:
            w.wait()
        assert all(torch.equal(d, data[0]) for d in data)
        for g in groups:
            close_group(g)
        assert master.num_keys() == before, master.list_keys()


def test_rogue_overwrite_fails_the_build_by_name_not_bad_alloc(master: Any) -> None:
    """Someone on the store's port overwrites rank 0's address before rank 1
    reads it: unsigned, gloo parsed the garbage (std::bad_alloc); signed, both
    ranks fail at once naming the key, well within the timeout."""
    key, out = new_secret(), {}

    def join(rank: int) -> None:
        try:
            out[rank] = broadcast_group("127.0.0.1", master.port, "r1", rank, 2, "gloo", 10,
                                        key)
        except BaseException as e:
            out[rank] = e

    rogue = _client(master)
    t0 = time.monotonic()
    first = threading.Thread(target=join, args=(0,), daemon=True)
    first.start()
    rogue.wait(["rs/r1//0/0"])
    rogue.set("rs/r1//0/0", b"\xff" * 64)
    second = threading.Thread(target=join, args=(1,), daemon=True)
    second.start()
    first.join(20)
    second.join(20)
    assert time.monotonic() - t0 < 8  # the abort marker, not the 10 s timeout
    assert all(isinstance(g, BaseException) for g in out.values()), out
    text = " | ".join(str(e) for e in out.values())
    assert f"{TAMPERED}: key '0/0' at 127.0.0.1:{master.port}" in text, text
    assert "bad_alloc" not in text and key.hex() not in text
    delete_connection_keys(master, "r1")  # the trainer's clean-up of a failed try
    assert not [k for k in master.list_keys() if k.startswith("rs/r1/")]


def test_unsigned_group_still_forms(master: Any) -> None:
    """A trainer that sends no secret (older) rendezvouses as before."""
    groups = _build(master, "old", 2, None)
    assert all(not isinstance(g, BaseException) for g in groups), groups
    for g in groups:
        close_group(g)


def test_a_slow_join_forms_the_group_but_a_stalled_piece_fails_at_the_stall_bound(
        master: Any) -> None:
    # The compose CI failure: a fresh container's first connect took longer
    # than the 15 s stall bound, which then also bounded the rendezvous.
    # Joining has its own budget (30 s here); every wait after it, the stall
    # bound (0.5 s), named in gloo's timeout.
    out: list[Any] = [None, None]
    secret = new_secret()

    def join(rank: int) -> None:
        time.sleep(2.0 * rank)  # rank 1 arrives four stall bounds late
        out[rank] = broadcast_group("127.0.0.1", master.port, "slow-join", rank, 2, "gloo",
                                    30, secret, op_timeout_s=0.5)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    sender, receiver = out
    assert sender is not None and receiver is not None, "the group did not form"
    try:
        with pytest.raises(RuntimeError, match="500ms"):  # nothing is sent: a stall
            receiver.recv(torch.zeros(8, dtype=torch.uint8), 0).wait()
    finally:
        close_group(sender)
        close_group(receiver)


def test_a_key_deleted_under_a_get_ends_on_the_abort_marker_not_the_store_timeout(
        master: Any) -> None:
    """A rank that fails writes the abort marker, then deletes the keys it
    wrote. Another rank that saw one of them present and is about to read it
    must not then sit in the store's blocking get for the whole timeout (in a
    CI run: a server's rank waited 10 s in a tampered connect); it reads
    without blocking and stops on the marker."""
    key = new_secret()
    where = f"127.0.0.1:{master.port}"
    slow = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                         timeout=datetime.timedelta(seconds=600))  # a blocking get hangs
    inner = dist.PrefixStore("rs/d/", slow)

    class SawItThenItWent:
        """The check saw rank 0's key; it is deleted before the read."""

        def __init__(self) -> None:
            self.first = True

        def check(self, keys: list[str]) -> bool:
            if keys == ["0/0"] and self.first:
                self.first = False
                return True
            return inner.check(keys)

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    failed = SignedStore(dist.PrefixStore("rs/d/", _client(master)), key, where, 5)
    failed.abort("rank 0 gave up")  # the marker first, then its keys go (none left)
    reader = SignedStore(SawItThenItWent(), key, where, 600)
    with pytest.raises(RendezvousAborted, match="rank 0 gave up"):
        reader.get("0/0")
    # Present, it reads as before; the marker a second rank writes does not replace the first.
    SignedStore(inner, key, where, 5).set("0/1", b"addr")  # the reader's connection: in order
    assert reader.get("0/1") == b"addr"
    SignedStore(dist.PrefixStore("rs/d/", _client(master)), key, where, 5).abort("second")
    with pytest.raises(RendezvousAborted, match="rank 0 gave up"):
        reader.get("0/2")
