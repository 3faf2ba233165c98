"""Weight-push throughput, rank-0 memory and the per-parameter baseline.

For each model size, against a real server serving that checkpoint:

1. bucketed dense push (`WeightPusher(delta=False)`, gloo): a warm-up push,
   then `--repeats` timed pushes (median);
2. extra peak RSS of the pushing process for each `--rss-buckets` size, each in
   a fresh process so the first push's buffer allocation is what is measured;
3. (on `--per-param-sizes`) one HTTP request + one gloo send per parameter,
   TRL `vllm-serve`'s one-request-one-broadcast-per-param design;
4. (on `--delta-sizes`) the delta row: fp32 master weights take
   `--delta-steps` AdamW steps, pushed after each dense and by delta
   (_stepped_pushes.py), MiB sent and time of each form;
5. with the server stopped: a raw gloo send/recv of the same bucket layout
   between two fresh processes, a torch `copy_` and a zlib CRC-32 of the same
   bytes, in the same run as the pushes they are compared with.

Every push here but the delta row's is `delta=False`: the default pusher sends
deltas, and a delta of weights that did not change sends nothing (this bench
once printed "MiB 0" and a send 25x faster than raw gloo that way).

    /work/venv/bin/python bench/push.py [--sizes 10m,100m,500m]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import multiprocessing as mp
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    PeakRss,
    build_llama,
    free_port,
    in_fresh_process,
    load,
    machine,
    median,
    serve,
    table,
)
from _stepped_pushes import HEADERS as DELTA_HEADERS
from _stepped_pushes import SteppedRun, stepped_pushes
from _stepped_pushes import row as delta_row

MiB = 2**20
DTYPE = torch.bfloat16  # what the server serves, so what goes over the wire
# (hidden, intermediate, layers): 10.5M, 103M and 515M parameters, head_dim 64.
SIZES = {"10m": (512, 1536, 3), "25m": (512, 1408, 8), "50m": (768, 2048, 8),
         "100m": (1024, 2816, 8), "250m": (1536, 4096, 9), "500m": (2048, 5632, 10)}
TARGET_TRANSFER, TARGET_TOTAL, TARGET_RSS, TARGET_PER_PARAM = 0.8, 0.4, 3.0, 10.0
TARGET_NOOP_S = 0.05
TARGET_PROBE = 0.1  # the probe's share of a push


# ------------------------------------------------------------------ trainer model


def load_trainer_model(ckpt: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype)
    # from_pretrained may leave parameters backed by the mmapped safetensors file;
    # a trainer's weights live in anonymous memory, and file pages faulted in
    # during a push would count as push RSS.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def bucket_layout(model: torch.nn.Module, bucket_mb: float) -> list[int]:
    from rollout_sidecar.trainer.gather.full_tensors import param_plan
    from rollout_sidecar.trainer.pack.buckets import plan_buckets

    return [b.nbytes for b in plan_buckets(param_plan(model), DTYPE, int(bucket_mb * MiB))]


# ------------------------------------------------------------------ bucketed push


def timed_pushes(url: str, token: str, model: torch.nn.Module, version: int, repeats: int,
                 bucket_mb: float) -> tuple[list[dict[str, float]], int, int]:
    from rollout_sidecar.trainer import WeightPusher

    pusher = WeightPusher(url, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          probe=False,  # the transfer path alone; the probe is measured apart
                          delta=False)  # the same weights again: a delta would send nothing
    runs = []
    try:
        for i in range(repeats + 1):  # the first connects and allocates: warm-up
            r = pusher.push(model, version=version)
            version += 1
            dense_only(r)
            if i:
                runs.append(r.timings)
    finally:
        pusher.close()
    return runs, r.nbytes, r.buckets


def noop_pushes(url: str, token: str, model: torch.nn.Module, version: int, repeats: int,
                bucket_mb: float) -> list[dict[str, float]]:
    """The fixed cost of a push: the default pusher (deltas on) pushes the same
    weights again. The first push is dense (the base); each later one finds
    nothing changed."""
    from rollout_sidecar.trainer import WeightPusher

    pusher = WeightPusher(url, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          probe=False)
    runs = []
    try:
        for i in range(repeats + 2):  # dense base, one warm-up delta, then the timed ones
            r = pusher.push(model, version=version)
            version += 1
            if i and r.encoding != "delta":
                raise RuntimeError(f"an unchanged push went {r.encoding}: {r.delta_reason}")
            if i > 1:
                runs.append(r.timings)
    finally:
        pusher.close()
    return runs


def probed_pushes(url: str, token: str, model: torch.nn.Module, version: int, repeats: int,
                  bucket_mb: float) -> dict[str, float]:
    """What the probe adds to a dense push, side by side: no probe; the probe
    as `push()` runs it (its forward while the servers load); and the probe
    as it ran before (the forward after the commit, then the scoring),
    rebuilt from the same parts. Medians of `repeats`, interleaved."""
    from rollout_sidecar.trainer import WeightPusher
    from rollout_sidecar.trainer.probe import (
        ProbeForward,
        probe_push,
        probe_token_ids,
        trainer_logprobs,
    )

    pusher = WeightPusher(url, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          delta=False)
    runs: dict[str, list[float]] = {"off": [], "during": [], "after": [], "forward": [],
                                    "scoring": []}
    try:
        pusher.push(model, version=version, probe=False)  # connect + allocate: warm-up
        version += 1
        for _ in range(repeats):
            r = pusher.push(model, version=version, probe=False)
            dense_only(r)
            runs["off"].append(r.timings["total_s"])
            r = pusher.push(model, version=version + 1)
            runs["during"].append(r.timings["total_s"])
            runs["forward"].append(r.timings["probe_forward_s"])
            runs["scoring"].append(r.timings["probe_s"])
            t0 = time.perf_counter()
            r = pusher.push(model, version=version + 2, probe=False)
            serving = pusher._serving
            ids = probe_token_ids(serving.vocab_size, serving.max_model_len)
            forwarded = ProbeForward(ids, *trainer_logprobs(model, ids, None))
            probe_push(forwarded, r.version, pusher.replicas, serving, None)
            runs["after"].append(time.perf_counter() - t0)
            version += 3
    finally:
        pusher.close()
    return {k: median(v) for k, v in runs.items()}


def dense_only(r: Any) -> None:
    """Refuse a figure that is not a dense push's (a delta of unchanged weights
    sends nothing and would read as a fast push)."""
    if r.encoding != "dense":
        raise RuntimeError(f"a {r.encoding} push where a dense one is measured")


# ------------------------------------------------------------------ rank-0 RSS


def rss_child(ckpt: str, url: str, token: str, version: int, bucket_mb: float,
              trainer_dtype: str, threads: int, out: Any) -> None:
    """A fresh rank 0: load, build the pusher, then measure two pushes."""
    from rollout_sidecar.trainer import WeightPusher

    torch.set_num_threads(threads)

    model = load_trainer_model(Path(ckpt), getattr(torch, trainer_dtype))
    pusher = WeightPusher(url, admin_token=token, transport="gloo", bucket_mb=bucket_mb,
                          probe=False, delta=False)  # dense, the transfer path alone
    # Return freed loader memory to the OS, so a push cannot hide in reused pages.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    res: dict[str, Any] = {}
    for key in ("first", "second"):  # first allocates the buffers; second reuses them
        with PeakRss() as m:
            r = pusher.push(model, version=version)
        version += 1
        dense_only(r)
        res[key] = dict(before=m.before, extra=m.extra, total_s=r.timings["total_s"],
                        method=m.method)
    pusher.close()
    out.send(res)


def measure_rss(ckpt: Path, url: str, token: str, version: int, bucket_mb: float,
                trainer_dtype: str, threads: int) -> dict[str, Any]:
    return in_fresh_process(rss_child, (str(ckpt), url, token, version, bucket_mb,
                                        trainer_dtype, threads),
                            f"RSS child for bucket {bucket_mb} MiB")


# ------------------------------------------------------------------ per-param baseline


def per_param_push(url: str, token: str, model: torch.nn.Module, version: int) -> tuple[float, int]:
    """TRL `vllm-serve`'s shape: per parameter one HTTP request and one transfer.

    A complete push (partial pushes are refused: vLLM reloads fused layers
    whole) whose buckets hold one parameter each, with one extra control-plane
    round trip per parameter, like TRL's /update_named_param. It still loads
    once at commit where TRL loads per parameter, so it flatters the baseline."""
    from rollout_sidecar.trainer import WeightPusher

    # split_tensors=False: with a 1-byte bucket every parameter gets one of its own.
    pusher = WeightPusher(url, admin_token=token, transport="gloo", bucket_mb=1e-6, probe=False,
                          split_tensors=False, delta=False)
    pusher.push(model, version=version)  # connect + allocate outside the timing
    send = pusher.transport.send
    calls = 0

    def send_with_request(index: int, buf: torch.Tensor, push_ids: list[str],
                          checksum: int | None) -> Any:
        nonlocal calls
        calls += 1
        pusher.replicas.admins[0].status()  # the per-parameter HTTP round trip
        return send(index, buf, push_ids, checksum)

    pusher.transport.send = send_with_request
    t0 = time.perf_counter()
    dense_only(pusher.push(model, version=version + 1))
    elapsed = time.perf_counter() - t0
    pusher.close()
    return elapsed, calls


# ------------------------------------------------------------------ raw baselines


def raw_gloo_rank(rank: int, port: int, sizes: list[int], repeats: int, out: Any) -> None:
    """Rank 0 sends `sizes` buckets from two reused buffers (the pusher's double
    buffering); rank 1 receives each into a buffer of its own (the server's
    staging). Timed from start to rank 1's ack after the last bucket."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    pg = torch.distributed.ProcessGroupGloo(store, rank, 2, timeout)
    flag = torch.zeros(1, dtype=torch.uint8)
    done_tag = len(sizes) + 1
    if rank == 0:
        bufs = [torch.randint(0, 256, (max(sizes),), dtype=torch.uint8) for _ in range(2)]
    else:
        bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]  # touched: no page faults
    times = []
    for _ in range(repeats + 1):
        if rank == 0:
            pg.recv([flag], 1, done_tag).wait()  # rank 1 is ready
            t0 = time.perf_counter()
            in_flight: list[Any] = [None, None]
            for i, n in enumerate(sizes):
                if in_flight[i % 2] is not None:
                    in_flight[i % 2].wait()
                in_flight[i % 2] = pg.send([bufs[i % 2][:n]], 1, i)
            for w in in_flight:
                if w is not None:
                    w.wait()
            pg.recv([flag], 1, done_tag).wait()
            times.append(time.perf_counter() - t0)
        else:
            pg.send([flag], 0, done_tag).wait()
            for i, _ in enumerate(sizes):
                pg.recv([bufs[i]], 0, i).wait()
            pg.send([flag], 0, done_tag).wait()
    if rank == 0:
        out.send(times[1:])


def raw_gloo(sizes: list[int], repeats: int) -> float:
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    port = free_port()
    procs = [ctx.Process(target=raw_gloo_rank, args=(r, port, sizes, repeats, tx))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        times = rx.recv() if rx.poll(900) else None
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if times is None:
        raise RuntimeError("raw gloo benchmark failed")
    return median(times)


def memcpy_and_crc(sizes: list[int], repeats: int) -> tuple[float, float]:
    """torch `copy_` of the same bytes, bucket by bucket, between touched buffers;
    and zlib CRC-32 of them (the pusher and the server each checksum every bucket)."""
    total = sum(sizes)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.ones(total, dtype=torch.uint8)
    copy_s, crc_s = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        off = 0
        for n in sizes:
            dst[off: off + n].copy_(src[off: off + n])
            off += n
        t1 = time.perf_counter()
        off = 0
        for n in sizes:
            zlib.crc32(memoryview(dst[off: off + n].numpy()))
            off += n
        copy_s.append(t1 - t0)
        crc_s.append(time.perf_counter() - t1)
    return median(copy_s[1:]), median(crc_s[1:])


# ------------------------------------------------------------------ driver


@dataclass
class SizeResult:
    size: str
    params: int
    nbytes: int = 0
    buckets: int = 0
    push: dict[str, float] = field(default_factory=dict)  # median of each timing
    noop: dict[str, float] = field(default_factory=dict)  # an unchanged push's medians
    raw_gloo_s: float = 0.0
    memcpy_s: float = 0.0
    crc_s: float = 0.0
    rss: dict[float, dict[str, Any]] = field(default_factory=dict)
    largest_tensor: int = 0
    per_param: tuple[float, int] | None = None
    stepped: tuple[SteppedRun, SteppedRun] | None = None  # dense, delta
    probed: dict[str, float] | None = None  # probed_pushes
    wall_s: float = 0.0


def bench_size(size: str, args: argparse.Namespace, workdir: Path) -> SizeResult:
    t_start = time.perf_counter()
    ckpt = build_llama(*SIZES[size])
    model = load_trainer_model(ckpt, getattr(torch, args.trainer_dtype))
    res = SizeResult(size, sum(p.numel() for p in model.parameters()))
    res.largest_tensor = max(p.numel() for p in model.parameters()) * DTYPE.itemsize
    print(f"[{size}] {res.params / 1e6:.1f}M params, serving {ckpt}", flush=True)
    with serve(ckpt, workdir / f"server-{size}.log") as server:
        v = server.weight_version() + 1
        runs, res.nbytes, res.buckets = timed_pushes(server.url, server.admin_token, model, v,
                                                     args.repeats, args.bucket_mb)
        res.push = {k: median([r[k] for r in runs]) for k in runs[0]}
        print(f"[{size}] bucketed push: {res.push['total_s']:.3f}s", flush=True)
        noop = noop_pushes(server.url, server.admin_token, model,
                           server.weight_version() + 1, args.repeats, args.bucket_mb)
        res.noop = {k: median([r.get(k, 0.0) for r in noop]) for k in noop[0]}
        print(f"[{size}] unchanged (delta) push: {res.noop['total_s']:.3f}s", flush=True)
        for mb in args.rss_buckets:
            v = server.weight_version() + 1
            res.rss[mb] = measure_rss(ckpt, server.url, server.admin_token, v, mb,
                                      args.trainer_dtype, args.threads)
            print(f"[{size}] rss bucket {mb:g} MiB: extra "
                  f"{res.rss[mb]['first']['extra'] / MiB:.0f} MiB", flush=True)
        if size in args.probe_sizes:
            res.probed = probed_pushes(server.url, server.admin_token, model,
                                       server.weight_version() + 1, args.repeats, args.bucket_mb)
            print(f"[{size}] probed push: {res.probed}", flush=True)
        if size in args.per_param_sizes:
            v = server.weight_version() + 1
            res.per_param = per_param_push(server.url, server.admin_token, model, v)
            print(f"[{size}] per-param push: {res.per_param[0]:.2f}s", flush=True)
        if size in args.delta_sizes:
            res.stepped = delta_runs(server.url, server.admin_token, ckpt, args,
                                     server.weight_version() + 1)
    layout = bucket_layout(model, args.bucket_mb)
    del model
    # The server is gone: the raw baselines get the CPU to themselves.
    res.raw_gloo_s = raw_gloo(layout, args.repeats)
    res.memcpy_s, res.crc_s = memcpy_and_crc(layout, args.repeats)
    res.wall_s = time.perf_counter() - t_start
    return res


def delta_runs(url: str, token: str, ckpt: Path, args: argparse.Namespace,
               version: int) -> tuple[SteppedRun, SteppedRun]:
    """The same AdamW steps twice: pushed dense, then by delta."""
    def load_model() -> torch.nn.Module:
        return load_trainer_model(ckpt, torch.float32)  # fp32 master weights

    runs = []
    for delta in (False, True):
        run, version = stepped_pushes(url, token, load_model, version, args.delta_steps,
                                      args.delta_lr, args.bucket_mb, delta)
        runs.append(run)
        print(f"[{ckpt.name}] {'delta' if delta else 'dense'} pushes after steps: "
              f"{run.encodings}, MiB "
              f"{[round(n / MiB, 2) for n in run.nbytes]}, s "
              f"{[round(t['total_s'], 3) for t in run.timings]}", flush=True)
    return runs[0], runs[1]


def report_rss(results: list[SizeResult]) -> None:
    method = next(m["first"]["method"] for r in results for m in r.rss.values())
    print(f"\n== rank-0 extra peak RSS during push() (fresh process; {method}) ==")
    rows = []
    for r in results:
        for mb, m in r.rss.items():
            f, s = m["first"], m["second"]
            rows.append([r.size, f"{mb:g}", f"{r.largest_tensor / MiB:.1f}",
                         f"{f['before'] / MiB:.0f}", f"{f['extra'] / MiB:.1f}",
                         f["extra"] / (mb * MiB), f"{s['extra'] / MiB:.1f}", f["total_s"],
                         s["total_s"]])
    print(table(["size", "bucket MiB", "largest tensor MiB", "RSS before MiB",
                 "extra peak MiB", "extra/bucket", "2nd push extra MiB", "1st push s",
                 "2nd push s"], rows))
    print(f"extra/bucket target <= {TARGET_RSS} (first push: allocates the two send buffers)")


def report(results: list[SizeResult], args: argparse.Namespace) -> None:
    gb = 1e9
    print(f"\n== bucketed push, bucket {args.bucket_mb:g} MiB, gloo, trainer dtype "
          f"{args.trainer_dtype} -> bf16 on the wire; median of {args.repeats} ==")
    rows, rates = [], []
    for r in results:
        t = r.push
        rows.append([r.size, f"{r.params / 1e6:.1f}M", f"{r.nbytes / MiB:.0f}", r.buckets,
                     t["begin_s"], t["gather_send_s"], t["server_check_s"],
                     t["server_commit_s"], t["total_s"], r.raw_gloo_s, r.memcpy_s, r.crc_s])
        rates.append([r.size, r.nbytes / t["gather_send_s"] / gb, r.nbytes / t["total_s"] / gb,
                      r.nbytes / r.raw_gloo_s / gb, r.nbytes / r.memcpy_s / gb,
                      r.nbytes / r.crc_s / gb, r.raw_gloo_s / t["gather_send_s"],
                      r.raw_gloo_s / t["total_s"]])
    print(table(["size", "params", "MiB", "buckets", "begin s", "send s", "check s",
                 "commit s", "total s", "raw gloo s", "memcpy s", "crc32 s"], rows))
    print()
    print(table(["size", "send GB/s", "push GB/s", "raw gloo GB/s", "memcpy GB/s",
                 "crc32 GB/s", "send/gloo", "push/gloo"], rates))
    print(f"send = trainer pack+CRC+send (gather_send_s), send/gloo target >= {TARGET_TRANSFER}; "
          f"push = begin..commit (total_s), push/gloo target >= {TARGET_TOTAL}")
    print("\n== a push of unchanged weights (the default pusher: a delta with nothing in it), "
          f"median of {args.repeats} ==")
    print(table(["size", "open+diff+begin s", "diff s", "send s", "check s", "commit s",
                 "total s", "total/dense"],
                [[r.size, r.noop["begin_s"], r.noop.get("diff_s", 0.0),
                  r.noop["gather_send_s"], r.noop.get("server_check_s", 0.0),
                  r.noop.get("server_commit_s", 0.0), r.noop["total_s"],
                  r.noop["total_s"] / r.push["total_s"]] for r in results]))
    print(f"target: total <= {TARGET_NOOP_S} s")
    print("\n== where the server's commit goes (the slowest replica's steps, median s) ==")
    steps = ["drain_s", "pause_s", "patch_s", "relabel_s", "load_s", "finish_s", "label_s",
             "publish_s", "resume_s", "commit_s"]
    rows = [[f"{r.size} {form}", *[t.get(f"server_{k}", 0.0) for k in steps]]
            for r in results for form, t in (("dense", r.push), ("unchanged", r.noop))]
    print(table(["push", *[k.removesuffix("_s") for k in steps]], rows))

    if any(r.rss for r in results):
        report_rss(results)

    stepped = [r for r in results if r.stepped is not None]
    if stepped:
        print(f"\n== after real optimizer steps (fp32 master weights, AdamW lr {args.delta_lr:g}, "
              f"{args.delta_steps} steps): dense (delta=False) vs delta (the default), "
              f"bucket {args.bucket_mb:g} MiB, probe off; medians ==")
        print(table(DELTA_HEADERS, [delta_row(r.size, args.delta_lr, *r.stepped)
                                    for r in stepped]))
        for r in stepped:
            for e, why in zip(r.stepped[1].encodings, r.stepped[1].reasons, strict=True):
                if e != "delta":
                    print(f"{r.size}: a push with delta on went {e}: {why}")
        print("push = begin..commit (total_s; a delta's diff included); push ratio = dense / "
              "delta (> 1: the delta is faster)")

    probed = [r for r in results if r.probed is not None]
    if probed:
        print(f"\n== the probe's cost: dense pushes ({args.trainer_dtype} trainer) without it, "
              f"with it (its forward while the servers load), and as it ran before (forward "
              f"after the commit); medians of {args.repeats}, interleaved ==")
        print(table(["size", "no probe s", "probe during s", "probe after s", "forward s",
                     "scoring s", "cost during", "cost after"],
                    [[r.size, p["off"], p["during"], p["after"], p["forward"], p["scoring"],
                      p["during"] / p["off"] - 1, p["after"] / p["off"] - 1]
                     for r in probed for p in [r.probed]]))
        print(f"cost = (push with probe) / (push without) - 1; target < {TARGET_PROBE}")
    rows = [[r.size, r.per_param[1], r.per_param[0], r.per_param[0] / r.per_param[1],
             r.push["total_s"], r.per_param[0] / r.push["total_s"]]
            for r in results if r.per_param is not None]
    if rows:
        print("\n== per-parameter push (1 HTTP request + 1 gloo send per param) vs bucketed ==")
        print(table(["size", "params pushed", "per-param s", "s/param", "bucketed s",
                     "speedup"], rows))
        print(f"speedup target >= {TARGET_PER_PARAM}")
    print("\nwall time per size: " + ", ".join(f"{r.size} {r.wall_s:.0f}s" for r in results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10m,100m,500m", help=f"comma list of {list(SIZES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256, help="bucket for the timed pushes")
    ap.add_argument("--rss-buckets", default="16,64,256", help="MiB, comma list; '' skips")
    ap.add_argument("--per-param-sizes", default="100m", help="sizes to run the baseline on")
    ap.add_argument("--probe-sizes", default="10m,100m",
                    help="sizes to measure the probe's cost on; '' skips")
    ap.add_argument("--delta-sizes", default="10m,100m",
                    help="sizes to run the delta row on (pushes after AdamW steps); '' skips")
    ap.add_argument("--delta-steps", type=int, default=3)
    ap.add_argument("--delta-lr", type=float, default=1e-6)
    ap.add_argument("--trainer-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the pushed module (fp32 adds a cast while packing)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads of the pushing process (see README)")
    args = ap.parse_args()
    # 2 cores shared with the server's three processes: with 2 OpenMP threads the
    # pusher's copy_ stalls in barriers whenever a core is taken (10x slower).
    torch.set_num_threads(args.threads)
    sizes = [s for s in args.sizes.split(",") if s]
    args.rss_buckets = [float(x) for x in args.rss_buckets.split(",") if x]
    args.per_param_sizes = {s for s in args.per_param_sizes.split(",") if s}
    args.probe_sizes = {s for s in args.probe_sizes.split(",") if s}
    args.delta_sizes = {s for s in args.delta_sizes.split(",") if s}

    print(f"machine: {machine()}; torch threads in the pushing process: {args.threads}",
          flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        results = [bench_size(s, args, Path(tmp)) for s in sizes]
    report(results, args)
    print(f"bench wall time: {time.perf_counter() - t0:.0f}s; at the end {load()}")


if __name__ == "__main__":
    main()
