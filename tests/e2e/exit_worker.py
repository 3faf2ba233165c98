"""One push, then a plain return: the process must exit 0 on its own.

A trainer script ends by returning from main (after `destroy_process_group()`
under torchrun); interpreter teardown then runs in full, with no `os._exit`
to hide a gloo thread, a pending collective or a store client the pusher left
behind (issue 26: SIGABRT, "terminate called without an active exception").
tests/e2e/test_clean_exit.py runs this many times and asserts on exit codes.

    plain:        python exit_worker.py --wrapper plain ...   (no torch.distributed)
    fsdp2, fsdp1: torchrun --nproc-per-node 2 exit_worker.py --wrapper fsdp1 ...

`--close` calls `WeightPusher.close()`; without it the pusher's own hook
(trainer/release.py) must release the server's data plane and end the group.
The server's URL and model directory come as arguments, its tokens through
the environment. Runs may overlap (the test starts the next while one exits):
`--after` waits for the previous run's push (a file), `--pushed` then writes
this run's data-plane connection id, which the test checks the server let go.

Cheap on purpose (each run is a fresh process): the model is the server's
checkpoint as a bare module tree (no transformers import, three seconds of
every run), so the push goes without the probe, which needs a forward. FSDP
wraps it as tests/fidelity/fidelity_worker.py wraps a transformers model:
every decoder layer a unit, then the root. Without the delta's shard copy
too, the push's last collective (the commit's agreement) is the last thing
before the return, as the probe's is by default: nothing in between gives a
gloo thread still holding its tensor the GIL it needs to let go.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn


class Node(nn.Module):
    """One level of the checkpoint's dotted names."""


class Layer(Node):
    """A decoder layer (`model.layers.<i>`): FSDP's unit."""


def build(model_dir: str, wrapper: str) -> nn.Module:
    """The checkpoint's tensors (fp32) under its own names, FSDP-wrapped."""
    from safetensors.torch import load_file

    root = Node()
    for name, tensor in load_file(Path(model_dir) / "model.safetensors").items():
        *path, leaf = name.split(".")
        module = root
        for i, part in enumerate(path):
            if not hasattr(module, part):
                module.add_module(part, (Layer if i and path[i - 1] == "layers" else Node)())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(tensor.float()))
    from tests.fsdp_wrap import wrap

    return wrap(root, wrapper, [m for m in root.modules() if isinstance(m, Layer)])


def served_version(url: str) -> int:
    """The version the server serves now, read on rank 0 and shared."""
    from rollout_sidecar.client import GenerationClient
    from rollout_sidecar.trainer.rank_agreement import broadcast, rank

    version = None
    if rank() == 0:
        with GenerationClient(url, api_token=os.environ["ROLLOUT_SIDECAR_API_TOKEN"]) as c:
            version = c.info().weight_version
    return broadcast(version)


def wait_for(path: str | None, timeout_s: float = 120) -> None:
    """Until `path` exists (the previous run has pushed, or is gone)."""
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="the server's checkpoint directory")
    ap.add_argument("--wrapper", choices=["plain", "fsdp2", "fsdp1"], required=True)
    ap.add_argument("--close", action="store_true")
    ap.add_argument("--after", help="push once this file exists")
    ap.add_argument("--pushed", help="then write the connection id here (rank 0)")
    args = ap.parse_args()
    if args.wrapper != "plain":
        dist.init_process_group("gloo")

    from rollout_sidecar.trainer import WeightPusher

    model = build(args.model, args.wrapper)
    # A small bucket: several sends in flight through the double buffer.
    pusher = WeightPusher(args.url, admin_token=os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"],
                          bucket_mb=0.25, probe=False, delta=False)
    wait_for(args.after)
    pusher.push(model, version=served_version(args.url) + 1)
    if args.pushed and pusher.transport is not None:  # rank 0
        Path(args.pushed).write_text(pusher.transport.connection_id or "")
    if args.close:
        pusher.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
