"""Who may call what, on a running server: every route of the app's own
route table (tests/route_table.py) x every way a caller might present a
credential (none, wrong, empty, whitespace, the API token, the admin token,
as Bearer and as Basic, a made-up peer proof). A route is let through only
with the credential its access names: the API token never opens an admin
route, an empty or whitespace one never opens anything, and an open route
needs none. A new route is in the table the moment it is served, so it
cannot ship open by accident (the unit test refuses an undeclared one).

Bodies are empty JSON objects: an authorized call is refused by its own
checks (400/404/409/422/501) and changes nothing."""

from __future__ import annotations

import base64
import socket

import httpx
import pytest

from rollout_sidecar.server.auth import Access
from tests.route_table import served_routes


def basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"user:{password}".encode()).decode()


def credentials(api: str, admin: str) -> dict[str, tuple[str | None, set[Access]]]:
    """name -> (Authorization header, the accesses it opens besides open routes)."""
    return {
        "none": (None, set()), "wrong": ("Bearer not-a-token", set()),
        # HTTP strips a header's trailing white space ("Bearer " arrives as
        # "Bearer"); test_auth_units.py covers it at the check itself.
        "empty bearer": ("Bearer", set()), "empty basic": (basic(""), set()),
        "whitespace basic": (basic("   "), set()), "made-up peer proof": ("Peer aa.bb", set()),
        "api bearer": (f"Bearer {api}", {Access.API}), "api basic": (basic(api), {Access.API}),
        "admin bearer": (f"Bearer {admin}", {Access.ADMIN, Access.PEER}),
        "admin basic": (basic(admin), {Access.ADMIN, Access.PEER}),
    }


def test_every_route_lets_through_only_the_credential_it_names(server):
    routes = served_routes()
    refused: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, (header, opens) in credentials(server.api_token, server.admin_token).items():
            for r in routes:
                headers = {"Authorization": header} if header is not None else {}
                body = None if r.method == "GET" else {}
                status = http.request(r.method, r.url_path, headers=headers,
                                      json=body).status_code
                let_through = status not in (401, 403)
                should = r.access is Access.OPEN or r.access in opens
                if let_through != should:
                    refused.append(f"{r.method} {r.path} with {name}: {status}")
    assert not refused, "\n".join(refused)


@pytest.mark.parametrize("path, token, status", [
    ("/generate", None, 401), ("/weights/begin", None, 401),
    ("/weights/begin", "admin", 413)])
def test_a_large_body_is_refused_from_its_headers_alone(server, path, token, status):
    """The 401 (no token), or the 413 (over max_request_bytes), comes from
    the headers: the body, declared 256 MiB and never sent, is not waited for."""
    auth = f"Authorization: Bearer {server.admin_token}\r\n" if token else ""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: "
                     f"application/json\r\nContent-Length: {256 << 20}\r\n\r\n".encode())
        head = sock.recv(4096).decode(errors="replace")
    assert head.startswith(f"HTTP/1.1 {status} "), head


def test_the_open_metrics_do_not_show_the_model_path_info_keeps_behind_a_token(server):
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert "vllm:" in metrics and str(server.model_path) not in metrics
    assert f'model_name="{server.model_path.name}"' in metrics
