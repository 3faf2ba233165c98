"""Run under torchrun (2 ranks, gloo): shard the served model, step, push, check.

Modes: fsdp2, fsdp1, plain, http (fsdp2 over the HTTP transport), split
(fsdp2 with a bucket smaller than the embedding: big tensors travel in
chunks), meta, bad_shape, bad_checksum, rank1_fails (rank 1 cannot send its
share), kill (the rank that sends bucket 2 dies mid-push),
kill_replica (rank 0 SIGKILLs the server $KILL_REPLICA_PID mid-push). Rank 0
writes a JSON report to --out; the pytest side asserts on it. --url may list
several replicas (comma-separated): all are pushed to, and each is sampled
with the same seed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import time

import torch

from rollout_sidecar.protocol.failpoints import armed
from rollout_sidecar.trainer.collectives import broadcast_object
from tests.rank_worker import main


def build(model_path: str, mode: str) -> torch.nn.Module:
    from tests.fidelity.fidelity_worker import build as wrap

    sharded = ("fsdp2", "http", "split", "bad_shape", "bad_checksum", "kill", "meta",
               "kill_replica", "rank1_fails")
    return wrap(model_path, "fsdp2" if mode in sharded else mode)


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Full-model logprobs of `tokens` after `prompt` (a collective under FSDP)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1:-1], dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from rollout_sidecar.trainer.gather.full_tensors import iter_full_tensors

    return {n: t.detach().clone() for n, t in iter_full_tensors(model)}


def reference(model_path: str, dtype: torch.dtype, state: dict | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if state is not None:
        m.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    return m.eval()


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mode", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", type=int, default=1)


def body(args: argparse.Namespace, rank: int) -> dict:
    # What a mode patches in the trainer is undone when the body ends: the
    # ranks may run the next test's job (tests/rank_pool.py).
    with contextlib.ExitStack() as patches:
        return push(args, rank, patches)


def push(args: argparse.Namespace, rank: int, patches: contextlib.ExitStack) -> dict:
    from rollout_sidecar.client import GenerationClient
    from rollout_sidecar.trainer import MetaDeviceError, WeightPusher, WeightPushError

    model = build(args.model, args.mode)
    transport = "http" if args.mode == "http" else "gloo"
    # split: 0.1 MiB, under the 132 KiB embedding and lm_head (and the MLP weights).
    # Every FSDP2 mode sends its own rows (the default); FSDP1 and HTTP gather.
    pusher = WeightPusher(args.url, transport=transport,
                          bucket_mb=0.1 if args.mode == "split" else 1)
    urls = args.url.split(",")
    clients = [GenerationClient(u) for u in urls] if rank == 0 else []
    client = clients[0] if clients else None
    report: dict = {"mode": args.mode}
    if args.mode == "split":
        patches.enter_context(manifest_seen(functools.partial(_record_splits, report)))
    prompt = list(b"the quick brown fox")

    if args.mode == "meta":
        # A module left on the meta device after sharding must never be pushed.
        with torch.device("meta"):
            model.model.layers[1].mlp.up_proj = torch.nn.Linear(256, 512, bias=False)
        try:
            pusher.push(model, version=args.version)
            report["error"] = None
        except MetaDeviceError as e:
            report["error"] = str(e)
    else:
        before = client.info().weight_version if client else None
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        batch = torch.randint(0, 256, (4, 32))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        if args.mode == "bad_shape":
            patches.enter_context(manifest_seen(_wrong_shape))
        # The faults mid-push, at the trainer's failpoint (protocol/failpoints.py).
        send_fault = {"bad_checksum": _flip_on_the_wire, "kill": _die_at_bucket_2,
                      "rank1_fails": _rank_1_fails,
                      "kill_replica": _kill_replica_at_bucket_2}.get(args.mode)
        killed: dict = {}
        try:
            with (armed("push.send", functools.partial(send_fault, killed=killed))
                  if send_fault else contextlib.nullcontext()):
                res = pusher.push(model, version=args.version)
            report.update(error=None, timings=res.timings, nbytes=res.nbytes,
                          senders=res.senders, senders_reason=res.senders_reason,
                          check=res.check, route=res.route, own_rows=res.own_rows)
        except WeightPushError as e:
            report["error"] = str(e)
            if "at" in killed:
                report["to_error_s"] = time.monotonic() - killed["at"]
        report["version_before"] = before
        # Sample from the server, score the same tokens with the trainer's model.
        out = None
        if rank == 0:
            report["replicas"] = []
            for u, c in zip(urls, clients, strict=True):
                try:
                    o = samples_alone(c, prompt)
                except Exception as e:  # a replica this test killed
                    report["replicas"].append({"url": u, "error": str(e)})
                    continue
                out = out or o
                report["replicas"].append({
                    "url": u, "weight_version": o.weight_version,
                    "token_ids": [s.token_ids for s in o.results[0].samples],
                    "logprobs": [s.logprobs for s in o.results[0].samples]})
        served = broadcast_object(out.model_dump() if out else None)
        # References: the trainer's own fp32 forward (sharded, a collective), the
        # same gathered weights in a plain bf16 transformers model (what the
        # server should equal), and the weights from before the step.
        post_bf16 = reference(args.model, torch.bfloat16, gathered(model))
        pre = reference(args.model, torch.float32, None)
        d = {"fp32": [], "bf16": [], "pre": []}
        for smp in served["results"][0]["samples"]:
            toks, lps = smp["token_ids"], smp["logprobs"]
            for key, m in (("fp32", model), ("bf16", post_bf16), ("pre", pre)):
                d[key] += [abs(a - b) for a, b in zip(trainer_logprobs(m, prompt, toks), lps,
                                                      strict=True)]
        report.update(version_after=served["weight_version"],
                      **{f"mean_abs_dlogp_{k}": sum(v) / len(v) for k, v in d.items()},
                      **{f"max_abs_dlogp_{k}": max(v) for k, v in d.items()})
    return report


def samples_alone(client, prompt: list[int], n: int = 4):
    """`n` seeded samples of `prompt`, each a request of its own, sent one
    after the other: each runs alone in the engine, so two replicas of the
    same weights answer bit for bit. (One request with n=4 would not: vLLM
    hands its children to the engine core one by one, `AsyncLLM.add_request`,
    so whether the first decode steps batch one child or four depends on
    timing, and CPU kernels are not batch-invariant: 1 ulp apart, seen.)"""
    out = None
    for i in range(n):
        r = client.generate(prompt_token_ids=[prompt], sampling=dict(
            n=1, max_tokens=24, temperature=1.0, seed=7 + i))
        if out is None:
            out = r
        else:
            out.results[0].samples += r.results[0].samples
            assert r.weight_version == out.weight_version, (r.weight_version, out.weight_version)
    return out


@contextlib.contextmanager
def manifest_seen(change):
    """The pusher's manifest passed through `change` while the block runs."""
    import rollout_sidecar.trainer.pusher as p

    orig = p.manifest
    p.manifest = lambda buckets: change(orig(buckets))
    try:
        yield
    finally:
        p.manifest = orig


def _wrong_shape(m: list) -> list:
    """Wrong shape for one tensor: the server must reject it at begin."""
    m[0]["params"][0]["shape"][0] += 1
    return m


def _record_splits(report: dict, m: list) -> list:
    """Note which tensors the pushed manifest split into chunks."""
    report["split"] = sorted({e["name"] for b in m for e in b["params"] if "chunk_offset" in e})
    report["max_bucket_bytes"] = max(b["nbytes"] for b in m)
    return m


def _flip_on_the_wire(index, buf, killed, rank=None):
    """Bucket 1's bytes flipped on the wire only: the trainer's CRC is of the
    true bytes, so the server's check fails."""
    if index != 1:
        return None
    wire = buf.clone()
    wire[0] ^= 0xFF
    return wire


def _kill_replica_at_bucket_2(index, buf, killed, rank=None):
    """Before bucket 2 goes out, one replica dies (as if its node failed)."""
    if index == 2:
        os.kill(int(os.environ["KILL_REPLICA_PID"]), signal.SIGKILL)
        killed["at"] = time.monotonic()  # the report's time to error starts here


def _rank_1_fails(index, buf, killed, rank=None):
    """Trainer rank 1 cannot send its first bucket (every rank sends its share)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise OSError("failpoint: rank 1's link is down")


def _die_at_bucket_2(index, buf, killed, rank=None):
    """Rank 0 vanishes after sending two buckets (as if OOM-killed)."""
    if index == 2 and not os.environ.get("PUSH_KILLED_ONCE"):
        os._exit(17)


if __name__ == "__main__":
    main(body, arguments)
