"""Unit tests of a replica's leave and of a joiner's hold, at the front door
(server/front_door.py) and `POST /drain` (server/drain/router.py), on the
real route table and access rules. The engine and the push session are
stand-ins (a counter of requests in flight, the push running or None): a
fake engine, said here, because what is tested is which requests pass and
when the drain answers. Real servers leaving and joining under a trainer and
clients: bench/elastic_fleet.py (docs/replicas.md)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
from fastapi import APIRouter, FastAPI, Response

from rollout_sidecar.protocol.schema import routes
from rollout_sidecar.server.app_state import Services
from rollout_sidecar.server.auth import serve
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.drain import router as drain
from rollout_sidecar.server.drain.router import QUIET_S
from rollout_sidecar.server.front_door import FrontDoor
from rollout_sidecar.server.metrics.collectors import ServerMetrics
from rollout_sidecar.server.weights.peer_auth import PeerAnswerer

ADMIN, API = "a" * 24, "b" * 24
stub = APIRouter()


@serve(stub, routes.INFO)  # a generation route (Access.API)
async def info() -> Response:
    return Response(b"{}", media_type="application/json")


@serve(stub, routes.STATUS)  # where a trainer's push starts (Access.PEER)
async def status() -> Response:
    return Response(b"{}", media_type="application/json")


@serve(stub, routes.ABORT)  # a push already begun goes on (Access.ADMIN)
async def abort() -> Response:
    return Response(b"{}", media_type="application/json")


def app_and_state() -> tuple[FastAPI, Services, SimpleNamespace]:
    settings = ServerSettings(admin_token=ADMIN, api_token=API)
    state = Services(settings, ServerMetrics(), PeerAnswerer(ADMIN), "boot")
    work = SimpleNamespace(gate=SimpleNamespace(in_flight=0),
                           session=SimpleNamespace(current=None))
    state.engine, state.weights = work, work  # type: ignore[assignment]
    app = FastAPI()
    app.state.services = state
    app.include_router(stub)
    app.include_router(drain.router)
    app.add_middleware(FrontDoor, state=state, routes=app.router.routes)
    return app, state, work


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s")


def calls(app: FastAPI) -> dict[str, int]:
    async def run() -> dict[str, int]:
        async with client(app) as c:
            api, admin = {"Authorization": f"Bearer {API}"}, {"Authorization": f"Bearer {ADMIN}"}
            return {"info": (await c.get("/info", headers=api)).status_code,
                    "status": (await c.get("/weights/status", headers=admin)).status_code,
                    "abort": (await c.post("/weights/abort", headers=admin)).status_code}
    return asyncio.run(run())


def test_a_draining_replica_refuses_new_work_and_lets_a_begun_push_finish():
    app, state, _ = app_and_state()
    assert calls(app) == {"info": 200, "status": 200, "abort": 200}
    state.draining = True
    assert calls(app) == {"info": 503, "status": 503, "abort": 200}


def test_a_replica_held_from_serving_refuses_generation_only_saying_why():
    app, state, _ = app_and_state()
    state.serving_held = "catching up from a peer"

    async def run() -> httpx.Response:
        async with client(app) as c:
            return await c.get("/info", headers={"Authorization": f"Bearer {API}"})
    r = asyncio.run(run())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"] == "not serving yet: catching up from a peer"
    assert calls(app) == {"info": 503, "status": 200, "abort": 200}


def test_a_drain_answers_once_no_request_push_or_push_call_is_left():
    app, state, work = app_and_state()
    work.gate.in_flight, work.session.current = 2, SimpleNamespace(push_id="p7")

    async def run() -> tuple[dict, float, list[str]]:
        async with client(app) as c:
            admin = {"Authorization": f"Bearer {ADMIN}"}
            answer = asyncio.create_task(c.post("/drain", json={"timeout_s": 60},
                                                headers=admin))
            seen = []
            await asyncio.sleep(0.3)
            seen.append("waiting" if not answer.done() else "answered")
            work.gate.in_flight = 0  # the requests finished; the push runs on
            await asyncio.sleep(0.3)
            seen.append("waiting" if not answer.done() else "answered")
            work.session.current = None  # the push committed: its probe comes next
            t_call = time.monotonic()
            assert (await c.post("/weights/abort", headers=admin)).status_code == 200
            r = await answer
            return r.json(), time.monotonic() - t_call, seen

    body, after_call, seen = asyncio.run(run())
    assert seen == ["waiting", "waiting"]  # never while work is in flight
    assert body["drained"] is True and body["requests_in_flight"] == 0
    assert after_call >= QUIET_S  # a quiet second after the last push call, at least
    assert state.draining


def test_a_drain_that_runs_out_says_what_is_left():
    app, _, work = app_and_state()
    work.session.current = SimpleNamespace(push_id="p9")

    async def run() -> dict:
        async with client(app) as c:
            r = await c.post("/drain", json={"timeout_s": 0.3},
                             headers={"Authorization": f"Bearer {ADMIN}"})
            return r.json()
    body = asyncio.run(run())
    assert body["drained"] is False and body["push_in_flight"] == "p9"


def test_a_drain_needs_the_admin_token_and_its_timeout():
    """The API token is refused before the body is read; an empty body (a
    probe, a fuzzer, a route-access test) drains nothing: a drain cannot be
    undone."""
    app, state, _ = app_and_state()

    async def run() -> tuple[int, int]:
        async with client(app) as c:
            api = await c.post("/drain", json={"timeout_s": 1},
                               headers={"Authorization": f"Bearer {API}"})
            empty = await c.post("/drain", json={},
                                 headers={"Authorization": f"Bearer {ADMIN}"})
            return api.status_code, empty.status_code
    assert asyncio.run(run()) == (401, 422) and not state.draining


def test_a_wrong_credential_gets_its_401_while_draining():
    app, state, _ = app_and_state()
    state.draining = True

    async def run() -> int:
        async with client(app) as c:
            return (await c.get("/info", headers={"Authorization": "Bearer nope"})).status_code
    assert asyncio.run(run()) == 401
