"""The post-push probe: does the server now compute what the trainer computes?

While the commit runs, every trainer rank runs its own forward pass over one
fixed token sequence (a collective under FSDP, so all ranks take part in
step); after it, rank 0 sends the per-token logprobs to `POST /weights/probe`,
where the server scores the same tokens under the version just committed and
records the gap.

What it catches that the wire CRCs cannot: a parameter vLLM skipped or
mis-mapped, a layer whose derived state (a CPU prepack, a fused copy) was not
rebuilt, a wrong name mapping.

What it costs: one forward of `PROBE_TOKENS` tokens on every rank, one
prefill with prompt logprobs on every replica, and two HTTP round trips. The
server's side dominates: measured on 2 CPU cores with the tests' default model
(tests/e2e/test_push.py, 2 gloo ranks), the trainer's forward is ~10 ms and a
whole probe 0.08-0.2 s, but the first probe a freshly started server answered
took 3.4 s: it was that server's first request (later trainer processes' first
probes were fast, so the one-time cost is the server's). Larger models add
their forward on both sides; on a GPU that is milliseconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rollout_sidecar.protocol.data_plane.wire_format import dtype_name
from rollout_sidecar.protocol.precisions import probe_tolerance
from rollout_sidecar.protocol.schema import ProbeRequest, ProbeResult
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins, failures
from rollout_sidecar.trainer.control.serving_state import ServingState
from rollout_sidecar.trainer.errors import (
    ReplicaError,
    ReplicaLostError,
    WeightMismatchError,
    WeightPushError,
)
from rollout_sidecar.trainer.rank_agreement import agree, rank
from rollout_sidecar.trainer.two_phase import live_versions

log = logging.getLogger(__name__)
PROBE_TOKENS = 64
_SEED = 20261122

# Largest acceptable mean |dlogp| over the probe: by the coarser of the two
# sides' logit precision, each precision's row (protocol/precisions.py).
# Drift, relative to the floor: each probe is also compared with the gap the
# probe of the push before it measured, if it passed (the floor of this engine
# pair on weights one step away; with `probe_every` > 1 there is none): a gap
# over max(3 x floor, floor + 0.008), within the tolerance above, passes as
# drift (`ProbeResult.drifted`, a warning on both sides), never as a failure.
# Why a warning: in bf16 the floor is 0.001-0.01 nats and a healthy run's gap
# wanders as far as an error does. A stale down_proj after one step took a
# tied Llama's gap from 0.0027 to 0.0181 (the absolute 0.1 misses it); a
# healthy demo run went from 0.00096 to 0.0118 in one step (12x) and a
# healthy 100m push at lr 1e-5 from 0.0065 to 0.0211. As a failure the rule
# marked healthy versions suspect (/ready 503) and stopped training. fp32
# proves exactness (1e-3 against a floor of 1e-7); pass `probe_tolerance` to
# fail on a bound of your own.
FLOOR_FACTOR, FLOOR_MARGIN = 3.0, 0.008
# A quantized server (`serve --quantization`) against the trainer's bf16 or
# fp32 forward: quantization error on top of the serving dtype's rounding
# (0.004 nats on the tiny Qwen3-MoE with int8 experts; fp8 on real models
# with outlier channels loses several times bf16's). As bf16's 0.1, it fails
# only gross errors; the floor rule above (relative to the last passed probe)
# is what sees a stale layer (docs/fast-rollouts.md: 0.004 -> 0.012, drift).
QUANTIZED_TOLERANCE = 0.3

Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]
T = TypeVar("T")


def drift_tolerance(absolute: float, floor: float | None) -> float | None:
    """Over this a passing probe has drifted, given the last passed probe's
    gap (`floor`); None without one, or where it would not be under `absolute`."""
    if floor is None:
        return None
    drift = max(FLOOR_FACTOR * floor, floor + FLOOR_MARGIN)
    return drift if drift < absolute else None


def probe_token_ids(vocab_size: int, max_model_len: int) -> list[int]:
    """The same sequence on every rank and every push: fixed seed."""
    n = max(2, min(PROBE_TOKENS, max_model_len - 1))
    g = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


def default_tolerance(serve_dtype: torch.dtype, logits_dtype: torch.dtype,
                      quantization: str | None = None) -> float:
    """By the coarser side's precision; a quantized server's own."""
    if quantization is not None:
        return QUANTIZED_TOLERANCE
    return probe_tolerance(dtype_name(serve_dtype), dtype_name(logits_dtype))


def hf_forward(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The default forward: a transformers causal LM (or anything returning logits).
    A PEFT model's forward applies its active adapters unmerged, so its probe
    checks the merged weights the push sent (trainer/gather/peft_merge.py)
    against the adapted model the trainer computes with."""
    out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out


class LogitsOf(nn.Module):
    """A function from input ids to logits as the probe's module (a push from
    named tensors has no module of its own: pusher.push_tensors)."""

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(input_ids)


@contextmanager
def _eval(model: nn.Module) -> Any:
    # Dropout off for the probe; the training mode comes back afterwards.
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def input_device(model: nn.Module, device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.device_type != "cpu":  # FSDP2, maybe offloaded
            return torch.device(mesh.device_type, torch.accelerator.current_device_index())
        return p.device if not p.is_meta else torch.device("cpu")
    return torch.device("cpu")


def trainer_logprobs(model: nn.Module, token_ids: list[int], device: torch.device | None,
                     forward: Forward | None = None) -> tuple[list[float], torch.dtype]:
    """logprob of token i given tokens < i, for i >= 1; and the logits' dtype."""
    ids = torch.tensor([token_ids], device=input_device(model, device))
    with _eval(model):
        logits = (forward or hf_forward)(model, ids)
    reshard(model)
    if hasattr(logits, "full_tensor"):  # a DTensor from a tensor-parallel head
        logits = logits.full_tensor()
    lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    picked = lp.gather(-1, ids[0, 1:, None])[:, 0]
    return picked.cpu().tolist(), logits.dtype


def reshard(model: nn.Module) -> None:
    """Free what a forward with no backward left gathered. FSDP2's root and
    FSDP1's root unit keep their full parameters after a forward, expecting
    the backward to use them; the probe has none, so every rank would hold
    the full embedding and head until the next step, the shard copy a delta
    diffs against could not be refreshed (delta/shard_pieces.py), and FSDP1's
    next forward would read the kept copy, not the shard. FSDP1 has no public
    reshard: its own post-forward step, with the free it skips for the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._runtime_utils import _reshard as fsdp1_reshard

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
        elif isinstance(module, FullyShardedDataParallel):
            handle = module._handle
            if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
                fsdp1_reshard(module, handle, True)


def lost_in_probe(version: int, urls: list[str], results: list, bad: list[int]
                  ) -> WeightPushError:
    """The probe could not ask some replicas: every replica committed
    `version` (the probe runs after the commit), so say that it is live, and
    what happened to the ones the probe could not reach."""
    live: dict[str, int | None] = {u: version for u in urls}
    errors = "; ".join(str(results[i]) for i in bad)
    probed = [urls[i] for i in range(len(urls)) if i not in bad]
    message = (f"version {version} committed and live on every replica "
               f"({live_versions(live)}), but the probe failed on {len(bad)} of {len(urls)}: "
               f"{errors}" + (f"; probed: {', '.join(probed)}" if probed else ""))
    lost = all(isinstance(results[i], ReplicaError) and results[i].what in
               ("frozen", "unreachable") for i in bad)
    return (ReplicaLostError if lost else WeightPushError)(message, live)


@dataclass
class ProbeForward:
    """The trainer's side of a probe: the sequence and its logprobs under the
    pushed weights, or the error the forward raised (raised at the probe)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    logits_dtype: torch.dtype | None = None
    error: Exception | None = None
    seconds: float = 0.0


def commit_with_forward(commit: Callable[[], T | None], model: nn.Module,
                        serving: ServingState | None, forward: bool | Forward,
                        device: torch.device | None) -> tuple[T, ProbeForward]:
    """Rank 0's `commit` (HTTP round trips while the servers load) on a thread,
    while every rank runs the probe's forward; then every rank gets the
    commit's outcome (`agree`) and the forward.

    Why together: the forward depends only on the trainer's weights, which
    are the pushed ones before the commit starts, and the ranks are idle
    while the servers load; run after the commit it was the probe's larger
    half. The forward makes no call to the servers and the commit no
    collective, so neither waits on the other. A forward that raises is
    kept and raised at the probe, after the commit's bookkeeping, as before.
    """
    ids: list[int] = agree(lambda: probe_token_ids(serving.vocab_size, serving.max_model_len)
                           if serving is not None else None)
    with ThreadPoolExecutor(1, thread_name_prefix="rollout-sidecar-commit") as pool:
        pending = pool.submit(commit) if rank() == 0 else None
        forwarded = ProbeForward(ids)
        t0 = time.perf_counter()
        try:
            forwarded.logprobs, forwarded.logits_dtype = trainer_logprobs(
                model, ids, device, forward if callable(forward) else None)
        except Exception as e:  # noqa: BLE001 - raised at the probe, after the commit
            forwarded.error = e
        forwarded.seconds = time.perf_counter() - t0
        outcome = agree(lambda: pending.result() if pending is not None else None)
    return outcome, forwarded


def probe_push(forwarded: ProbeForward, version: int, replicas: ReplicaAdmins | None,
               serving: ServingState | None, tolerance: float | None,
               floor: float | None = None) -> ProbeResult:
    """The pusher's probe step, on every rank, with the trainer's forward
    already run (`commit_with_forward`): rank 0 (the one given `replicas`
    and `serving`, None elsewhere) has every replica compare, and every rank
    gets the worst replica's result or raises `WeightMismatchError`. Without
    a `tolerance`, the default is by precision, and a gap well above `floor`
    passes as drift (`drift_tolerance`)."""
    if forwarded.error is not None:
        raise forwarded.error
    ids, logprobs, logits_dtype = forwarded.token_ids, forwarded.logprobs, forwarded.logits_dtype

    def ask() -> tuple[ProbeResult, str] | None:
        if replicas is None or serving is None:
            return None
        tol = tolerance or default_tolerance(serving.serve_dtype, logits_dtype,
                                             serving.quantization)
        drift = None if tolerance else drift_tolerance(tol, floor)
        req = ProbeRequest(version=version, token_ids=ids, trainer_logprobs=logprobs,
                           tolerance=tol, drift_tolerance=drift)
        results = replicas.each(lambda a, i: a.probe(req, serving.commit_timeout_s))
        if bad := failures(results):
            raise lost_in_probe(version, replicas.urls, results, bad)
        probed = [r for r in results if isinstance(r, ProbeResult)]  # every one: none failed
        # A failed replica first, then the largest gap: the one worth naming.
        worst = max(range(len(probed)), key=lambda i: (not probed[i].passed,
                                                       probed[i].mean_abs_dlogp))
        return probed[worst], replicas.urls[worst]

    result, where = agree(ask)
    if not result.passed:
        raise WeightMismatchError(
            f"version {result.version} is served, but its logprobs on {where} differ from "
            f"the trainer's forward pass: mean |dlogp| {result.mean_abs_dlogp:.3g} (max "
            f"{result.max_abs_dlogp:.3g}) over {result.tokens} probe tokens > tolerance "
            f"{result.tolerance:.3g}; the server marked it suspect")
    if result.drifted and replicas is not None:  # rank 0 says it
        log.warning("version %d: the probe passed (mean |dlogp| %.3g within %.3g) but drifted "
                    "over %.3g, 3x the last passed probe's gap (%.3g) or that + %g: normal as "
                    "a bf16 policy sharpens; a wrong tensor looks the same (prove exactness "
                    "in fp32)", result.version, result.mean_abs_dlogp, result.tolerance,
                    result.drift_tolerance, floor, FLOOR_MARGIN)
    return result
