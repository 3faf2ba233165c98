"""What a TP=2 server does with the /dev/shm it is given: the table of
docs/deploy.md, "Sizing /dev/shm". Each row starts a server in a /dev/shm of
its own (a private tmpfs of the size given, as a container's `shm_size`;
needs root), reads the layout it chose at start from /weights/status (or the
error it refused to start with), and, when it serves, pushes once from a
trainer in this process and reads the push's probe.

    python bench/shm_layout.py          # ~5 min on 2 cores
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import build_llama, default_model, machine, table  # noqa: E402

from rollout_sidecar.server.launcher import ServerStartError, launch_server  # noqa: E402
from rollout_sidecar.server.model.checkpoint_index import CheckpointIndex  # noqa: E402

# (model, serving dtype, /dev/shm size, share_host_staging) per row.
ROWS = [("default", "float32", "256m", None), ("default", "float32", "256m", "true"),
        ("default", "float32", "1g", None), ("100m", "bfloat16", "768m", None),
        ("100m", "bfloat16", "1g", None)]


def push_once(url: str, admin: str, model_dir: Path, dtype: str) -> str:
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with WeightPusher(url, admin_token=admin) as pusher:
        r = pusher.push(model, version=1)
    assert r.probe is not None
    return f"push ok, probe gap {r.probe.mean_abs_dlogp:.1e}"


def row(model: str, dtype: str, shm: str, share: str | None, workdir: Path) -> list[object]:
    path = default_model() if model == "default" else build_llama(1024, 2816, 8)
    size = CheckpointIndex.from_checkpoint(path).push_bytes(dtype)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {"ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": "2", "ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25",
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cpus)),
           "VLLM_LOGGING_LEVEL": "WARNING", "ROLLOUT_SIDECAR_CACHE_DIR": str(workdir / "c")}
    if share is not None:
        env["ROLLOUT_SIDECAR_SHARE_HOST_STAGING"] = share
    log = workdir / f"{model}-{shm}-{share}.log"
    what = [model, f"{size / 2**20:.0f} MiB ({dtype})", 2, shm, share or "unset"]
    try:
        server = launch_server(log=log, model=path, dtype=dtype, max_model_len=256, env=env,
                               shm_size=shm, ready_timeout_s=400)
    except ServerStartError as e:
        why = next((ln for ln in log.read_text().splitlines() if "StagingDoesNotFit: " in ln),
                   str(e).splitlines()[0])
        return [*what, "refused to start", why.split("StagingDoesNotFit: ", 1)[-1][:160]]
    with server:
        st = httpx.get(server.url + "/weights/status", timeout=30, headers={
            "Authorization": f"Bearer {server.admin_token}"}).json()
        warned = any("stage a copy each" in ln for ln in log.read_text().splitlines())
        layout = st["staging_layout"].split(":")[0] if warned else st["staging_layout"]
        pushed = push_once(server.url, server.admin_token, path, dtype)
    return [*what, ("per worker (warned)" if warned else "shared"), f"{layout[:70]}; {pushed}"]


def main() -> None:
    print(machine())
    rows = []
    with tempfile.TemporaryDirectory(prefix="shm-layout-") as tmp:
        for r in ROWS:
            rows.append(row(*r, Path(tmp)))
            print(rows[-1], flush=True)
    print(table(["model", "push bytes", "TP", "/dev/shm", "share_host_staging",
                 "server did", "detail"], rows))


if __name__ == "__main__":
    main()
