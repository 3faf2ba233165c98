"""One engine over several hosts, the parts that need no second host: the
address workers meet the data-plane store at (server/weights/
rendezvous_address.py), which process gets our worker method (vllm_plugin.py),
and `serve --headless`'s refusals (engine/headless.py). No engine starts;
the worker reports are written here. Two real nodes are
tests/e2e/test_multinode.py; a Ray worker, tests/e2e/test_ray_worker.py."""

from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

import pytest

from rollout_sidecar.server.weights import rendezvous_address as ra
from rollout_sidecar.server.weights.staging_layout import WorkerHost
from tests.processes import in_spawned_process

HERE = "boot-a:4026531840"


def workers(*nets: str) -> list[WorkerHost]:
    return [WorkerHost(r, 0, f"node-{n}", f"shm-{n}", 1, 1, n) for r, n in enumerate(nets)]


def settings(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"data_plane_advertise_host": None, "nnodes": 1,
                              "master_addr": "127.0.0.1", **kw})


def test_workers_on_this_network_stack_meet_the_store_on_loopback_or_its_address():
    local = workers(HERE, HERE)
    assert ra.store_host("0.0.0.0", local, settings(), here=HERE) == "127.0.0.1"
    assert ra.store_host("10.0.0.5", local, settings(), here=HERE) == "10.0.0.5"


def test_workers_on_another_host_get_an_address_they_can_route_to():
    """Before, they got 127.0.0.1: their own host."""
    spread = workers(HERE, "boot-b:4026531840")
    assert ra.store_host("0.0.0.0", spread, settings(nnodes=2, master_addr="10.1.0.2"),
                         here=HERE) == "10.1.0.2"  # node 0's address, which they reach
    assert ra.store_host("0.0.0.0", spread, settings(data_plane_advertise_host="10.9.9.9"),
                         here=HERE) == "10.9.9.9"
    assert ra.store_host("10.1.0.7", spread, settings(), here=HERE) == "10.1.0.7"
    # Said outright, the advertised address wins over a bound one (a NAT, a proxy):
    # before, --data-plane-host naming an address silently ignored it.
    assert ra.store_host("10.1.0.7", spread, settings(data_plane_advertise_host="10.9.9.9"),
                         here=HERE) == "10.9.9.9"


def test_ray_workers_get_vllms_own_routable_address(monkeypatch):
    """Ray keeps nnodes at 1 across hosts: the address is the one vLLM finds
    (VLLM_HOST_IP, or the default route's interface), or none: refused."""
    import vllm.utils.network_utils as net

    spread = workers(HERE, "boot-b:1")
    monkeypatch.setattr(net, "get_ip", lambda: "10.2.0.4")
    assert ra.store_host("::", spread, settings(), here=HERE) == "10.2.0.4"
    monkeypatch.setattr(net, "get_ip", lambda: "0.0.0.0")
    with pytest.raises(ra.Unreachable, match="--data-plane-advertise-host"):
        ra.store_host("0.0.0.0", spread, settings(), here=HERE)


def test_a_store_on_loopback_with_workers_elsewhere_is_refused_at_start_naming_the_fix():
    with pytest.raises(ra.Unreachable, match=r"node-boot-b:1 \(worker rank 1\).*--host 0.0.0.0"):
        ra.store_host("127.0.0.1", workers(HERE, "boot-b:1"), settings(), here=HERE)


def test_another_network_namespace_on_this_host_is_elsewhere_too():
    """Containers on one host share its boot id but not its loopback."""
    assert ra.remote_hosts(workers(HERE, "boot-a:4026532999"), here=HERE) == [
        "node-boot-a:4026532999 (worker rank 1)"]
    view = __import__("rollout_sidecar.server.weights.worker.host_share",
                      fromlist=["host_view"]).host_view()
    assert ra.remote_hosts(workers(view["net"]), here=None) == []  # this process's own


def _hosts_engine(env: dict, out: multiprocessing.Queue) -> None:
    os.environ.pop("ROLLOUT_SIDECAR_ENGINE_HOST_PID", None)
    os.environ.update(env)
    from rollout_sidecar.server.weights.worker.vllm_plugin import hosts_engine

    out.put(hosts_engine())


def _ask(env: dict) -> bool:
    return in_spawned_process(_hosts_engine, (env,), timeout_s=60)


def test_the_worker_method_goes_everywhere_but_the_process_that_hosts_the_engine():
    """A Ray actor is no multiprocessing child: the plugin decides by the
    engine host's pid, which RayExecutorV2 copies into its actors."""
    from rollout_sidecar.server.weights.worker.vllm_plugin import hosts_engine

    pid_env = "ROLLOUT_SIDECAR_ENGINE_HOST_PID"
    assert _ask({pid_env: "1"}) is False  # a child (or an actor) of the engine's host
    old = os.environ.get(pid_env)
    os.environ[pid_env] = str(os.getpid())
    try:
        assert hosts_engine() is True
    finally:
        if old is None:
            os.environ.pop(pid_env)
        else:
            os.environ[pid_env] = old
    assert _ask({}) is False  # no variable: a multiprocessing child hosts nothing


def _hosts_engine_beside_ray(out: multiprocessing.Queue) -> None:
    os.environ.pop("ROLLOUT_SIDECAR_ENGINE_HOST_PID", None)
    import ray  # as vLLM imports it wherever it is installed (v1/engine/async_llm.py)

    from rollout_sidecar.server.weights.worker.vllm_plugin import _in_ray_worker

    out.put((_in_ray_worker(), ray.is_initialized()))


def test_asking_whether_this_is_a_ray_worker_starts_no_ray():
    """A process with Ray imported, not initialised, is no Ray worker, and
    asking must not start a local Ray instance (ray's get_runtime_context()
    does, on an uninitialised Ray: it did in every server forked from a
    process that had imported Ray, and would in any vLLM process on a
    machine with Ray installed that asks before our variable is set)."""
    pytest.importorskip("ray")
    assert in_spawned_process(_hosts_engine_beside_ray, timeout_s=120) == (False, False)


def test_headless_runs_only_on_hosts_1_and_on():
    from rollout_sidecar.server.config import ServerSettings
    from rollout_sidecar.server.engine.headless import HeadlessRefused, check

    check(ServerSettings(nnodes=2, node_rank=1, headless=True))
    for nnodes, rank in ((1, 0), (2, 0), (2, 2)):
        with pytest.raises(HeadlessRefused):
            check(ServerSettings(nnodes=nnodes, node_rank=rank, headless=True))


def _fork_from_an_engine_host(out: multiprocessing.Queue) -> None:
    # As the API process runs it: the host's pid set, then vLLM loads the
    # plugins (EngineArgs.create_engine_config) and forks the engine core.
    os.environ["ROLLOUT_SIDECAR_ENGINE_HOST_PID"] = str(os.getpid())
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu_worker import Worker

    from rollout_sidecar.server.weights.ops import WORKER_METHOD

    load_general_plugins()
    here = hasattr(Worker, WORKER_METHOD)
    child_out = multiprocessing.get_context("fork").Queue()

    def child() -> None:
        load_general_plugins()  # what vLLM's engine core calls: a no-op after a fork
        child_out.put(hasattr(Worker, WORKER_METHOD))

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    if p.is_alive():  # a deadline, not a hang
        p.kill()
        p.join()
    out.put((here, child_out.get(timeout=5), p.exitcode))


def test_an_engine_core_forked_from_the_host_gets_the_worker_method():
    """vLLM forks the engine core where it can (its default on GPU), and the
    child inherits vLLM's "plugins loaded": without our hook at the fork the
    worker had no `rollout_sidecar_call` and every weight op failed."""
    here, child, exitcode = in_spawned_process(_fork_from_an_engine_host)
    assert (here, child, exitcode) == (False, True, 0)
