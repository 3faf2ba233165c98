"""The address this server's workers reach its data-plane store at.

The store listens on `data_plane_host` (default: `host`). Workers on this
host reach it there, or on loopback when it listens on every address. A
worker on another host (one engine over several hosts: vLLM's multiprocessing
executor with nnodes > 1, or Ray) needs an address routable to this host:
`data_plane_advertise_host` if set, else `master_addr` with nnodes > 1 (node
0's address, which every node already reaches), else the one vLLM finds for
itself (`VLLM_HOST_IP`, or the interface of the default route;
vllm/utils/network_utils.py, `get_ip`). Handing them 127.0.0.1, as before,
sent their join to their own host. Decided once, at start, from the
workers' reports (staging_layout.survey): a store that remote workers cannot
reach is refused then, naming the setting.
"""

from __future__ import annotations

from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.weights.staging_layout import WorkerHost
from rollout_sidecar.server.weights.worker.host_share import host_view

ANY = ("0.0.0.0", "::", "")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Unreachable(RuntimeError):
    """Workers on other hosts could not reach the data-plane store."""


def remote_hosts(hosts: list[WorkerHost], here: str | None = None) -> list[str]:
    """The hosts (by name) of workers on another network stack than this
    process's (`here`: its `net` id; host_share.host_view), where loopback
    does not reach: other hosts, or other network namespaces on this one."""
    here = here or host_view()["net"]
    return sorted({f"{h.host} (worker rank {h.rank})" for h in hosts if h.net != here})


def store_host(bind_host: str, hosts: list[WorkerHost], settings: ServerSettings,
               here: str | None = None) -> str:
    """The address to hand every worker (module docstring)."""
    remote = remote_hosts(hosts, here)
    if not remote:
        return "127.0.0.1" if bind_host in ANY else bind_host
    if bind_host in LOOPBACK or bind_host.startswith("127."):
        raise Unreachable(
            f"this engine has workers on {', '.join(remote)}, which cannot reach the "
            f"data-plane store listening on {bind_host}: serve with --host 0.0.0.0 (or "
            "--data-plane-host set to an address they reach)")
    if settings.data_plane_advertise_host:  # said outright: wins (a NAT, a proxy)
        return settings.data_plane_advertise_host
    if bind_host not in ANY:
        return bind_host
    if settings.nnodes > 1:
        return settings.master_addr
    from vllm.utils.network_utils import get_ip

    ip = get_ip()
    if ip in ANY:
        raise Unreachable(
            f"this engine has workers on {', '.join(remote)} and no routable address of "
            "this host was found for them to reach the data-plane store: set "
            "--data-plane-advertise-host (or VLLM_HOST_IP)")
    return ip
