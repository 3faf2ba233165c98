"""Servers started ahead of the tests that use them.

Why: a server start is about a minute of one core (three interpreters import
vLLM one after another: the API process, the engine core, its worker), and a
CI machine has two cores. Started one by one, on demand, the suite's ~30
fixture servers leave a core idle for half an hour.

So fixtures name their server with a `ServerSpec` (`@serves(spec)` on the
fixture function). Once collection is done, `plan_from(items)` reads which
of those fixtures the tests will set up and in what order, and the plan
launches them in that order in the background (`launch_server(wait=False)`):
`LOOKAHEAD` starts in flight at once, and up to `MAX_AHEAD` servers launched
and not taken yet, while memory allows. A watcher thread per start launches
the next one as soon as it is ready, not at the next test's boundary: tests
that leave a core idle (waiting on replicas, containers, deadlines) then
fill it with starts, each ready, or nearly, when its turn comes. A ready
server waiting for its test costs memory, not CPU.

A test marked `quiet` (it asserts about wall-clock time: a deadline, a
liveness miss, a drain) runs with nothing starting beside it: before it
starts, the plan waits for every start in flight; while it runs, none begins.
A server that fails to start fails the test that takes it, as it would have
without the plan; one that no test took is stopped at the end of the session.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from rollout_sidecar.server.launcher import ServerProcess, launch_server, stop_process

# Starts in flight at once beside the running tests: two keep both cores busy
# while a test runs on one (a start is single-threaded imports, then a short
# warm-up).
LOOKAHEAD = 2
# Servers launched ahead and not taken yet, ready or starting.
MAX_AHEAD = 4
# No start ahead with less memory than this available (CI's machines: 24 GiB,
# no swap), plus START_GIB for each start in flight (not yet at its full size):
# a start, then what the running test starts itself, must fit.
MIN_AVAILABLE_GIB = 5
START_GIB = 1.5
# Every test server gets these (see `ServerSpec.full_env`).
# KV cache: 0.25 GiB (87k tokens of the default model), ample for every test's
# batches; VLLM_CPU_KVCACHE_SPACE=1 made each server 1 GiB of resident zeros.
TEST_ENV = {"ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25",
            "ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S": "3",
            # Each torchrun worker is a new trainer: no waiting out the last one's lease.
            "ROLLOUT_SIDECAR_CONNECTION_LEASE_S": "1",
            "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class ServerSpec:
    """What a fixture's server is; equal specs are the same planned server."""

    name: str  # its log's name and its folder
    dtype: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    max_model_len: int | None = 512
    model: str | None = None  # a hub id or a path; None: the embedded default
    family: str | None = None  # a tests/fidelity/zoo family, written before the start
    fault_file: bool = False  # ROLLOUT_SIDECAR_TEST_FAULT_FILE, empty (no fault) at start
    # Writes what the server needs into its folder before the start (a hub
    # cache); returns environment for it.
    prepare: Callable[[Path], Mapping[str, str]] | None = None

    @classmethod
    def of(cls, name: str, env: Mapping[str, str] | None = None, **kw: Any) -> ServerSpec:
        return cls(name, env=tuple(sorted((env or {}).items())), **kw)


def serves(*specs: ServerSpec | Callable[[Any], ServerSpec]) -> Callable:
    """Mark a fixture function as taking these servers from the plan; a
    callable spec gets the fixture's param (parametrized fixtures)."""
    def mark(fn: Callable) -> Callable:
        fn.server_specs = specs
        return fn
    return mark


def plan_from(items: Iterable[pytest.Item]) -> list[ServerSpec]:
    """The specs of `@serves` fixtures in the order the tests first set them up."""
    order: list[ServerSpec] = []
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in item.fixturenames:
            defs = info.name2fixturedefs.get(name)
            specs = getattr(defs[-1].func, "server_specs", ()) if defs else ()
            for spec in specs:
                spec = spec(params.get(name)) if callable(spec) else spec
                if spec not in order:
                    order.append(spec)
    return order


class ServerPlan:
    """Launches planned servers ahead; `take` hands one over, ready."""

    def __init__(self, order: list[ServerSpec], lookahead: int = LOOKAHEAD,
                 max_ahead: int = MAX_AHEAD) -> None:
        self.todo = list(order)  # planned, not launched yet
        self.lookahead = lookahead
        self.max_ahead = max_ahead
        self.root: Path | None = None  # set by the `server_plan` fixture (pytest's tmp)
        self.launched: dict[ServerSpec, ServerProcess] = {}  # launched, not taken yet
        self.starting: set[ServerSpec] = set()  # launched ahead, not ready yet (taken or not)
        self.quiet = False
        # The watcher threads launch too: one lock over todo, launched and starting.
        self.lock = threading.RLock()

    def take(self, spec: ServerSpec, **overrides: Any) -> Any:
        """The server `spec` names, ready (a `tests.conftest.Server`);
        `overrides` (ports, tokens: a restart) start a fresh one instead."""
        from tests.conftest import as_server

        if overrides:
            proc = self._launch(spec, **overrides)
        else:
            with self.lock:
                if spec in self.todo:
                    self.todo.remove(spec)
                proc = self.launched.pop(spec, None) or self._launch(spec)
            self.prefetch()
        with proc.stopped_on_error():
            proc.wait_ready(300)
            return as_server(proc, self.folder(spec))

    def prefetch(self) -> None:
        with self.lock:
            while (self.root is not None and not self.quiet and self.todo
                   and len(self.starting) < self.lookahead
                   and len(self.launched) < self.max_ahead
                   and memory_to_spare(len(self.starting))):
                spec = self.todo.pop(0)
                proc = self._launch(spec)
                self.launched[spec] = proc
                self.starting.add(spec)
                threading.Thread(target=self._watch, args=(spec, proc), daemon=True,
                                 name=f"plan-{spec.name}").start()

    def _watch(self, spec: ServerSpec, proc: ServerProcess) -> None:
        """Wait for a start ahead, then launch the next one."""
        try:
            proc.wait_ready(300)
        except Exception:  # noqa: BLE001 - the test that takes it reports it
            pass
        with self.lock:
            self.starting.discard(spec)
        self.prefetch()

    def set_quiet(self, quiet: bool) -> None:
        """A `quiet` test is next (True: nothing launches from now on) or done."""
        with self.lock:  # no launch is half done past this point
            self.quiet = quiet
        if not quiet:
            self.prefetch()

    def settle(self, timeout_s: float = 300) -> None:
        """Wait for the starts in flight (before a `quiet` test)."""
        deadline = time.monotonic() + timeout_s
        while self.starting and time.monotonic() < deadline:
            time.sleep(0.2)

    def close(self) -> None:
        with self.lock:
            self.todo.clear()
            self.root = None  # a watcher that wakes now launches nothing
            for proc in self.launched.values():
                stop_process(proc.proc)
            self.launched.clear()

    def folder(self, spec: ServerSpec) -> Path:
        assert self.root is not None, "take servers through the server_plan fixture"
        return self.root / spec.name

    def _launch(self, spec: ServerSpec, **overrides: Any) -> ServerProcess:
        folder = self.folder(spec)
        folder.mkdir(parents=True, exist_ok=True)
        env = {"ROLLOUT_SIDECAR_CACHE_DIR": str(cache_dir(folder)), **TEST_ENV,
               **dict(spec.env)}
        if spec.fault_file:
            fault = folder / "fault"
            fault.write_text("")
            env["ROLLOUT_SIDECAR_TEST_FAULT_FILE"] = str(fault)
        if spec.prepare is not None:
            env.update(spec.prepare(folder))
        model: str | Path | None = spec.model
        if spec.family is not None:
            from tests.fidelity.zoo import write_family

            model = folder / spec.family
            if not (model / "config.json").exists():
                write_family(spec.family, model)
        log_name = overrides.pop("log_name", spec.name)
        return launch_server(log=folder / f"{log_name}.log", model=model, dtype=spec.dtype,
                             max_model_len=spec.max_model_len, env=env, wait=False,
                             **overrides)


def memory_to_spare(starting: int = 0) -> bool:
    """Room for one more start beside what runs now and the `starting` ones
    (a ready CPU server of the default model holds about 1.7 GiB PSS with
    TEST_ENV's KV cache, measured; a TP-2 one has a worker more; tests start
    trainers and servers of their own)."""
    need = MIN_AVAILABLE_GIB + START_GIB * starting
    return psutil.virtual_memory().available >= need * 2**30


def cache_dir(tmp: Path) -> Path:
    """Where test servers cache compiled and downloaded files."""
    return Path(os.environ.get("ROLLOUT_SIDECAR_TEST_CACHE", tmp / "cache"))
