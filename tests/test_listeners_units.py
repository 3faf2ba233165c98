"""The server's ports are held from its first second (server/listeners.py),
without starting vLLM: a taken port fails `serve` at once naming its flag, a
held port refuses calls until the server serves, the ports the launcher picks
are never free while the server starts, and forked children (vLLM's engine
processes) do not keep a dead server's ports bound."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.launcher import launch_server
from rollout_sidecar.server.listeners import PortUnavailable, bind_port, open_listeners, port_of
from tests import processes


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _bindable(port: int) -> bool:
    """Whether another process could take `port` now: a plain bind, as a
    `free_port()` elsewhere does. (A bound, not yet listening port stays open
    to a second SO_REUSEADDR bind; ephemeral ports and plain binds skip it.)"""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_serve_on_a_taken_port_fails_before_loading_anything_naming_the_flag(tmp_path):
    with _listening() as taken:
        r = processes.run(
            [sys.executable, "-m", "rollout_sidecar.server.cli", "serve",
             "--port", str(port_of(taken)), "--data-plane-port", "0",
             "--model", str(tmp_path / "never-read")],
            timeout_s=60, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2, r.stderr
    # The flag and the cause, not the model it never got to.
    assert "--port" in r.stderr and "Address already in use" in r.stderr, r.stderr
    assert "never-read" not in r.stderr


def test_a_taken_data_plane_port_is_named_and_releases_the_http_socket():
    http = bind_port("127.0.0.1", 0)
    http_port = port_of(http)
    with _listening() as taken:
        settings = ServerSettings(http_fd=http.detach(), data_plane_port=port_of(taken))
        with pytest.raises(PortUnavailable) as e:
            open_listeners(settings)
    assert e.value.option == "--data-plane-port"
    assert _bindable(http_port)  # the adopted socket was closed, not leaked


def test_held_ports_refuse_calls_until_served_and_record_the_ports():
    http = bind_port("127.0.0.1", 0)
    settings = ServerSettings(http_fd=http.detach(), data_plane_port=0)
    held = open_listeners(settings)
    try:
        assert settings.port == port_of(held.http) and settings.data_plane_port > 0
        assert not _bindable(settings.port) and not _bindable(settings.data_plane_port)
        # While the engine starts: refused at once, not left in a backlog.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", settings.port), timeout=5).close()
        held.http.listen()  # what asyncio does when uvicorn starts serving
        socket.create_connection(("127.0.0.1", settings.port), timeout=5).close()
    finally:
        held.http.close()
        held.data_plane.close()
    assert _bindable(settings.port) and _bindable(settings.data_plane_port)


def test_a_forked_child_does_not_keep_the_ports_bound():
    settings = ServerSettings(http_fd=bind_port("127.0.0.1", 0).detach(), data_plane_port=0)
    held = open_listeners(settings)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # as multiprocessing forks vLLM's engine core
        os.write(write, b"up")
        time.sleep(60)
        os._exit(0)  # a forked child must not run the parent's pytest teardown
    try:
        os.close(write)
        assert os.read(read, 2) == b"up"
        held.http.close()
        held.data_plane.close()
        # The child lives on, holding neither.
        assert _bindable(settings.port) and _bindable(settings.data_plane_port)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)


def test_the_launcher_holds_the_ports_it_picked_until_the_server_exits(tmp_path):
    # The server waits at interpreter start (sitecustomize) until released, so
    # the check below runs while it is alive, before it ran a line of ours.
    gate = tmp_path / "go"
    (tmp_path / "sitecustomize.py").write_text(
        "import pathlib, time\n"
        "deadline = time.monotonic() + 60\n"
        f"while not pathlib.Path({str(gate)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n")
    s = launch_server(log=tmp_path / "s.log", model=tmp_path / "never-read", wait=False,
                      env={"PYTHONPATH": str(tmp_path)})
    try:
        assert s.proc.poll() is None
        assert not _bindable(s.port) and not _bindable(s.data_plane_port)
        gate.touch()
        # It adopted both sockets (no fd error) and refused the missing model.
        assert s.proc.wait(60) == 2, s.log_tail()
        assert "--model" in s.log_tail() and "fd" not in s.log_tail()
    finally:
        s.stop()
    assert _bindable(s.port) and _bindable(s.data_plane_port)
