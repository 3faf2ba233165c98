"""Shared fixtures: one real vLLM CPU server per test session (started by
rollout_sidecar.server.launcher, the one launcher the demo and benches use too)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from rollout_sidecar.server.launcher import (
    DEFAULT_ENV,
    ChildProcess,
    ServerProcess,
    free_port,
    launch_server,
    stop_process,
)
from tests import processes, rank_pool, server_pause
from tests.server_plan import (
    TEST_ENV,
    WORKER_PROCESS,
    ServerPlan,
    ServerSpec,
    cache_dir,
    patched,
    plan_from,
    serves,
    surface,
)
from tests.server_zygote import Zygote

REPO = Path(__file__).resolve().parents[1]
__all__ = ["REPO", "Server", "ServerSpec", "free_port", "run_torchrun", "serves", "start_server",
           "stop_server"]


@dataclass
class Server:
    url: str
    api_token: str
    admin_token: str
    model_path: Path
    proc: ChildProcess
    log: Path
    port: int = 0
    dp_port: int = 0
    tmp: Path | None = None  # its folder
    failpoints: Path | None = None  # `serve --failpoints FILE`, if it has one

    def client(self, **kw):
        from rollout_sidecar.client import GenerationClient

        return GenerationClient(self.url, api_token=self.api_token, **kw)


def as_server(s: ServerProcess, tmp: Path) -> Server:
    """A ready `ServerProcess` as the tests' `Server` (stopped if /info fails)."""
    with s.stopped_on_error():
        model_path = Path(s.info()["model"])
    return Server(s.url, s.api_token, s.admin_token, model_path, s.proc, s.log, s.port,
                  s.data_plane_port, tmp=tmp, failpoints=s.failpoints)


def start_server(tmp: Path, name: str, extra_env: dict | None = None,
                 model: Path | str | None = None, dtype: str | None = None,
                 like: Server | None = None, max_model_len: int | None = 512,
                 tokens_of: Server | None = None) -> Server:
    """A real server on free ports, started now (a server a test starts
    itself; fixtures take theirs from the plan); `like` restarts one on its
    ports and tokens; `tokens_of` shares a server's tokens only (replicas)."""
    tokens_of = like or tokens_of
    env = {"ROLLOUT_SIDECAR_CACHE_DIR": str(cache_dir(tmp)), **TEST_ENV, **(extra_env or {})}
    s = launch_server(log=tmp / f"{name}.log", model=model, dtype=dtype,
                      max_model_len=max_model_len or None, env=env,
                      port=like.port if like else None,
                      data_plane_port=like.dp_port if like else None,
                      api_token=tokens_of.api_token if tokens_of else None,
                      admin_token=tokens_of.admin_token if tokens_of else None,
                      ready_timeout_s=300, popen=PLAN.machine.popen)
    return as_server(s, tmp)


def run_torchrun(worker: Path, args: list[str], srv: Server, nproc: int = 2) -> None:
    """`worker` on torchrun's gloo ranks (a job of the session's rank pool:
    tests/rank_pool.py), with `srv`'s tokens in the environment and the repo
    importable; fails the test with the ranks' output if any rank fails."""
    proc = rank_pool.run(
        worker, args, nproc=nproc,
        env=processes.repo_env(ROLLOUT_SIDECAR_ADMIN_TOKEN=srv.admin_token,
                               ROLLOUT_SIDECAR_API_TOKEN=srv.api_token),
        timeout_s=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


# Servers let go by `stop_server(wait=False)`, stopping beside the tests.
# Why: a server's stop is 5 s (vLLM's engine core spends them in the
# interpreter's last collection before its parent kills it), which no test
# waits for unless it starts a server on the stopped one's ports.
STOPPING: list[threading.Thread] = []


def stop_server(server: Server, wait: bool = True) -> None:
    """Stop `server` (SIGTERM, then the deadlines of `stop_process`); with
    `wait=False` in the background, the session waiting for it at its end and
    before a `quiet` test."""
    if wait:
        stop_process(server.proc)
        return
    stopping = threading.Thread(target=stop_process, args=(server.proc,), daemon=True,
                                name=f"stop {server.url}")
    stopping.start()
    STOPPING.append(stopping)


def wait_for_stops() -> None:
    while STOPPING:
        STOPPING.pop().join(120)


# The servers shared past a module (session and package scope), by fixture
# name: paused for the tests that do not use them (tests/server_pause.py).
# Idle, each spent 0.05 CPU-s a second, the session's for half an hour.
SHARED: dict[str, Server] = {}
USED: dict[str, bool] = {}  # whether the last test used each (the run's record only)


def server_fixture(spec: ServerSpec, scope: str = "module") -> Any:
    """A fixture that takes `spec`'s server from the plan for its `scope`
    and stops it after: `srv = server_fixture(SPEC)` in a test module."""
    @pytest.fixture(scope=scope)
    @serves(spec)
    def fixture(server_plan, request):
        s = server_plan.take(spec)
        if scope in ("session", "package"):
            SHARED[request.fixturename] = s
        yield s
        SHARED.pop(request.fixturename, None)
        stop_server(s, wait=False)
    return fixture


def share_between(item: pytest.Item) -> None:
    """Before `item`: the shared servers it uses run, the others pause (and
    the run's record says when each stops or starts being used)."""
    for name, s in SHARED.items():
        used = name in item.fixturenames
        (server_pause.resume if used else server_pause.pause)(s.proc)
        if USED.get(name, True) != used:
            PLAN.note(f"{name}: {'in use from' if used else 'paused from'} {item.nodeid}")
        USED[name] = used


# The servers fixtures take (`@serves`), launched ahead of their tests
# (tests/server_plan.py): built once collection has ordered the tests.
PLAN = ServerPlan([])
# The product's own layout (a worker process; server_plan.WORKER_PROCESS).
DEFAULT = ServerSpec.of("server", env=WORKER_PROCESS)


def pytest_sessionstart(session):
    # One cache of the default model for the session's servers, demos and
    # doctors: the first start writes it (in a child process of its own,
    # server/model/default_model.py), every later one reads it.
    if "ROLLOUT_SIDECAR_TEST_CACHE" not in os.environ:
        basetemp = session.config._tmp_path_factory.getbasetemp()
        os.environ["ROLLOUT_SIDECAR_TEST_CACHE"] = str(basetemp / "default-model-cache")


def pytest_collection_finish(session):
    PLAN.todo = plan_from(session.items)
    # The compose test's images build beside the suite (tests/compose/image_build.py).
    if not session.config.option.collectonly and any(
            item.name == "test_compose_up_runs_the_demo" for item in session.items):
        from tests.compose.image_build import BUILD, docker_answers

        if docker_answers():
            BUILD.start()


# What the session's plan reads, as it was when the session began: a test
# that patches any of it (the class, the module, psutil's calls) could make
# the plan's monitor launch the next real server through its fake, so the
# test that does fails, by name, before its teardown undoes the patch.
PLAN_SURFACE = surface()


def fail_if_plan_patched(item: pytest.Item, phase: str) -> None:
    names = patched(PLAN_SURFACE, surface())
    if names:
        pytest.fail(f"{item.nodeid} patched what the session's server plan reads during its "
                    f"{phase}: {', '.join(names)}; build a ServerPlan of your own with a fake "
                    "Machine (tests/test_server_plan_units.py)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    fail_if_plan_patched(item, "call")
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    quiet = item.get_closest_marker("quiet") is not None
    PLAN.set_quiet(quiet)
    share_between(item)
    if quiet:
        from tests.compose.image_build import BUILD

        PLAN.settle()
        BUILD.settle()
        wait_for_stops()


def pytest_sessionfinish(session):
    from tests.compose.image_build import BUILD

    BUILD.stop()
    rank_pool.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    # A teardown may talk to any server its fixtures hold.
    for s in SHARED.values():
        server_pause.resume(s.proc)


def pytest_runtest_logfinish(nodeid, location):
    PLAN.set_quiet(False)


@pytest.fixture(scope="session", autouse=True)
def server_plan(tmp_path_factory):
    PLAN.root = tmp_path_factory.mktemp("servers")
    # Planned servers fork from one process that has imported the server
    # (tests/server_zygote.py), where their environment allows it.
    zygote = Zygote(PLAN.root / "zygote", {**DEFAULT_ENV, **os.environ, **TEST_ENV}) \
        if PLAN.todo else None
    if zygote is not None:
        PLAN.machine = replace(PLAN.machine, popen=zygote.popen)
    PLAN.prefetch()
    PLAN.start_monitor()
    yield PLAN
    server_pause.resume_all()
    wait_for_stops()
    PLAN.close()
    if zygote is not None:
        zygote.close()


server = server_fixture(DEFAULT, scope="session")


FP32 = ServerSpec("fp32", dtype="float32")


# The default model served in float32, for the modules that need nothing else
# of their server (test_openai.py, test_peft_push.py): one start, not one per
# module. Each reads the version it starts from.
fp32_server = server_fixture(FP32, scope="session")


# Folders whose tests start a real engine, torchrun ranks or Docker: marked
# `e2e`, so `tests/run.sh --fast` (-m "not e2e") leaves them out. A test
# elsewhere that takes a server fixture is marked too.
E2E_DIRS = {"e2e", "fidelity", "reliability", "compose", "integrations"}
SERVER_FIXTURES = {"server", "reliable"}


def pytest_collection_modifyitems(config, items):
    def folder(item: pytest.Item) -> str:
        return Path(str(item.fspath)).resolve().relative_to(REPO / "tests").parts[0]

    for item in items:
        if folder(item) in E2E_DIRS or SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    # Modules with neither e2e nor quiet tests first: they run while the first
    # planned servers start, not at the end, where nothing else is left to
    # start beside them. Then compose (its images build meanwhile:
    # pytest_collection_finish), and tests/fidelity last: the suite's most
    # planned servers (one per family) start beside the tests before it that
    # leave a core idle (compose waits on its containers, reliability on its
    # replicas) instead of after them with nothing beside.
    heavy = {item.path for item in items
             if item.get_closest_marker("e2e") or item.get_closest_marker("quiet")}
    last = {"compose": 2, "fidelity": 3}

    def rank(item: pytest.Item) -> int:
        return last.get(folder(item), 1 if item.path in heavy else 0)

    items.sort(key=rank)
