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

Some tests leave a core idle for minutes (they wait on replicas, containers,
a frozen server). A monitor thread samples the machine's CPU every
`MONITOR_S`; while less than `IDLE_BUSY` of it is busy, it launches more
servers ahead, up to `MAX_AHEAD` waiting, as memory allows. Starts are
pulled into idle time only: launching everything early would move them into
busy stretches instead (in one full run, keeping two starts in flight at
all times took 2 minutes longer and left the idle tail no fuller).

A test marked `quiet` (it asserts about wall-clock time: a deadline, a
liveness miss, a drain) runs with nothing starting beside it: before it
starts, the plan waits for every start in flight; while it runs, none begins.
A start the monitor sees ready is paused until its test takes it
(tests/server_pause.py): a ready server that waits spends no CPU, so
starts pulled into idle time cost memory only. A server that fails to
start fails the test that takes it, as it would have without the plan; at
the end of the session every server the plan launched that still runs is
continued and stopped, whatever a test did with it.

What the plan does to the machine (launch, stop) and reads of it (CPU
times, memory, its period) is one `Machine`, bound when the plan is built.
Unit tests build a plan of their own with a fake `Machine`; nothing they
patch reaches the session's plan, and `surface()` lets the session check
that no test patched what the plan reads (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from rollout_sidecar.server.launcher import ServerProcess, launch_server, stop_process
from tests import server_pause
from tests.server_zygote import ForkedProcess

# Servers launched ahead, not taken yet: the next two always start beside the
# running tests (two keep both cores busy while a test runs on one; a start is
# single-threaded imports, then a short warm-up).
LOOKAHEAD = 2
# ...and up to this many while the cores idle (the monitor), memory allowing.
MAX_AHEAD = 4
# The monitor's period, and the machine's busy share under which it fills idle.
MONITOR_S = 2.0
IDLE_BUSY = 0.7
SETTLE_POLL_S = 0.2
# No start ahead with less memory than this available (CI's machines: 24 GiB,
# no swap), plus START_GIB for each start in flight (not yet at its full size):
# a start, then what the running test starts itself, must fit.
MIN_AVAILABLE_GIB = 5
START_GIB = 1.5
# Every test server gets these (see `ServerSpec.full_env`).
# KV cache: 0.25 GiB (87k tokens of the default model), ample for every test's
# batches; VLLM_CPU_KVCACHE_SPACE=1 made each server 1 GiB of resident zeros.
# The engine's worker: inside vLLM's engine-core process (vLLM-CPU keeps its
# uni executor when VLLM_ENABLE_V1_MULTIPROCESSING=0, platforms/cpu.py), one
# interpreter fewer per start: measured, a start 15.6 s and 14.7 CPU-s against
# 20.3 s and 19.6 CPU-s, the same tokens and logprobs. The engine core forked,
# not spawned: how vLLM starts it on GPU (vLLM-CPU spawns; the server keeps a
# method set in its environment, engine/engine_config.py), so a start skips the
# child's imports of vLLM and torch and its stop the interpreter's teardown:
# measured, start and stop 20.6 CPU-s against 30.3, ready in 19.2 s against
# 25.5. The servers whose tests prove something of the product's own CPU
# layout (the worker a process of its own, spawned: vLLM's mp executor, as
# `serve` runs on CPU) say so with WORKER_PROCESS; TP >= 2 servers have worker
# processes whatever this says, and spawn them (SPAWN). The API process itself
# is forked from the session's zygote where this environment allows it
# (tests/server_zygote.py): WORKER_PROCESS and SPAWN servers differ from it in
# keys vLLM reads, so they start as fresh interpreters.
SPAWN = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
WORKER_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **SPAWN}
TEST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_WORKER_MULTIPROC_METHOD": "fork",
            "ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25",
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
    failpoints: bool = False  # `serve --failpoints`, a file empty (no fault) at start
    shm_size: str | None = None  # a /dev/shm of its own, this size (launch_server; root)
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


def memory_to_spare(starting: int = 0, available: float | None = None) -> bool:
    """Room for one more start beside what runs now and the `starting` ones
    (a ready CPU server of the default model holds about 1.7 GiB PSS with
    TEST_ENV's KV cache, measured; a TP-2 one has a worker more; tests start
    trainers and servers of their own); `available` bytes, else the machine's."""
    need = MIN_AVAILABLE_GIB + START_GIB * starting
    if available is None:
        available = psutil.virtual_memory().available
    return available >= need * 2**30


def busy_share(before: Any, now: Any) -> float:
    """The machine's busy share of CPU time between two `psutil.cpu_times()`."""
    total = sum(now) - sum(before)
    idle = (now.idle - before.idle) + (getattr(now, "iowait", 0) - getattr(before, "iowait", 0))
    return 1 - idle / total if total > 0 else 1.0


def cache_dir(tmp: Path) -> Path:
    """Where test servers cache compiled and downloaded files."""
    return Path(os.environ.get("ROLLOUT_SIDECAR_TEST_CACHE", tmp / "cache"))


def launch_spec(folder: Path, spec: ServerSpec, **overrides: Any) -> ServerProcess:
    """Start `spec`'s server in `folder` (not waiting for it); `overrides`
    go to `launch_server` (ports, tokens: a restart; `log_name`)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {"ROLLOUT_SIDECAR_CACHE_DIR": str(cache_dir(folder)), **TEST_ENV, **dict(spec.env)}
    if spec.failpoints:
        overrides["failpoints"] = folder / "fault"
        overrides["failpoints"].write_text("")
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
                         shm_size=spec.shm_size, **overrides)


@dataclass(frozen=True)
class Machine:
    """What a plan does to the machine and reads of it. The defaults are
    bound here, once: a test that patches this module or psutil later does
    not change what the session's plan calls (unit tests pass fakes)."""

    launch: Callable[..., Any] = launch_spec  # (folder, spec, **overrides) -> a start
    stop: Callable[[Any], Any] = stop_process  # a start's process
    spare: Callable[[int], bool] = memory_to_spare  # room for one more start?
    cpu_times: Callable[[], Any] = psutil.cpu_times
    monitor_s: float = MONITOR_S
    # What a launch starts its process with (`launch_server`'s `popen`): the
    # session's zygote forks the servers it can (tests/server_zygote.py).
    popen: Callable[..., Any] = subprocess.Popen
    # A ready start that waits for its test, paused; continued when taken.
    pause: Callable[[Any], bool] = server_pause.pause
    resume: Callable[[Any], bool] = server_pause.resume


class ServerPlan:
    """Launches planned servers ahead; `take` hands one over, ready."""

    def __init__(self, order: list[ServerSpec], lookahead: int = LOOKAHEAD,
                 max_ahead: int = MAX_AHEAD, machine: Machine | None = None) -> None:
        self.machine = machine or Machine()
        self.todo = list(order)  # planned, not launched yet
        self.lookahead = lookahead
        self.max_ahead = max_ahead
        self.root: Path | None = None  # set by the `server_plan` fixture (pytest's tmp)
        self.launched: dict[ServerSpec, ServerProcess] = {}  # launched, not taken yet
        self.ready: set[ServerSpec] = set()  # launched ones the monitor saw ready
        # Every start, taken or not: what the session's end stops if it still runs.
        self.started: list[Any] = []
        self.quiet = False
        # The monitor launches too: one lock over todo, launched and ready.
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.monitor: threading.Thread | None = None

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
                self.ready.discard(spec)
                proc = self.launched.pop(spec, None) or self._launch(spec)
                self.machine.resume(proc.proc)
            self.prefetch()
        with proc.stopped_on_error():
            proc.wait_ready(300)
            return as_server(proc, self.folder(spec))

    def prefetch(self) -> None:
        """Launch the next ones until `LOOKAHEAD` wait untaken."""
        with self.lock:
            while (self.root is not None and not self.quiet and self.todo
                   and len(self.launched) < self.lookahead and self.machine.spare(0)):
                self._launch_next("next")

    def fill_idle(self, busy: float) -> bool:
        """One more start ahead if the cores idle (`busy` below `IDLE_BUSY`),
        fewer than `LOOKAHEAD` starts are in flight, fewer than `MAX_AHEAD`
        servers wait, and memory allows; True if it launched one."""
        with self.lock:
            starting = [spec for spec in self.launched if spec not in self.ready]
            if (self.root is None or self.quiet or not self.todo or busy >= IDLE_BUSY
                    or len(starting) >= self.lookahead
                    or len(self.launched) >= self.max_ahead
                    or not self.machine.spare(len(starting))):
                return False
            self._launch_next(f"idle cores, {busy:.0%} busy")
            return True

    def _launch_next(self, why: str) -> None:
        spec = self.todo.pop(0)
        self.launched[spec] = start = self._launch(spec)
        how = ", forked" if isinstance(getattr(start, "proc", None), ForkedProcess) else ""
        self.note(f"{spec.name}: {why}{how}")

    def note(self, line: str) -> None:
        """The run's record (which starts filled idle time, when each paused)."""
        if self.root is not None:
            with open(self.root / "plan.log", "a") as log:
                log.write(f"{datetime.now():%H:%M:%S} {line}\n")

    def start_monitor(self) -> None:
        self.monitor = threading.Thread(target=self._monitor, daemon=True, name="server-plan")
        self.monitor.start()

    def _monitor(self) -> None:
        """Every `monitor_s`: note which starts are ready, then fill idle cores.
        Waits on an Event, not `time.sleep`, which unit tests replace."""
        before = self.machine.cpu_times()
        while not self.stopping.wait(self.machine.monitor_s):
            now = self.machine.cpu_times()
            busy, before = busy_share(before, now), now
            with self.lock:
                pending = [(s, p) for s, p in self.launched.items() if s not in self.ready]
            for spec, proc in pending:
                # One that exited is done starting too (its test expects the
                # failure, or fails on it): it holds no core.
                if proc.is_ready() or proc.proc.poll() is not None:
                    with self.lock:
                        if spec in self.launched:
                            self.ready.add(spec)
                            if self.machine.pause(proc.proc):  # not one that exited
                                self.note(f"{spec.name}: ready, paused")
            self.fill_idle(busy)

    def set_quiet(self, quiet: bool) -> None:
        """A `quiet` test is next (True: nothing launches from now on) or done."""
        with self.lock:  # no launch is half done past this point
            self.quiet = quiet
        if not quiet:
            self.prefetch()

    def settle(self, timeout_s: float = 300) -> None:
        """Wait for the starts in flight (before a `quiet` test) until the
        monitor has seen each ready or gone (a ready one it pauses: asking
        it here could meet it paused)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping.is_set():
            with self.lock:
                if all(spec in self.ready or proc.proc.poll() is not None
                       for spec, proc in self.launched.items()):
                    return
            self.stopping.wait(SETTLE_POLL_S)

    def close(self) -> None:
        """Stop the monitor, then every start that still runs: untaken ones,
        and taken ones whose test did not stop them (a fixture that failed
        half way, a bookkeeping slip): no server outlives the session."""
        self.stopping.set()
        if self.monitor is not None:
            self.monitor.join(30)
        with self.lock:
            self.todo.clear()
            self.launched.clear()
            started, self.started = self.started, []
        for proc in started:
            if proc.proc.poll() is None:
                self.machine.resume(proc.proc)  # a stopped process takes no SIGTERM
                self.machine.stop(proc.proc)

    def folder(self, spec: ServerSpec) -> Path:
        assert self.root is not None, "take servers through the server_plan fixture"
        return self.root / spec.name

    def _launch(self, spec: ServerSpec, **overrides: Any) -> Any:
        proc = self.machine.launch(self.folder(spec), spec, popen=self.machine.popen,
                                   **overrides)
        with self.lock:
            self.started.append(proc)
        return proc


def surface() -> dict[str, int]:
    """The identity of everything the session's plan reads at run time: this
    module's names, `ServerPlan`'s and `Machine`'s attributes, and the psutil
    calls behind the defaults. Two readings differ only if something patched
    one of them in between (tests/conftest.py compares them around each test)."""
    module = sys.modules[__name__]
    names = {f"tests.server_plan.{k}": id(v) for k, v in vars(module).items()
             if not k.startswith("__")}
    for cls in (ServerPlan, Machine):
        names.update({f"{cls.__name__}.{k}": id(v) for k, v in vars(cls).items()
                      if not k.startswith("__")})
    names.update({f"psutil.{k}": id(getattr(psutil, k)) for k in ("cpu_times", "virtual_memory")})
    return names


def patched(before: Mapping[str, int], after: Mapping[str, int]) -> list[str]:
    """The names whose value changed between two `surface()` readings."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
