"""Every route the server serves declares who may call it, and the open
ones are exactly the list in tests/route_table.py; the front door finds
every route by its own template, so /metrics labels each by name (the list
it kept by hand had drifted: 16 of 33 routes counted as `other`). No engine:
the app is built, not started."""

from __future__ import annotations

from rollout_sidecar.server.auth import Access
from rollout_sidecar.server.front_door import body_limit, route_of
from tests.route_table import OPEN, served_routes


def test_every_route_declares_its_access_and_the_open_ones_are_listed():
    routes = served_routes()
    assert len(routes) > 30
    undeclared = [f"{r.method} {r.path}" for r in routes if r.access is None]
    assert not undeclared, f"routes with no declared access (server/auth.py): {undeclared}"
    opened = {r.path for r in routes if r.access is Access.OPEN}
    assert opened == OPEN & {r.path for r in routes}, opened ^ OPEN


def test_the_front_door_labels_every_route_by_its_template_and_bounds_its_body():
    from pydantic import SecretStr

    from rollout_sidecar.server.app import create_app
    from rollout_sidecar.server.config import ServerSettings

    app = create_app(ServerSettings(admin_token=SecretStr("a-0123456789"),
                                    max_request_bytes=1 << 20))
    for r in served_routes():
        scope = {"type": "http", "method": r.method, "path": r.url_path, "root_path": ""}
        found = route_of(app.router.routes, scope)
        assert found is not None and found.path == r.path, (r, found)
        limit = body_limit(found, 1 << 20)
        assert limit == (None if r.path == "/weights/bucket/{index}" else
                         4096 if r.access is Access.OPEN else 1 << 20), r
    assert route_of(app.router.routes, {"type": "http", "method": "GET", "path": "/nope",
                                        "root_path": ""}) is None
