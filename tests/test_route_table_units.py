"""One route table (protocol/schema/routes.py): the server serves exactly
its rows, each with the access its row declares; the open ones are the
probes, the scrape, the peer challenge and FastAPI's pages; the front door
finds every route by its own template, so /metrics labels each by name (the
list it kept by hand had drifted: 16 of 33 routes counted as `other`);
docs/api.md lists every row; the trainer's admin client sends each body as
its row's model. No engine: the app is built, not started."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.protocol.schema.routes import ROUTES
from rollout_sidecar.server.auth import Access
from rollout_sidecar.server.front_door import body_limit, route_of
from rollout_sidecar.trainer.control.admin_client import WeightAdminClient
from tests.route_table import FASTAPI_PAGES, OPEN, served_routes


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


def test_the_served_routes_are_the_shared_tables_rows():
    """Each served route is a row of protocol/schema/routes.py with the same
    method, path and access, and each row is served: a route added, renamed
    or reclassified on one side only fails here."""
    served = {(r.method, r.path, r.access) for r in served_routes()
              if r.path not in FASTAPI_PAGES}
    table = {(r.method, r.path, r.access) for r in ROUTES}
    assert served == table, {"served, not in the table": served - table,
                             "in the table, not served": table - served}
    assert len(ROUTES) == len({(r.method, r.path) for r in ROUTES})


def test_docs_api_lists_every_route():
    """docs/api.md's route list names every row (a parameter as N:
    `PUT /weights/bucket/N`)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    listed = text[text.index("## Routes"):text.index("## `POST /generate`")]
    missing = [f"{r.method} {r.path}" for r in ROUTES
               if f"{re.sub(r'{[^}]+}', 'N', r.path)}`" not in listed]
    assert not missing, f"docs/api.md's route list lacks {missing}"


def _admin_capturing() -> tuple[WeightAdminClient, list[httpx.Request]]:
    sent: list[httpx.Request] = []
    answers = {
        routes.CONNECT.path: {"connection_id": "c1", "backend": "gloo"},
        routes.BEGIN.path: {"push_id": "p1", "deadline_s": 9.0, "commit_policy": "abort"},
        routes.PREPARE.path: {"push_id": "p1", "deadline_s": 9.0, "timings": {}},
        routes.COMMIT.path: {"weight_version": 3, "push_id": "p1", "commit_policy": "abort",
                             "timings": {}},
        routes.ABORT.path: {"version": 2, "outcome": "aborted"},
        routes.DISCONNECT.path: {"connection_id": "c1", "released": True, "connected": None},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=answers.get(request.url.path, {}))

    admin = WeightAdminClient("http://r", "admin-token")
    admin._http = httpx.Client(base_url="http://r", transport=httpx.MockTransport(handler))
    return admin, sent


def test_the_admin_client_sends_each_body_as_the_routes_model():
    """Every body the trainer's admin client sends goes to its row's method
    and path and validates as that row's request model, on the server's side
    of the wire (the body the server reads); a field at its default is left
    out (a server that predates it refuses it), a secret goes in clear."""
    admin, sent = _admin_capturing()
    secret = bytes(range(32))
    admin.connect("c1", "gloo", 30.0, trainer_id="t", world_size=3, secret=secret,
                  bucket_macs=False, senders=2, ring_starts=[2], slot_pieces=True)
    admin.connect("c2", "nccl", 30.0)
    slot = {"name": "w", "dtype": "float32", "shape": [2], "offset": 0}
    admin.begin(3, "gloo", [{"index": 0, "nbytes": 8, "params": [slot]}], "c1", None, 9.0,
                check="sum64")
    admin.begin(4, "http", [], None, "abort", 9.0, delta_base=3)
    admin.prepare("p1", [7], 9.0, macs=["ab" * 16])
    admin.commit("p1", None, 9.0)
    admin.abort("p1", "why")
    admin.disconnect("c1", "t")
    bodies = []
    for request in sent:
        row = next(r for r in ROUTES if (r.method, r.path) == (request.method, request.url.path))
        body = json.loads(request.content)
        assert row.request is not None, row
        parsed = row.request.model_validate(body)  # what the server's router does
        assert parsed.model_dump(exclude_defaults=True, exclude_none=True).keys() == body.keys()
        bodies.append(body)
    connect, plain = bodies[0], bodies[1]
    assert connect["secret"] == secret.hex() and connect["bucket_macs"] is False
    assert (connect["senders"], connect["ring_starts"], connect["world_size"]) == (2, [2], 3)
    assert connect["slot_pieces"] is True and "slot_pieces" not in plain
    assert "senders" not in plain and "ring_starts" not in plain and "secret" not in plain
    assert plain["backend"] == "nccl" and "bucket_macs" not in plain
    assert bodies[2]["check"] == "sum64" and "check" not in bodies[3]
    assert bodies[3]["delta_base"] == 3 and bodies[3]["buckets"] == []


def test_a_route_refuses_a_body_of_another_routes_model():
    from rollout_sidecar.protocol.schema import AbortRequest

    with pytest.raises(TypeError, match="CommitRequest"):
        routes.COMMIT.body(AbortRequest(push_id="p"))
