"""The data plane's store behind its gate (server/weights/store_gate.py),
with a real TCPStore and real clients, no engine: a client is relayed only
while a connect's window is open (one that comes early waits for it), a
connection over its budget is closed, and after a connect every key but an
open window's is swept."""

from __future__ import annotations

import asyncio
import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from rollout_sidecar.server.weights.store_gate import StoreGate


def client(port: int, timeout_s: float = 5) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


async def gate(**kw) -> StoreGate:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    g = StoreGate(**kw)
    await g.start(sock)
    return g


def test_a_client_gets_in_only_during_a_connect_and_may_come_early():
    async def main() -> None:
        g = await gate(hold_s=1.0, grace_s=0.2)
        try:
            with pytest.raises(dist.DistError):  # no connect: held, then closed
                await asyncio.to_thread(lambda: client(g.port, 3).set("k", b"v"))
            early = asyncio.create_task(asyncio.to_thread(client, g.port))
            await asyncio.sleep(0.3)  # the trainer's join starts before its connect arrives
            with g.window("c1"):
                store = await early
                await asyncio.to_thread(store.set, "rs/c1/0", b"addr")
                assert await asyncio.to_thread(store.get, "rs/c1/0") == b"addr"
        finally:
            g.stop()

    asyncio.run(main())


def test_over_budget_is_closed_and_leftovers_are_swept():
    async def main() -> None:
        g = await gate(hold_s=1.0, grace_s=0.2, connection_bytes=64 << 10)
        try:
            with g.window("c1"):
                store = await asyncio.to_thread(client, g.port)
                with pytest.raises(dist.DistError):  # 1 MiB into a 64 KiB budget: cut off
                    await asyncio.to_thread(store.set, "flood", bytes(1 << 20))
                    await asyncio.to_thread(store.get, "flood")
                ok = await asyncio.to_thread(client, g.port)
                await asyncio.to_thread(ok.set, "rs/c1/0", b"addr")
                await asyncio.to_thread(ok.set, "elsewhere", b"x")
            with g.window("c2"):
                await asyncio.sleep(0.5)  # c1's sweep runs while c2 is open
                assert set(await asyncio.to_thread(g.store.list_keys)) <= {"rs/c2/0"}
        finally:
            g.stop()

    asyncio.run(main())


def test_a_refused_connects_join_reads_the_trainers_abort_instead_of_timing_out():
    """A trainer's join starts beside its connect. When the server refuses
    the connect before its window (another trainer's lease), the join was
    held out of the store, and torch's client reconnected until the join's
    timeout: the refused trainer's close() waited the whole join_s for it.
    Now the refusal opens the store for the grace, the join gets in, and
    it ends on the trainer's signed abort marker, with its reason."""
    from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group
    from rollout_sidecar.protocol.data_plane.signed_store import abort_connection

    secret = bytes(range(32))

    async def main() -> None:
        g = await gate(hold_s=1.0, grace_s=5.0)
        ended: dict[str, str] = {}

        def join() -> None:
            try:
                broadcast_group("127.0.0.1", g.port, "refused1", 0, 2, "gloo", 600.0, secret)
            except Exception as e:
                ended["error"] = str(e)

        try:
            joining = threading.Thread(target=join, daemon=True)
            joining.start()
            await asyncio.sleep(0.3)  # held at the gate: no connect in progress
            g.refused("refused1")  # the server's 409 opens the grace
            trainer = await asyncio.to_thread(client, g.port)
            await asyncio.to_thread(abort_connection, trainer, "refused1", secret,
                                    "gate", "the trainer gave up this connection: 409")
            await asyncio.to_thread(joining.join, 60)  # its timeout is 600 s
            assert not joining.is_alive() and "409" in ended.get("error", ""), ended
        finally:
            g.stop()

    asyncio.run(main())
