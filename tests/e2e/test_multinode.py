"""One engine over two hosts, with vLLM's multiprocessing executor (nnodes 2,
TP 2: one worker per host), takes a push and serves it exactly.

Hosts are network namespaces on this machine (bench/netns.py), each with a
/dev/shm of its own (a private tmpfs), so nothing crosses between them but
the network: node 0 runs `serve --nnodes 2 --node-rank 0`, node 1
`serve --headless --node-rank 1`, and a trainer pushes from a third. What
had to hold: node 1's worker gets our worker method and weight-transfer
backend (its own config, engine_config.py), it meets the data-plane store at
node 0's address (not its own loopback: rendezvous_address.py), and it stages
its own copy (it shares no /dev/shm with node 0's worker: staging_layout.py).
vLLM-CPU's gloo and message queues need each node's address named
(GLOO_SOCKET_IFNAME, VLLM_HOST_IP; docs/deploy.md, "Several hosts").
The oracle: a transformers fp32 forward of the pushed weights, against the
served prompt logprobs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from rollout_sidecar.server.launcher import free_port, launch_server
from tests import processes
from tests.e2e.multinode_trainer import TOKENS

pytestmark = pytest.mark.slow
EXACT = 1e-4  # fp32, served vs trained
SHM = "1g"
TRAINER = Path(__file__).with_name("multinode_trainer.py")


def _can_make_hosts() -> bool:
    return (os.geteuid() == 0 and shutil.which("ip") is not None
            and shutil.which("unshare") is not None and len(os.sched_getaffinity(0)) >= 2)


def _private_shm(cmd: list[str]) -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o "size=$0" tmpfs /dev/shm && exec "$@"', SHM, *cmd]


@pytest.mark.skipif(not _can_make_hosts(), reason="needs root, iproute2, unshare, 2 cores")
def test_an_engine_over_two_hosts_takes_a_push_and_serves_it_exactly(tmp_path):
    from bench.netns import exec_prefix, nodes
    from rollout_sidecar.server.model.default_model import write_default_model

    model = write_default_model(tmp_path / "model")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with nodes(["n0", "n1", "tr"], rate="10gbit") as ips:
        common = {"ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": "2", "ROLLOUT_SIDECAR_NNODES": "2",
                  "ROLLOUT_SIDECAR_MASTER_ADDR": ips["n0"],
                  "ROLLOUT_SIDECAR_MASTER_PORT": str(free_port()),
                  "ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25", "GLOO_SOCKET_IFNAME": "eth0",
                  # node 1 ends 10 s after node 0 (the default rides out a minute's blip)
                  "ROLLOUT_SIDECAR_HEAD_GONE_S": "10",
                  "ROLLOUT_SIDECAR_CACHE_DIR": str(tmp_path / "cache")}
        headless = [*exec_prefix("n1"), *_private_shm([
            sys.executable, "-m", "rollout_sidecar.server.cli", "serve", "--headless",
            "--node-rank", "1", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "256"])]
        env1 = dict(processes.repo_env(**common), VLLM_HOST_IP=ips["n1"],
                    VLLM_CPU_OMP_THREADS_BIND=str(cpus[1]))
        with processes.background(headless, env=env1, log=tmp_path / "node1.log",
                                  deadline_s=600) as node1:
            server = launch_server(
                log=tmp_path / "node0.log", model=model, dtype="float32", max_model_len=256,
                env={**common, "VLLM_HOST_IP": ips["n0"]}, cpus=str(cpus[0]),
                prefix=exec_prefix("n0"), host=ips["n0"], shm_size=SHM, ready_timeout_s=420)
            with server:
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
                print(f"two hosts (TP 2, nnodes 2): pushed {pushed['bytes']} B in "
                      f"{pushed['timings'].get('total_s', float('nan')):.2f}s, probe passed "
                      f"{pushed['probe_passed']}; served vs trained fp32 mean |dlogp| {gap:.2e}")
                assert r.json()["weight_version"] == pushed["version"]
                assert gap < EXACT, (gap, served, pushed["reference"])
            # Node 0 gone: node 1 notices (its store is gone) and ends, code 0.
            node1.wait(60)
            assert node1.returncode == 0, (tmp_path / "node1.log").read_text()[-3000:]
