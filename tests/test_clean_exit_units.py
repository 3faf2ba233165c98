"""Nothing a pusher starts outlives it into interpreter teardown (issue 26),
without a server: real gloo groups of threads on localhost for the
collectives and the data plane's group, fakes for the replicas.
tests/e2e/test_clean_exit.py runs whole push scripts against a real server."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rollout_sidecar.protocol.data_plane.bucket_group import broadcast_group
from rollout_sidecar.protocol.data_plane.signed_store import group_prefix
from rollout_sidecar.trainer.collectives import settled
from rollout_sidecar.trainer.control import replica_admins
from rollout_sidecar.trainer.control.deadlines import Deadlines
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins
from rollout_sidecar.trainer.errors import WeightPushError
from rollout_sidecar.trainer.release import close_parts, close_when_gone
from rollout_sidecar.trainer.transport.distributed import DistributedTransport
from tests import processes
from tests.polling import until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def groups() -> Any:
    """Two ranks of a gloo group, both in this process."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    out: list[Any] = [None, None]

    def join(rank: int) -> None:
        out[rank] = broadcast_group("127.0.0.1", store.port, "exit", rank, 2, "gloo", 20)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in out)
    yield out
    for g in out:
        g.close()


def test_a_settled_collective_returns_once_no_gloo_thread_holds_its_tensor(groups) -> None:
    """Without `settled`, a gloo worker still held the tensor after `wait()`
    returned now and then; it has to take the GIL to let go, which at exit
    aborts the process. After `settled`, nobody but the caller holds it."""
    errors: list[str] = []

    def rank(r: int) -> None:
        pg = groups[r].pg
        for i in range(200):
            t = torch.full((256,), i if r == 0 else -1, dtype=torch.int64)

            def start(t: torch.Tensor = t) -> Any:
                return pg.broadcast(t, 0)

            refs = sys.getrefcount(t)
            settled(start, [t])
            if (t._use_count(), sys.getrefcount(t), int(t[0])) != (1, refs, i):
                errors.append(f"rank {r} round {i}: uses {t._use_count()}, refs "
                              f"{sys.getrefcount(t)} (was {refs}), value {int(t[0])}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_closing_a_data_plane_group_joins_its_gloo_threads_here() -> None:
    """gloo has no abort: the threads end in the group's destructor, which
    `close()` runs now rather than leaving it to interpreter exit."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    before = _threads()
    out: list[Any] = [None, None]

    def join(rank: int) -> None:
        out[rank] = broadcast_group("127.0.0.1", store.port, "close", rank, 2, "gloo", 20)

    joins = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    assert _threads() > before  # each rank's workers and its transport's loop
    for g in out:
        g.close()
        g.close()  # idempotent
    assert _threads() == before


class _Part:
    def __init__(self, fails: bool = False) -> None:
        self.closed, self.fails = 0, fails

    def close(self) -> None:
        self.closed += 1
        if self.fails:
            raise RuntimeError("server gone")

    release = close


def test_a_pusher_never_closed_is_closed_once_collected_off_the_collecting_thread(caplog
                                                                                ) -> None:
    """A collection runs in whichever thread allocated (a training step,
    another trainer's push), and the close can wait on HTTP and on a join
    given up on: it runs in a thread of its own, never in the collector's."""

    class Owner:
        pass

    let_close = threading.Event()

    class SlowTransport(_Part):  # a join given up on still running
        def close(self) -> None:
            self.thread = threading.current_thread()
            assert let_close.wait(30)
            super().close()

    transport, replicas, sender = SlowTransport(fails=True), _Part(), _Part()
    owner = Owner()
    close_when_gone(owner, transport, replicas, sender)
    assert transport.closed == 0
    del owner  # e.g. a pusher local to main(), which returned; or a GC pass
    assert transport.closed == 0  # returned while the close still waits
    let_close.set()
    until(lambda: sender.closed == 1, "the collected pusher's parts closed")
    assert transport.closed == 1 and replicas.closed == 1
    assert transport.thread is not threading.current_thread()
    assert "server gone" in caplog.text  # logged, not raised
    close_parts(None, replicas, sender)  # rank > 0: no transport, no replicas
    assert sender.closed == 2


def test_a_pusher_alive_at_exit_is_closed_before_finalization() -> None:
    script = ("import sys\n"
              "from rollout_sidecar.trainer.release import close_when_gone\n"
              "class Part:\n"
              "    def close(self):\n"
              "        print('closed, finalizing:', sys.is_finalizing(), flush=True)\n"
              "    release = close\n"
              "class Pusher:\n"
              "    pass\n"
              "PUSHER = Pusher()  # a global: alive until the interpreter exits\n"
              "close_when_gone(PUSHER, Part(), None, Part())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["closed, finalizing: False"] * 2, proc.stdout


class _Admin:
    def __init__(self, url: str) -> None:
        self.base_url, self.calls = url, []

    def disconnect(self, connection_id, trainer_id, timeout_s):
        self.calls.append(connection_id)

    def close(self) -> None:
        pass


def test_replicas_are_called_one_by_one_once_no_thread_pool_runs(monkeypatch) -> None:
    """At interpreter exit (the atexit close) concurrent.futures takes no work."""

    class Refusing:
        def __init__(self, workers: int) -> None:
            pass

        def __enter__(self) -> Refusing:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def map(self, fn, items):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(replica_admins, "ThreadPoolExecutor", Refusing)
    replicas = ReplicaAdmins("http://a:1,http://b:2", token=None)
    replicas.admins = [_Admin("http://a:1"), _Admin("http://b:2")]
    assert replicas.each(lambda admin, i: i * 10) == [0, 10]


def test_close_waits_for_a_join_given_up_on_and_ends_the_group_it_formed() -> None:
    """A connect that failed leaves its join thread to end by its own timeout;
    a thread still inside torch when finalization begins aborts the process."""
    replicas = ReplicaAdmins("http://a:1", token=None)
    replicas.admins = [_Admin("http://a:1")]
    transport = DistributedTransport(replicas)
    closed = []

    class Group:
        def close(self) -> None:
            closed.append(self)

    out: dict[str, Any] = {}

    def late_join() -> None:
        time.sleep(0.3)
        out["group"] = Group()

    joining = threading.Thread(target=late_join, daemon=True)
    joining.start()
    transport._give_up(joining, out)
    transport.close()
    assert not joining.is_alive() and len(closed) == 1 and "group" not in out
    transport.close()  # idempotent
    assert len(closed) == 1


def test_a_refused_connect_ends_its_own_join_at_once_and_leaves_nothing() -> None:
    """A replica refuses the connect (another trainer holds its lease), so
    nobody will ever join: the trainer's join thread stops on the abort marker
    within a poll, not after `join_s`, so no thread is left for `close()`, or
    the finalizer of a pusher nobody closed, to wait out; the store keeps no
    key of the connection. Real TCPStore and gloo join; a fake replica."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    before = master.num_keys()
    replicas = ReplicaAdmins("http://127.0.0.1:1", token=None,
                             deadlines=Deadlines(stall_s=60.0, join_s=120.0))

    class Refusing(_Admin):
        def connect(self, connection_id, *args, **kwargs):
            until(lambda: any(group_prefix(connection_id) in k for k in master.list_keys()),
                  "our join wrote its key: it waits in the store")
            raise WeightPushError("another trainer is pushing to this server")

    class Status:
        data_plane_ranks, data_plane_port, connected = 1, master.port, None

    replicas.admins = [Refusing("http://127.0.0.1:1")]
    transport = DistributedTransport(replicas)
    threads = set(threading.enumerate())
    with pytest.raises(WeightPushError, match="another trainer is pushing"):
        transport.ensure_connected([Status()])
    # Our join ended within the stall bound it is given (60 s), far short of its
    # own timeout (120 s): nothing given up on, no thread left behind.
    assert transport._abandoned == [] and set(threading.enumerate()) <= threads
    assert master.num_keys() == before, master.list_keys()
    transport.close()


# torch's object collectives (and a bare blocking collective) on a CPU group
# leave their tensors to gloo's worker threads (trainer/collectives.py).
_UNSETTLED = re.compile(
    r"\bdist\.(all_gather_object|broadcast_object_list|gather_object|scatter_object_list|"
    r"all_gather|all_reduce|broadcast|gather|reduce|scatter)\((?![^)]*async_op=True)")


def test_torchrun_workers_gather_with_settled_collectives() -> None:
    """A test worker that gathers its report with torch's `all_gather_object`
    and returns aborts in teardown now and then: FSDP2's mesh keeps the gloo
    threads alive into finalization, and one still letting go of the
    collective's tensors takes the GIL there (the fidelity tests' rank 1, twice
    in one CI run; bench/exit_after_collective.py: torch's 4 of 40 runs, ours
    0 of 40). The workers and benches under torchrun use the settled ones
    (`broadcast_object`, `all_gather_object`, `settled`); that bench's
    baseline alone is marked."""
    files = [*processes.REPO.glob("tests/**/*worker*.py"), *processes.REPO.glob("bench/*.py")]
    found = [f"{f.relative_to(processes.REPO)}:{i}" for f in files if "gpu" not in f.parts
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if _UNSETTLED.search(line) and "# unsettled: the baseline" not in line]
    assert len(files) > 20 and not found, found
