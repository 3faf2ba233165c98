"""POST /weights/probe: is the served model the one the trainer has?

The CRC check of a push (commit.py) proves the bytes arrived intact; it cannot
catch a push that was wrong before it was sent (a bad name mapping, a missed
tied weight, a dtype slip). The probe does: the trainer sends its own
logprobs of a fixed token sequence, the server scores the same sequence under
the served version, and a mean |dlogp| over the tolerance marks that version
suspect (/ready answers 503, responses carry `weight_suspect`) until a push
passes its probe. A gap within the tolerance but over the trainer's
`drift_tolerance` (well above its last passed probe's) passes as drift: logged
and counted, never suspect, since in bf16 a healthy run's gap wanders that far
(trainer/probe.py).
"""

from __future__ import annotations

import logging

import torch

from rollout_sidecar.protocol.schema import ProbeRequest, ProbeResult
from rollout_sidecar.server.engine.engine_api import Scorer
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.errors import BadRequest, PushConflict
from rollout_sidecar.server.metrics.collectors import ServerMetrics

log = logging.getLogger(__name__)


class ProbeScorer:
    def __init__(self, gate: VersionGate, scorer: Scorer, metrics: ServerMetrics) -> None:
        self.gate = gate
        self.scorer = scorer
        self.metrics = metrics
        self.last: ProbeResult | None = None  # reported by /weights/status

    async def probe(self, req: ProbeRequest) -> ProbeResult:
        """Score the trainer's probe under the served version and record the gap."""
        gate = self.gate
        if req.version != gate.version:
            raise PushConflict(f"version {req.version} is not the served one ({gate.version})")
        if len(req.trainer_logprobs) != len(req.token_ids) - 1:
            raise BadRequest(f"trainer_logprobs has {len(req.trainer_logprobs)} values; "
                             f"{len(req.token_ids) - 1} expected (one per token after the "
                             "first)", "trainer_logprobs")
        # float64: the gap and its mean add no rounding of their own.
        served = torch.tensor(await self.scorer.score(req.token_ids, req.version),
                              dtype=torch.float64)
        gap = (served - torch.tensor(req.trainer_logprobs, dtype=torch.float64)).abs()
        mean, worst = gap.mean().item(), gap.max().item()
        passed = bool(mean <= req.tolerance)  # NaN compares False: a NaN gap fails
        drifted = passed and req.drift_tolerance is not None and mean > req.drift_tolerance
        result = ProbeResult(version=req.version, mean_abs_dlogp=mean, max_abs_dlogp=worst,
                             tolerance=req.tolerance, passed=passed, tokens=len(gap),
                             drift_tolerance=req.drift_tolerance, drifted=drifted)
        self.last = result
        self.metrics.probe_gap.labels("mean").set(mean)
        self.metrics.probe_gap.labels("max").set(worst)
        self.metrics.probes.labels("drifted" if drifted else "passed" if passed
                                   else "failed").inc()
        if drifted:
            log.warning("weight_version %d: the trainer's probe passed, but drifted: mean "
                        "|dlogp| %.3g > %.3g (well above the last passed probe's gap; within "
                        "the tolerance %.3g)", req.version, mean, req.drift_tolerance,
                        req.tolerance)
        self._mark(req.version, passed, mean, worst, req.tolerance, len(gap))
        return result

    def _mark(self, version: int, passed: bool, mean: float, worst: float, tolerance: float,
              tokens: int) -> None:
        """Record the verdict on the gate, where /ready and every response read it."""
        gate = self.gate
        if passed:
            gate.suspect.pop(version, None)
        else:
            gate.suspect[version] = (
                f"weight_version {version} is suspect: the trainer's probe found mean "
                f"|dlogp| {mean:.3g} > tolerance {tolerance:.3g}")
            log.error("%s (max %.3g over %d tokens)", gate.suspect[version], worst, tokens)
        self.metrics.suspect.set(int(gate.version in gate.suspect))
