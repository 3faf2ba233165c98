"""How a client or a pusher reaches the servers: their URLs (one, several, or
a DNS name that stands for many: a Kubernetes headless Service) and the bearer
header of a token. Both sides use it, so a URL list means the same replicas
to the rollouts and to the trainer.

    "http://a:8000"                      one replica
    "http://a:8000,http://b:8000"        two (also a list of strings)
    "dns+http://rollout-sidecar:8000"    every address the name resolves to

The `dns+` form is explicit because resolving every host name to all of its
addresses would turn `localhost` into two replicas (::1 and 127.0.0.1) and
break name-based TLS. It is re-resolved on each call, so a replica that
restarted on a new address is found again.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "http://127.0.0.1:8000"
DNS_PREFIX = "dns+"


def expand_urls(urls: str | Sequence[str] | None, env_var: str = "ROLLOUT_SIDECAR_URL"
                ) -> list[str]:
    """Base URLs of every replica, in a stable order (sorted after DNS)."""
    out: list[str] = []
    for item in url_items(urls, env_var):
        for url in (_resolve(item[len(DNS_PREFIX):]) if item.startswith(DNS_PREFIX)
                    else [item]):
            if url not in out:
                out.append(url)
    if not out:
        raise ValueError(f"no server URL in {urls!r}")
    return out


def url_items(urls: str | Sequence[str] | None, env_var: str = "ROLLOUT_SIDECAR_URL"
              ) -> list[str]:
    """The items of `urls` (default: $`env_var`) as given, `dns+` names unresolved."""
    if urls is None:
        urls = os.environ.get(env_var) or DEFAULT_URL
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return [u for u in (i.strip().rstrip("/") for i in items) if u]


def _resolve(url: str) -> list[str]:
    """`http://name:port` -> one URL per address `name` resolves to."""
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"dns+ needs a host and a port: {DNS_PREFIX}{url}")
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {parts.hostname}: {e}") from e
    addrs = sorted({str(info[4][0]) for info in infos})
    return [urlunsplit(parts._replace(netloc=f"{_host(a)}:{parts.port}")) for a in addrs]


def _host(addr: str) -> str:
    return f"[{addr}]" if ipaddress.ip_address(addr).version == 6 else addr


def auth_headers(token: str | None) -> dict[str, str]:
    """The bearer header of `token` (no header without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}
