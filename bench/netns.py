"""Nodes with a network between them, on one machine: a network namespace per
node, each with one link to a shared bridge, its upload capped by a token
bucket (`tc tbf`). Pushes over loopback are CPU-bound on a small box; between
real pods they are bound by each node's NIC, which is what this emulates: a
sender that transmits a bucket twice pays twice on its own link. Needs root
(CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator

SUBNET = "10.77.0"
BRIDGE = "rs-br"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


# With br_netfilter loaded, bridged frames pass iptables' FORWARD chain, whose
# policy Docker sets to DROP: let our bridge's own traffic through.
_ACCEPT = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def _iptables(*args: str) -> int:
    """iptables, where it exists (without it, nothing filters the bridge)."""
    if shutil.which("iptables") is None:
        return 1
    return subprocess.run(["iptables", *args], capture_output=True).returncode


def _teardown(names: list[str]) -> None:
    while _iptables("-D", *_ACCEPT) == 0:
        pass
    for name in names:
        subprocess.run(["ip", "netns", "del", f"rs-{name}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@contextlib.contextmanager
def nodes(names: list[str], rate: str) -> Iterator[dict[str, str]]:
    """{name: ip}; run a process on node `name` with `exec_prefix(name)`.
    This process (the root namespace) reaches every node at its ip."""
    _teardown(names)  # leftovers of an interrupted run
    try:
        _ip("ip", "link", "add", BRIDGE, "type", "bridge")
        _ip("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("ip", "link", "set", BRIDGE, "up")
        _iptables("-I", *_ACCEPT)
        ips = {}
        for i, name in enumerate(names):
            ns, host_end = f"rs-{name}", f"rs-{name}-h"
            ips[name] = f"{SUBNET}.{i + 2}"
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("ip", "link", "set", host_end, "master", BRIDGE)
            _ip("ip", "link", "set", host_end, "up")
            _ip("ip", "addr", "add", f"{ips[name]}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            # the node's upload: what leaves it, to any other node
            _ip("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                "burst", "4mb", "latency", "200ms", ns=ns)
        yield ips
    finally:
        _teardown(names)


def exec_prefix(name: str) -> list[str]:
    return ["ip", "netns", "exec", f"rs-{name}"]
