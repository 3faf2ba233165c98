"""The server's two ports, held from its first second.

`serve` binds the HTTP port and the data plane's before the engine starts
(about 25 s on CPU, minutes on a GPU). A port in use fails at once, naming
its flag, not after the model has loaded. Nothing else on the host can take
either port in between: a port picked by a supervisor and bound only after
the engine started could be taken by any process's outgoing connection (CI
saw exactly that: "address already in use" after a full engine start).

Bound, not listening: a client that calls while the engine starts is refused
at once, as before, and is not left waiting in a backlog nobody accepts.
asyncio listens when uvicorn starts serving; the TCPStore listens when the
data plane starts (its store gate, weights/store_gate.py).

A supervisor (our launcher, or systemd-style socket activation) can pass
sockets it bound itself (`--http-fd`, `--data-plane-fd`), so a port it chose
is never free between its choice and the server's start.

Processes forked from here (vLLM's engine core and its workers) close their
copies at once. Otherwise an orphaned engine process would keep a killed
server's port bound, and the restart would fail.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from rollout_sidecar.server.config import ServerSettings

# Closed in every forked child; see the module docstring.
_HELD: set[socket.socket] = set()


def _close_in_child() -> None:
    for sock in list(_HELD):
        sock.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class PortUnavailable(RuntimeError):
    """A port could not be bound, or a passed fd is not a bound TCP socket.
    `option` is the flag to change."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


def bind_port(host: str, port: int, option: str = "--port") -> socket.socket:
    """A TCP socket bound to host:port (0: any free port), not yet listening.
    SO_REUSEADDR as uvicorn and torch set it: a predecessor's TIME_WAIT
    connections do not block a restart on the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortUnavailable(f"cannot bind {host}:{port}: {e.strerror}", option) from e
    return sock


def adopt_fd(fd: int, option: str) -> socket.socket:
    """The TCP socket this process inherited as `fd`."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise PortUnavailable(f"fd {fd} is not a socket: {e.strerror}", option) from e
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise PortUnavailable(f"fd {fd} is not a TCP socket", option)
    sock.set_inheritable(False)  # not into exec'd children either
    return sock


def port_of(sock: socket.socket) -> int:
    return sock.getsockname()[1]


@dataclass
class Listeners:
    """The HTTP socket (uvicorn serves on it) and the data plane's (the
    TCPStore takes it over)."""

    http: socket.socket
    data_plane: socket.socket

    def take_data_plane_fd(self) -> int:
        """The data plane's fd, which its new owner (the TCPStore) closes."""
        _HELD.discard(self.data_plane)
        return self.data_plane.detach()


def open_listeners(settings: ServerSettings) -> Listeners:
    """Adopt the passed sockets or bind the configured ports, and record the
    ports actually held in `settings`."""
    held = []
    try:
        if settings.http_fd is not None:
            http = adopt_fd(settings.http_fd, "--http-fd")
        else:
            http = bind_port(settings.host, settings.port, "--port")
        held.append(http)
        if settings.data_plane_fd is not None:
            plane = adopt_fd(settings.data_plane_fd, "--data-plane-fd")
        else:
            plane = bind_port(settings.data_plane_host or settings.host,
                              settings.data_plane_port, "--data-plane-port")
        held.append(plane)
    except PortUnavailable:
        for sock in held:
            sock.close()
        raise
    _HELD.update(held)
    settings.port, settings.data_plane_port = port_of(http), port_of(plane)
    return Listeners(http, plane)
