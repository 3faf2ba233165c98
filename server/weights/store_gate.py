"""The rendezvous store behind a gate: open only while a trainer connects,
with budgets of connections and bytes, and swept after each connect.

Why: torch's TCPStore takes any write from anyone who reaches its port, and
keeps it (64 values of 8 MiB grew the API process by 530 MiB, which stayed
after they were deleted). It has no authentication to add, so the store
listens on loopback only and this relay owns the data-plane port:

- a connection is relayed only while a window is open: from an admin-
  authenticated /weights/connect passing its checks until it ends (joined,
  failed or timed out). One that comes before (a trainer's ranks start
  joining as they send the connect) waits, unread, up to `HOLD_S` for a
  window, then is closed. A failed connect's window stays open `GRACE_S`
  longer, for the trainer to write its abort marker and clear up
  (trainer/transport/distributed.py: `_end_rendezvous`), and so does a
  connect refused before its window (`refused`), for the ranks it started;
- a window's connections may upload `WINDOW_BYTES` in all, each
  `CONNECTION_BYTES` (commands included: a rank polling for its peers for
  minutes sends far less), at most `MAX_CONNECTIONS` at once; past a
  budget the connection is closed and the log says which;
- `GRACE_S` after a connect ends (every rank past its rendezvous by then;
  each deleted its own keys), every key not of a window still open is
  deleted: a marker, a rogue's keys, anything. So what the store holds is
  bounded by the open windows' budgets, whatever was written before;
- a connection silent for `IDLE_S` once its window closed (a formed group
  no longer reads the store) is closed, so none lingers for ever.

What this still allows: within a window, someone who reaches the port can
write (bounded) or delete keys; the values are signed (signed_store.py), so
a forgery fails the connect by name, and the trainer retries under a new
secret. The relay sits on the API process's event loop; the group's data
(gloo's and NCCL's own connections) never passes through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import socket
from collections.abc import Iterator

import torch

from rollout_sidecar.protocol.data_plane.signed_store import group_prefix

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
CONNECTION_BYTES = 1 << 20
WINDOW_BYTES = 32 << 20
PIPE_BYTES = 64 << 10
HOLD_S = 10.0  # a connection waits this long, unread, for a window to open
GRACE_S = 10.0  # after a connect ends: its store open this long if it failed; then the sweep
IDLE_S = 120.0  # a connection of a closed window, silent this long, is closed


class StoreGate:
    def __init__(self, hold_s: float = HOLD_S, grace_s: float = GRACE_S,
                 connection_bytes: int = CONNECTION_BYTES) -> None:
        self.hold_s, self.grace_s, self.connection_bytes = hold_s, grace_s, connection_bytes
        self.store: torch.distributed.TCPStore | None = None  # on loopback
        self.server: asyncio.Server | None = None
        self.port = 0
        self._ids = itertools.count(1)
        self._open: dict[int, str] = {}  # window -> its connection's id, while open
        self._opened = asyncio.Event()  # set while any window is open
        self._uploaded: dict[int, int] = {}  # window -> bytes its connections sent
        self._conns: dict[asyncio.StreamWriter, int] = {}  # client -> its window (0: waiting)

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
    def window(self, connection_id: str) -> Iterator[None]:
        """Take connections while the block runs (the connect of
        `connection_id`), and `GRACE_S` longer if it raises."""
        window = self._open_window(connection_id)
        failed = True
        try:
            yield
            failed = False
        finally:
            self._end_window(window, failed)

    def refused(self, connection_id: str) -> None:
        """A connect refused before its window opened (another trainer's
        lease or push, a field this server refuses). Its trainer's ranks may
        be waiting here already, and torch's client reconnects until its
        join's timeout: held out, a refused trainer's join (and its close(),
        which waits for it) took the whole `join_s`. So the store opens
        `GRACE_S` for them, as after a failed connect: they read the abort
        marker the trainer writes (trainer/transport/distributed.py:
        `_end_rendezvous`) and leave within a poll. Only an admin-
        authenticated connect gets this far."""
        self._end_window(self._open_window(connection_id), failed=True)

    def _open_window(self, connection_id: str) -> int:
        window = next(self._ids)
        self._open[window] = connection_id
        self._uploaded[window] = 0
        self._opened.set()
        return window

    def _end_window(self, window: int, failed: bool) -> None:
        loop = asyncio.get_running_loop()
        if failed:
            loop.call_later(self.grace_s, self._close, window)
        else:
            self._close(window)
        loop.call_later(self.grace_s, self._sweep)

    def _close(self, window: int) -> None:
        self._open.pop(window, None)
        if not self._open:
            self._opened.clear()

    def _sweep(self) -> None:
        """Delete every key but those of the windows still open."""
        if self.store is None:
            return
        keep = tuple(group_prefix(cid) for cid in self._open.values())
        with contextlib.suppress(Exception):
            for key in self.store.list_keys():
                if not (keep and key.startswith(keep)):
                    self.store.delete_key(key)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if len(self._conns) >= MAX_CONNECTIONS or self.store is None:
            log.info("data-plane store: connection from %s refused: too many connections", peer)
            writer.close()
            return
        self._conns[writer] = 0
        try:
            await asyncio.wait_for(self._opened.wait(), self.hold_s)
            window = self._conns[writer] = max(self._open)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.store.port)
        except (TimeoutError, OSError, ValueError) as e:
            log.info("data-plane store: connection from %s closed: %s", peer,
                     "no connect in progress" if isinstance(e, TimeoutError | ValueError) else e)
            self._conns.pop(writer, None)
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer, writer, window),
                                 self._pump(up_reader, writer, writer, None))
        finally:
            self._conns.pop(writer, None)
            if window not in self._conns.values() and window not in self._open:
                self._uploaded.pop(window, None)
            for w in (writer, up_writer):
                w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    client: asyncio.StreamWriter, window: int | None) -> None:
        """Copy `src` to `dst` until either end closes; `window`: the client's
        side, counted against its budgets and idle bound."""
        sent = 0
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                try:
                    data = await asyncio.wait_for(src.read(PIPE_BYTES), IDLE_S)
                except TimeoutError:
                    if window is None or window in self._open:
                        continue
                    log.info("data-plane store: closed %s, idle since its connect ended",
                             client.get_extra_info("peername"))
                    break
                if not data:
                    break
                if window is not None:
                    sent += len(data)
                    self._uploaded[window] = self._uploaded.get(window, 0) + len(data)
                    over = sent > self.connection_bytes
                    if over or self._uploaded[window] > WINDOW_BYTES:
                        log.warning("data-plane store: closed %s past its budget (%s)",
                                    client.get_extra_info("peername"),
                                    "connection" if over else "connect")
                        break
                dst.write(data)
                await dst.drain()
        for w in (dst, client):  # one end closed, idle or over budget: both go
            w.close()
