"""Servers started ahead of the tests that use them.

Why: a server start is about a minute of one core (three interpreters import
vLLM one after another: the API process, the engine core, its worker), and a
CI machine has two cores. Started one by one, on demand, the suite's ~30
fixture servers leave a core idle for half an hour.

So fixtures name their server with a `ServerSpec` (`@serves(spec)` on the
fixture function). Once collection is done, `plan_from(items)` reads which
of those fixtures the tests will set up and in what order. When a fixture
takes its server, the plan launches the next `LOOKAHEAD` ones in the
background (`launch_server(wait=False)`): their starts overlap the tests
running now, and each is ready, or nearly, when its turn comes.

A test marked `quiet` (it asserts about wall-clock time: a deadline, a
liveness miss, a drain) runs with nothing starting beside it: before it
starts, the plan waits for every start in flight; while it runs, none begins.
A server that fails to start fails the test that takes it, as it would have
without the plan; one that no test took is stopped at the end of the session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from rollout_sidecar.server.launcher import ServerProcess, launch_server, stop_process

# Starts in flight beside the running tests: two keep both cores busy while a
# test runs on one (a start is single-threaded imports, then a short warm-up).
LOOKAHEAD = 2
# No start ahead with less memory than this available (CI's machines: 24 GiB,
# no swap): a start, then what the running test starts itself, must fit.
MIN_AVAILABLE_GIB = 5
# Every test server gets these (see `ServerSpec.full_env`).
TEST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1",
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

    def __init__(self, order: list[ServerSpec], lookahead: int = LOOKAHEAD) -> None:
        self.todo = list(order)  # planned, not launched yet
        self.lookahead = lookahead
        self.root: Path | None = None  # set by the `server_plan` fixture (pytest's tmp)
        self.launched: dict[ServerSpec, ServerProcess] = {}  # launched, not taken yet
        self.quiet = False

    def take(self, spec: ServerSpec, **overrides: Any) -> Any:
        """The server `spec` names, ready (a `tests.conftest.Server`);
        `overrides` (ports, tokens: a restart) start a fresh one instead."""
        from tests.conftest import as_server

        if overrides:
            proc = self._launch(spec, **overrides)
        else:
            if spec in self.todo:
                self.todo.remove(spec)
            proc = self.launched.pop(spec, None) or self._launch(spec)
            self.prefetch()
        with proc.stopped_on_error():
            proc.wait_ready(300)
            return as_server(proc, self.folder(spec))

    def prefetch(self) -> None:
        while (self.root is not None and not self.quiet and self.todo
               and len(self.launched) < self.lookahead and memory_to_spare()):
            spec = self.todo.pop(0)
            self.launched[spec] = self._launch(spec)

    def settle(self) -> None:
        """Wait for the starts in flight (before a `quiet` test)."""
        for proc in self.launched.values():
            if proc.proc.poll() is None:
                try:
                    proc.wait_ready(300)
                except Exception:  # noqa: BLE001 - the test that takes it reports it
                    pass

    def close(self) -> None:
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


def memory_to_spare() -> bool:
    """Room for one more start beside what runs now (a ready CPU server of the
    default model holds 2.45 GiB PSS, measured; a TP-2 one has a worker more;
    tests start trainers and servers of their own)."""
    return psutil.virtual_memory().available >= MIN_AVAILABLE_GIB * 2**30


def cache_dir(tmp: Path) -> Path:
    """Where test servers cache compiled and downloaded files."""
    return Path(os.environ.get("ROLLOUT_SIDECAR_TEST_CACHE", tmp / "cache"))
