"""The rendezvous store behind a gate: open only while a trainer connects,
with a budget of connections and bytes.

Why: torch's TCPStore takes any write from anyone who reaches its port, and
keeps it (64 values of 8 MiB grew the API process by 530 MiB, which stayed
after they were deleted). It has no authentication to add, so the store
listens on loopback only and this relay owns the data-plane port:

- a connection is relayed only while a window is open: from an admin-
  authenticated /weights/connect passing its checks until it ends (joined,
  failed or timed out). One that comes before (a trainer's ranks start
  joining as they send the connect) waits, unread, up to `HOLD_S` for a
  window, then is closed;
- opening a window closes every connection of the windows before (their
  group went at that connect), so none lingers;
- a window takes at most `MAX_CONNECTIONS` connections and `WINDOW_BYTES`
  uploaded in all, each connection at most `CONNECTION_BYTES`: a rendezvous
  writes a few hundred bytes a rank (addresses, signed), so the budgets are
  far above any group's and far below any harm. Past one, the connection is
  closed and the log says which budget.

Keys are not counted apart: every key costs its bytes, so the byte budgets
bound them too. What this still allows: within a window, someone who reaches
the port can write (bounded) or delete keys; the values are signed
(signed_store.py), so a forgery fails the connect by name, and the trainer
retries under a new secret.

The relay sits on the API process's event loop; the group's data (gloo's
and NCCL's own connections) never passes through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import socket
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
CONNECTION_BYTES = 1 << 20
WINDOW_BYTES = 32 << 20
PIPE_BYTES = 64 << 10
HOLD_S = 10.0  # a connection waits this long, unread, for a window to open


class StoreGate:
    def __init__(self) -> None:
        self.store: torch.distributed.TCPStore | None = None  # on loopback
        self.server: asyncio.Server | None = None
        self.port = 0
        self._open = 0  # windows open now (connects in progress)
        self._window = 0  # the newest window's number
        self._uploaded = 0  # bytes into the newest window
        self._conns: dict[asyncio.StreamWriter, int] = {}  # client -> its window (0: waiting)
        self._opened = asyncio.Event()  # set while a window is open

    async def start(self, sock: socket.socket) -> None:
        """Serve on `sock` (bound to the data-plane port); the store itself
        on a loopback port of its own."""
        self.store = torch.distributed.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60))
        sock.listen(256)
        self.server = await asyncio.start_server(self._serve, sock=sock)
        self.port = sock.getsockname()[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self._conns):
                w.close()
            self._conns.clear()
            self.server = None
        self.store = None

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Take connections while the block runs (a trainer's connect)."""
        self._window += 1
        self._uploaded = 0
        for w, window in list(self._conns.items()):
            if 0 < window < self._window:  # a group that went at this connect
                w.close()
        self._open += 1
        self._opened.set()
        try:
            yield
        finally:
            self._open -= 1
            if not self._open:
                self._opened.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._conns) >= MAX_CONNECTIONS or self.store is None:
            log.info("data-plane store: connection from %s refused: too many connections",
                     writer.get_extra_info("peername"))
            writer.close()
            return
        self._conns[writer] = 0
        try:
            await asyncio.wait_for(self._opened.wait(), HOLD_S)
            window = self._conns[writer] = self._window
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.store.port)
        except (TimeoutError, OSError) as e:
            log.info("data-plane store: connection from %s closed: %s",
                     writer.get_extra_info("peername"),
                     "no connect in progress" if isinstance(e, TimeoutError) else e)
            self._conns.pop(writer, None)
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer, window, writer),
                                 self._pump(up_reader, writer, None, writer))
        finally:
            self._conns.pop(writer, None)
            for w in (writer, up_writer):
                w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    window: int | None, client: asyncio.StreamWriter) -> None:
        """Copy `src` to `dst` until either end closes; `window`: the client's
        side, counted against its budgets."""
        sent = 0
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(PIPE_BYTES):
                if window is not None:
                    sent += len(data)
                    if window == self._window:
                        self._uploaded += len(data)
                    if sent > CONNECTION_BYTES or self._uploaded > WINDOW_BYTES:
                        log.warning("data-plane store: closed %s past its budget (%s)",
                                    client.get_extra_info("peername"),
                                    "connection" if sent > CONNECTION_BYTES else "window")
                        break
                dst.write(data)
                await dst.drain()
        for w in (dst, client):  # one end closed or over budget: both go
            w.close()
