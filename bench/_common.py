"""Shared bench helpers: a real server as a subprocess, cached checkpoints, tables.

Imported by bench/generate.py and bench/push.py (run as scripts, so this
directory is on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollout_sidecar.server.launcher import free_port, launch_server  # noqa: F401 (push.py)

# Checkpoints are deterministic, so they are built once and reused across runs.
CACHE = Path(os.environ.get("ROLLOUT_SIDECAR_BENCH_CACHE",
                            Path(tempfile.gettempdir()) / "rollout-sidecar-bench"))
# vLLM CPU otherwise reserves a large KV cache; 1 GiB fits every bench here.
# Warnings only: vLLM's per-request INFO lines would bury the tables.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, no GPU; "
            f"{load()}")


def load() -> str:
    """The 1-minute load average: other work on this machine skews every figure."""
    return f"load avg {os.getloadavg()[0]:.1f}"


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)


# ------------------------------------------------------------------ models


def default_model() -> Path:
    from rollout_sidecar.server.model.default_model import ensure_default_model

    return ensure_default_model(CACHE)


def build_llama(hidden: int, intermediate: int, layers: int) -> Path:
    """A Llama checkpoint shaped like the default model but bigger (bf16, byte
    tokenizer, tied embeddings, head_dim 64 as vLLM's CPU attention needs).

    Deterministic (fixed seed) and cached by shape; built in a temp dir and
    renamed, so an interrupted build is never reused.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout_sidecar.server.model.default_model import (
        BOS_ID,
        EOS_ID,
        MODEL_CONFIG,
        PAD_ID,
        RECIPE_VERSION,
        SEED,
        VOCAB_SIZE,
    )

    # The recipe version is in the name: tokenizer files come from the default model.
    target = CACHE / f"llama-h{hidden}-i{intermediate}-l{layers}-r{RECIPE_VERSION}"
    heads = hidden // 64
    cfg = dict(MODEL_CONFIG, hidden_size=hidden, intermediate_size=intermediate,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads)

    def write(tmp: Path) -> None:
        config = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                             pad_token_id=PAD_ID, torch_dtype="bfloat16", **cfg)
        torch.manual_seed(SEED)
        # Built in bf16 directly: a 500M model in fp32 would be a 2 GB detour.
        with _default_dtype(torch.bfloat16):
            model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
        src = default_model()
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(src / f, tmp / f)
        (tmp / "done").write_text(json.dumps(cfg))

    return cached(target, write)


def cached(target: Path, write: Any) -> Path:
    """`target`, built once by `write(folder)` in a temporary folder and
    renamed, so an interrupted build is never reused; `write` leaves a file
    `done` in it."""
    if (target / "done").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=CACHE))
    try:
        write(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _default_dtype(dtype: object) -> Iterator[None]:
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ------------------------------------------------------------------ server


@dataclass
class Server:
    url: str
    api_token: str
    admin_token: str
    proc: subprocess.Popen
    log: Path

    def client(self):  # noqa: ANN201
        from rollout_sidecar.client import GenerationClient

        return GenerationClient(self.url, api_token=self.api_token, timeout=900)

    def weight_version(self) -> int:
        r = httpx.get(self.url + "/weights/status", timeout=30,
                      headers={"Authorization": f"Bearer {self.admin_token}"})
        r.raise_for_status()
        return int(r.json()["weight_version"])


@contextlib.contextmanager
def serve(model: Path | None, log: Path, max_model_len: int = 512,
          ready_timeout_s: float = 600, env: dict[str, str] | None = None,
          cpus: str | None = None, prefix: list[str] | None = None,
          host: str | None = None, own_session: bool = True) -> Iterator[Server]:
    """`rollout-sidecar serve` as a subprocess on free ports (the shared
    launcher, rollout_sidecar.server.launcher); always stopped on exit.

    Its own session (unless `own_session` is false), so the vLLM engine
    process it spawns is stopped with it; a TP >= 2 server in its own session
    failed every push here (before this change too; docs/gpu.md), so the
    staging bench starts those in ours (vLLM's processes die with the server
    anyway: PR_SET_PDEATHSIG, server/weights/worker/vllm_plugin.py).
    `cpus` (a taskset list, e.g. "1") pins the server and its engine there,
    OpenMP threads included. `prefix` runs it inside something (a network
    namespace: netns.py), where it listens on every address and is reached at
    `host`. Tokens given in `env` (shared by replicas) are used.
    """
    launched = launch_server(
        log=log, model=model, max_model_len=max_model_len, cpus=cpus, prefix=prefix or (),
        host=host, own_session=own_session, wait=False, args=["--log-level", "warning"],
        env={"ROLLOUT_SIDECAR_CACHE_DIR": str(CACHE), **ENGINE_ENV, **(env or {})})
    with launched:  # stopped on exit, ready or not
        launched.wait_ready(ready_timeout_s)
        yield Server(launched.url, launched.api_token, launched.admin_token, launched.proc,
                     launched.log)


# ------------------------------------------------------------------ memory


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakRss:
    """Peak RSS over a block, in bytes.

    Primary: the kernel's own high-water mark (VmHWM), reset by writing 5 to
    /proc/self/clear_refs: exact, no sampling. Fallback where that file is not
    writable: a thread sampling VmRSS every millisecond.
    """

    def __enter__(self) -> PeakRss:
        self.before = _status_kb("VmRSS") * 1024
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM reset via /proc/self/clear_refs"
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
        self._peak, self._stop = self.before, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, _status_kb("VmRSS") * 1024)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self._peak, _status_kb("VmRSS") * 1024)
        if self.method.startswith("VmHWM"):
            self.peak = max(self.peak, _status_kb("VmHWM") * 1024)

    @property
    def extra(self) -> int:
        return self.peak - self.before


def in_fresh_process(target: Any, args: tuple, what: str, timeout_s: float = 900) -> Any:
    """Run `target(*args, pipe)` in a spawned process and return what it sends
    through the pipe: a fresh process, so its first allocations are measured."""
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, tx))
    p.start()
    try:
        res = rx.recv() if rx.poll(timeout_s) else None
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    if res is None:
        raise RuntimeError(f"{what} exited {p.exitcode}")
    return res
