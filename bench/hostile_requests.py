"""What each hostile request of issue 55 does to a running server: the status
it gets, the API process's memory (RSS before, its peak while the request
ran, after; MiB), /health's slowest answer meanwhile, and whether the
served weights changed (a prompt's logprobs and the served version, before
and after).

The scenarios are functions of a running server, so tests/e2e/test_abuse.py
runs the same requests and asserts what they must do now. Run as a script,
it starts its servers from whatever `rollout_sidecar` this interpreter
imports: this checkout, or an older one put first on PYTHONPATH (that is how
the before/after table in docs/security.md was made):

    .venv/bin/python bench/hostile_requests.py [--only NAME,...] [--json out.json]

Three scenarios start servers of their own (an empty admin token, failpoints
in the environment, a replica whose peer is a stub); the rest share one fp32
server with a SkyRL sync root.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

if __name__ == "__main__":  # run as a script: the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.rogue_peer import RogueStub, one_slot_buckets  # noqa: E402

MIB = 2**20
PROMPT = [[1, 17, 42, 99, 7, 250, 3, 64]]


@dataclass
class Target:
    """A running server, as the scenarios need it."""

    url: str
    port: int
    data_plane_port: int
    api_token: str
    admin_token: str
    pid: int  # the API process
    sync_root: Path | None = None

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def api(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_token}"} if self.api_token else {}


@dataclass
class Outcome:
    request: str
    status: str
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    health_worst_s: float = 0.0
    served: str = "unchanged"
    note: str = ""


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def fingerprint(t: Target) -> tuple[int, tuple[float, ...]]:
    """The served version and a prompt's logprobs under it."""
    r = httpx.post(t.url + "/generate", headers=t.api(), timeout=120, json={
        "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 1, "prompt_logprobs": True}})
    r.raise_for_status()
    body = r.json()
    return body["weight_version"], tuple(round(x, 6) for x in body["results"][0][
        "prompt_logprobs"][1:])


@contextmanager
def watched(t: Target, outcome: Outcome, served: bool = True) -> Iterator[None]:
    """Fill `outcome`'s memory, /health and served-weights columns around the block."""
    before = fingerprint(t) if served else None
    outcome.rss_before_mib = outcome.rss_peak_mib = rss_mib(t.pid)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            outcome.rss_peak_mib = max(outcome.rss_peak_mib, rss_mib(t.pid))
            t0 = time.monotonic()
            try:
                httpx.get(t.url + "/health", timeout=30)
            except httpx.HTTPError:
                pass
            outcome.health_worst_s = max(outcome.health_worst_s, time.monotonic() - t0)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join(60)
        time.sleep(0.5)  # the request's buffers freed, if they are
        outcome.rss_after_mib = rss_mib(t.pid)
        if before is not None:
            after = fingerprint(t)
            if after != before:
                outcome.served = f"changed: v{before[0]} -> v{after[0]}"


def raw_post(t: Target, path: str, nbytes: int, headers: dict[str, str] | None = None,
             method: str = "POST") -> str:
    """Send `nbytes` of JSON-looking body over a raw socket as fast as the
    server takes it; the status line the server answered (or 'closed')."""
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    chunk = b"[" + b"1," * (MIB // 2 - 1) + b"1]"  # one MiB
    with socket.create_connection(("127.0.0.1", t.port), timeout=120) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{head}Content-Type: "
                     f"application/json\r\nContent-Length: {nbytes}\r\n\r\n".encode())
        sent = 0
        try:
            while sent < nbytes:
                n = min(len(chunk), nbytes - sent)
                sock.sendall(chunk[:n])
                sent += n
        except OSError:
            pass  # the server answered and closed: read what it said
        try:
            line = sock.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError:
            line = ""
    code = line.split(" ")[1] if line.startswith("HTTP/") else "closed"
    return f"{code} after {sent / MIB:.0f} of {nbytes / MIB:.0f} MiB sent"


# ---------------------------------------------------------------- the requests


def huge_body_no_token(t: Target) -> Outcome:
    o = Outcome("256 MiB JSON to /weights/begin, no token", "")
    with watched(t, o):
        o.status = raw_post(t, "/weights/begin", 256 * MIB)
    return o


def huge_body_admin(t: Target) -> Outcome:
    o = Outcome("256 MiB JSON to /weights/begin, admin token", "")
    with watched(t, o):
        o.status = raw_post(t, "/weights/begin", 256 * MIB, t.admin())
    return o


def unfinished(t: Target) -> int:
    text = httpx.get(t.url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("rollout_sidecar_engine_unfinished_requests"):
            return int(float(line.split()[-1]))
    return -1


def huge_integers(t: Target) -> Outcome:
    o = Outcome("/generate max_tokens 2**64, top_k 10**30 (x20 each)", "")
    codes = set()
    with watched(t, o):
        before = unfinished(t)
        for sampling in [{"max_tokens": 2**64}, {"top_k": 10**30}] * 20:
            r = httpx.post(t.url + "/generate", headers=t.api(), timeout=60, json={
                "prompt_token_ids": PROMPT, "sampling": sampling})
            codes.add(r.status_code)
        o.note = f"engine's unfinished requests {before} -> {unfinished(t)}"
    o.status = ",".join(map(str, sorted(codes)))
    return o


def vllm_rejects(t: Target) -> Outcome:
    o = Outcome("/v1/completions ({}, an empty prompt, max_tokens 2**64) and "
                "/inference/v1/generate with what vLLM rejects", "")
    codes = []
    with watched(t, o):
        for path, body in [("/v1/completions", {}), ("/v1/completions", {"prompt": ""}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}),
                           ("/inference/v1/generate", {"token_ids": []})]:
            codes.append(httpx.post(t.url + path, headers=t.api(), json=body,
                                    timeout=60).status_code)
    o.status = ",".join(map(str, codes))
    return o


def store_flood(t: Target) -> Outcome:
    """64 values of 8 MiB into the data plane's rendezvous store, no token."""
    import datetime

    import torch.distributed as dist

    o = Outcome("64 x 8 MiB into the rendezvous store, no token", "")
    with watched(t, o):
        try:
            store = dist.TCPStore("127.0.0.1", t.data_plane_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=12))
            value = bytes(8 * MIB)
            for i in range(64):
                store.set(f"flood/{i}", value)
            o.status = "accepted all 64"
            for i in range(64):
                store.delete_key(f"flood/{i}")
        except Exception as e:  # noqa: BLE001 - refused, in whatever words torch says it
            o.status = f"refused ({type(e).__name__})"
    return o


def _begin(t: Target, first_nbytes: int | None = None) -> httpx.Response:
    """Begin an HTTP push (bucket 0 claiming `first_nbytes`, if given)."""
    index = httpx.get(t.url + "/weights/index", headers=t.admin(), timeout=60).json()
    buckets, _ = one_slot_buckets(index)
    if first_nbytes is not None:
        buckets[0]["nbytes"] = first_nbytes
    version = httpx.get(t.url + "/weights/status", headers=t.admin(),
                        timeout=30).json()["weight_version"] + 1
    return httpx.post(t.url + "/weights/begin", headers=t.admin(), timeout=60, json={
        "version": version, "transport": "http", "buckets": buckets})


def _abort(t: Target, push_id: str) -> None:
    httpx.post(t.url + "/weights/abort", headers=t.admin(), timeout=60,
               json={"push_id": push_id, "reason": "bench"})


def oversized_manifest(t: Target) -> Outcome:
    o = Outcome("a manifest whose first bucket says 1 GiB for its one slot", "")
    with watched(t, o):
        r = _begin(t, 1 << 30)
        o.status = str(r.status_code)
        if r.status_code == 200:
            _abort(t, r.json()["push_id"])
    return o


def oversized_bucket(t: Target) -> Outcome:
    o = Outcome("PUT /weights/bucket/0: 1 GiB for a bucket its manifest sizes", "")
    with watched(t, o):
        r = _begin(t)
        push_id = r.json().get("push_id")
        if push_id is None:
            o.status = f"begin {r.status_code}: {r.text[:80]}"
            return o
        try:
            o.status = raw_post(t, "/weights/bucket/0", 1 << 30, {
                **t.admin(), "X-Push-Id": push_id, "X-Checksum": "0"}, method="PUT")
        finally:
            _abort(t, push_id)
    return o


def zstd_bomb(t: Target) -> Outcome:
    """SkyRL's /fetch_weights of a 64 KiB payload whose frame declares 2 GiB."""
    import torch
    import zstandard
    from safetensors.torch import save_file

    o = Outcome("SkyRL /fetch_weights: a 64 KiB zstd frame declaring 2 GiB", "")
    assert t.sync_root is not None, "a server with --weight-sync-root"
    index = httpx.get(t.url + "/weights/index", headers=t.admin(), timeout=60).json()
    name, info = next(iter(index["tensors"].items()))
    version = httpx.get(t.url + "/weights/status", headers=t.admin(),
                        timeout=30).json()["weight_version"] + 1
    folder = t.sync_root / "bomb" / f"delta-{version:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=2**31, closefd=False) as w:
        for _ in range(2048):
            w.write(bytes(MIB))
    packed = out.getvalue()
    save_file({"p0": torch.frombuffer(bytearray(packed), dtype=torch.uint8)},
              str(folder / "payload.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({
        "version": version, "base_version": version - 1, "tensors": [{
            "name": name, "dtype": info["dtype"], "shape": info["shape"],
            "uncompressed_num_bytes": 2**31, "compressed_num_bytes": len(packed),
            "payload_file": "payload.safetensors", "payload_key": "p0", "checksum": "0" * 32}]}))
    with watched(t, o):
        init = httpx.post(t.url + "/init_weight_transfer_engine", headers=t.admin(), timeout=120,
                          json={"init_info": {"base_model_path": "x"}})
        r = httpx.post(t.url + "/fetch_weights", headers=t.admin(), timeout=300, json={
            "target_version": version, "sync_dir": str(t.sync_root / "bomb")})
        o.status = f"init {init.status_code}, fetch {r.status_code}"
        o.note = r.text[:100]
    return o


def sync_dir_escape(t: Target) -> Outcome:
    o = Outcome("SkyRL /fetch_weights with sync_dir outside the store (../..)", "")
    with watched(t, o):
        httpx.post(t.url + "/init_weight_transfer_engine", headers=t.admin(), timeout=120,
                   json={"init_info": {"base_model_path": "x"}})
        r = httpx.post(t.url + "/fetch_weights", headers=t.admin(), timeout=60, json={
            "target_version": 10**9, "sync_dir": "../../../../etc"})
        o.status, o.note = str(r.status_code), r.text[:100]
    return o


def skyrl_reinit(t: Target) -> Outcome:
    """SkyRL pushes version n+1 (one norm x4) through its deltas, its trainer
    re-inits, then version n+2 touches another tensor: does n+2 keep the x4?"""
    o = Outcome("SkyRL re-init while v(n+1) serves, then a delta of another tensor", "")
    assert t.sync_root is not None, "a server with --weight-sync-root"
    version = httpx.get(t.url + "/weights/status", headers=t.admin(),
                        timeout=30).json()["weight_version"]
    served = staged_tensors(t) if version else checkpoint(t)
    norm = next(n for n in served if n.endswith("norm.weight") and "layers.0." in n)
    other = next(n for n in served if n.endswith("norm.weight") and n != norm)
    sync = t.sync_root / f"reinit-{version}"
    with watched(t, o, served=False):
        calls = [_init(t)]
        step1 = {norm: served[norm] * 4}
        write_delta(sync, version + 1, served, step1)
        calls += _update(t, version + 1, sync)
        calls.append(_init(t))  # the trainer restarts
        write_delta(sync, version + 2, {**served, **step1}, {other: served[other] + 1})
        calls += _update(t, version + 2, sync)
        o.status = ",".join(map(str, calls))
        now = staged_tensors(t)
        kept = now[norm].equal(step1[norm].to(now[norm].dtype))
        o.served = "v+2 keeps v+1's norm x4" if kept else "v+2 REVERTED v+1's norm x4 to x1"
    return o


def _init(t: Target) -> int:
    return httpx.post(t.url + "/init_weight_transfer_engine", headers=t.admin(), timeout=300,
                      json={"init_info": {"base_model_path": "x"}}).status_code


def _update(t: Target, version: int, sync: Path) -> list[int]:
    codes = [httpx.post(t.url + "/fetch_weights", headers=t.admin(), timeout=300, json={
        "target_version": version, "sync_dir": str(sync)}).status_code]
    for path, body in [("/start_weight_update", None),
                       ("/update_weights", {"update_info": {"target_version": version}}),
                       ("/finish_weight_update", None)]:
        codes.append(httpx.post(t.url + path, headers=t.admin(), json=body,
                                timeout=300).status_code)
    return codes


def staged_tensors(t: Target) -> dict:
    """The served version's tensors, read back from the staged copy, in the
    checkpoint's dtype where the served one is wider (fp32 serving of bf16)."""
    import torch

    copy = httpx.get(t.url + "/weights/staged", headers=t.admin(), timeout=60).json()
    out = {}
    for b in copy["buckets"]:
        data = httpx.get(f"{t.url}/weights/staged/{b['index']}", headers=t.admin(),
                         timeout=60).content
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for p in b["params"]:
            dtype = getattr(torch, p["dtype"])
            n = dtype.itemsize
            for d in p["shape"]:
                n *= d
            assert p.get("chunk_offset") is None, "whole tensors only"
            out[p["name"]] = raw[p["offset"]:p["offset"] + n].view(dtype).view(p["shape"])
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def checkpoint(t: Target) -> dict:
    from safetensors.torch import load_file

    model = Path(httpx.get(t.url + "/info", headers=t.api(), timeout=30).json()["model"])
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def write_delta(sync: Path, version: int, old: dict, new: dict) -> None:
    """SkyRL's format (tests/test_skyrl_delta_units.py), bf16 bytes."""
    from tests.test_skyrl_delta_units import write_delta as skyrl_delta

    skyrl_delta(sync, version, old, new)


SHARED: dict[str, Callable[[Target], Outcome]] = {
    "huge_body_no_token": huge_body_no_token, "huge_body_admin": huge_body_admin,
    "huge_integers": huge_integers, "vllm_rejects": vllm_rejects,
    "oversized_manifest": oversized_manifest, "oversized_bucket": oversized_bucket,
    "store_flood": store_flood, "zstd_bomb": zstd_bomb, "sync_dir_escape": sync_dir_escape,
    "skyrl_reinit": skyrl_reinit,
}


# ------------------------------------------------- requests with their own server


def start(tmp: Path, name: str, env: dict[str, str], wait: bool = True,
          model: Path | None = None):  # noqa: ANN201
    """A server from the launcher (tokens drawn), fp32, a small KV cache."""
    from rollout_sidecar.server.launcher import launch_server

    return launch_server(log=tmp / f"{name}.log", dtype="float32", max_model_len=512,
                         model=model,
                         env={"ROLLOUT_SIDECAR_CACHE_DIR": str(tmp / "cache"),
                              "ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25", **env}, wait=wait)


@contextmanager
def serve_as_configured(tmp: Path, name: str, env: dict[str, str]) -> Iterator[
        tuple[subprocess.Popen, str]]:
    """`rollout-sidecar serve` with exactly `env` on top of ours (the
    launcher would draw tokens where these are empty); (process, URL)."""
    from rollout_sidecar.server.launcher import free_port, stop_process

    port = free_port()
    full = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
    full.update({"ROLLOUT_SIDECAR_CACHE_DIR": str(tmp / "cache"),
                 "ROLLOUT_SIDECAR_KV_CACHE_GIB": "0.25", **env})
    with open(tmp / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rollout_sidecar.server.cli", "serve",
                                 "--port", str(port), "--data-plane-port", str(free_port()),
                                 "--dtype", "float32", "--max-model-len", "512"],
                                env=full, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, timeout_s=30)


def started_or_refused(proc: subprocess.Popen, url: str, log: Path,
                       timeout_s: float = 300) -> str:
    """'exit N: its last line' if the server refused to start, else 'started'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # typer draws its error in a box: its words
            said = [ln.strip("│ ") for ln in log.read_text(errors="replace").splitlines()
                    if any(c.isalpha() for c in ln)]
            return f"exit {proc.returncode}: {' '.join(said[-3:])[-200:]}"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return "started"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return "neither started nor exited"


def empty_admin_token(tmp: Path) -> Outcome:
    o = Outcome("serve with ROLLOUT_SIDECAR_ADMIN_TOKEN= (empty)", "")
    with serve_as_configured(tmp, "empty-token", {"ROLLOUT_SIDECAR_ADMIN_TOKEN": ""}) as (
            proc, url):
        o.status = started_or_refused(proc, url, tmp / "empty-token.log")
        if o.status == "started":
            codes = [httpx.get(url + "/weights/status", headers={"Authorization": h},
                               timeout=30).status_code for h in ("Bearer", "Basic Og==")]
            o.note = f"empty Bearer / Basic on /weights/status: {codes}"
    return o


def failpoints_in_env(tmp: Path) -> Outcome:
    o = Outcome("serve with ROLLOUT_SIDECAR_FAILPOINTS in its environment, no flag", "")
    fault = tmp / "fault"
    fault.write_text("")
    with serve_as_configured(tmp, "failpoints", {
            "ROLLOUT_SIDECAR_FAILPOINTS": str(fault),
            "ROLLOUT_SIDECAR_ADMIN_TOKEN": "admin-0123456789"}) as (proc, url):
        o.status = started_or_refused(proc, url, tmp / "failpoints.log")
        o.note = "armed: whoever writes the file arms load.stale" if o.status == "started" \
            else ""
    return o


def rogue_peer(tmp: Path, t: Target) -> Outcome:
    """A replica whose --peers is a stub serving all-zero weights as 10**12."""
    o = Outcome("--peers naming a stub that serves zeros as version 10**12", "")
    status = httpx.get(t.url + "/weights/status", headers=t.admin(), timeout=30).json()
    index = httpx.get(t.url + "/weights/index", headers=t.admin(), timeout=30).json()
    stub = RogueStub.serve(status, index)
    s = start(tmp, "rogue-replica", {"ROLLOUT_SIDECAR_PEERS": stub.url,
                                     "ROLLOUT_SIDECAR_ADMIN_TOKEN": t.admin_token,
                                     "ROLLOUT_SIDECAR_API_TOKEN": t.api_token}, wait=False)
    try:
        o.status = started_or_refused(s.proc, s.url, s.log)
        if o.status == "started":
            replica = Target(s.url, s.port, s.data_plane_port, t.api_token, t.admin_token,
                             s.proc.pid)
            version, lps = fingerprint(replica)
            o.served = f"v{version}" + (" (uniform: zeros)" if len(set(lps)) == 1 else "")
        o.note = ("the stub was sent the admin token" if any(
            t.admin_token in json.dumps(h) for h in stub.seen) else "the stub never saw the token")
    finally:
        s.stop(timeout_s=30)
        stub.close()
    return o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--size", default="default", choices=["default", "100m"],
                    help="the shared server's model: the embedded default, or bench/push.py's "
                    "100M Llama (bf16 on disk, served fp32: SkyRL's update memory shows)")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    rows: list[Outcome] = []
    sync_root = tmp / "store"
    sync_root.mkdir()
    model = None
    if args.size == "100m":
        from bench._common import build_llama

        model = build_llama(1024, 2816, 8)  # bench/push.py's 100m
    s = start(tmp, "shared", {"ROLLOUT_SIDECAR_WEIGHT_SYNC_ROOT": str(sync_root)}, model=model)
    t = Target(s.url, s.port, s.data_plane_port, s.api_token, s.admin_token, s.proc.pid,
               sync_root)
    try:
        for name, scenario in SHARED.items():
            if not only or name in only:
                rows.append(scenario(t))
                print(rows[-1], flush=True)
        for name, alone in (("empty_admin_token", empty_admin_token),
                            ("failpoints_in_env", failpoints_in_env)):
            if not only or name in only:
                rows.append(alone(tmp))
                print(rows[-1], flush=True)
        if not only or "rogue_peer" in only:
            rows.append(rogue_peer(tmp, t))
            print(rows[-1], flush=True)
    finally:
        s.stop(timeout_s=30)
    print(f"\nrollout_sidecar from {Path(sys.modules['rollout_sidecar.server'].__file__).parent}")
    print("| request | status | API RSS before / peak / after (MiB) | /health worst | served |")
    print("|---|---|---|---|---|")
    for r in rows:
        memory = (f"{r.rss_before_mib:.0f} / {r.rss_peak_mib:.0f} / {r.rss_after_mib:.0f}"
                  if r.rss_before_mib else "-")
        worst = f"{r.health_worst_s:.2f} s" if r.rss_before_mib else "-"
        print(f"| {r.request} | {r.status} | {memory} | {worst} | {r.served}"
              f"{'; ' + r.note if r.note else ''} |")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
