"""Prometheus metrics, in a registry of our own (one per app, so tests can
build several apps in one process without duplicate-metric errors)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats


class TokenLagHistogram:
    """rollout_sidecar_token_version_lag: per sampled token, how many versions
    behind the served one its own was when its response was delivered (0
    unless a `keep` commit ran under its request).

    A collector of our own because a response adds thousands of tokens at
    once: prometheus_client's Histogram observes one value at a time."""

    BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)
    NAME = "rollout_sidecar_token_version_lag"
    HELP = ("Per sampled token: the served version when its response was delivered minus "
            "the version that sampled it.")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)  # the last: over every bucket
        self.total = 0
        registry.register(self)

    def add(self, lag: int, tokens: int) -> None:
        i = next((i for i, b in enumerate(self.BUCKETS) if lag <= b), len(self.BUCKETS))
        self.counts[i] += tokens
        self.total += lag * tokens

    def collect(self) -> Any:
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, self.BUCKETS), "+Inf"], self.counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.NAME, self.HELP, buckets=buckets, sum_value=self.total)


@dataclass
class Acceptance:
    """Drafted and accepted tokens since the last reset (a commit); fed by
    the stat logger below from vLLM's `SpecDecodingStats`."""

    drafted: int = 0
    accepted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted

    def reset(self) -> None:
        with self._lock:
            self.drafted = self.accepted = 0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rollout_sidecar_requests_total", "HTTP requests.", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "rollout_sidecar_request_latency_seconds", "HTTP request latency.", ["route"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r,
        )
        self.generated_tokens = Counter(
            "rollout_sidecar_generated_tokens_total", "Tokens sampled.", registry=r
        )

        self.engine_generation_tokens = Counter(
            "rollout_sidecar_engine_generation_tokens_total",
            "Tokens the engine sampled, delivered or not (work aborted for a client that "
            "left stops adding to it).", registry=r,
        )
        self.prompt_tokens = Counter(
            "rollout_sidecar_prompt_tokens_total", "Prompt tokens processed.", registry=r
        )
        self.lag_restarts = Counter(
            "rollout_sidecar_lag_restarts_total", "Prompts a keep commit restarted from "
            "scratch to keep to their request's max_version_lag.", registry=r
        )
        self.running = Gauge(
            "rollout_sidecar_requests_running", "Sequences the engine is running.", registry=r
        )
        self.waiting = Gauge(
            "rollout_sidecar_requests_waiting",
            "Sequences queued in the engine.", registry=r,
        )
        self.in_flight = Gauge(
            "rollout_sidecar_requests_in_flight", "Requests admitted and not finished.",
            registry=r,
        )
        self.engine_unfinished = Gauge(
            "rollout_sidecar_engine_unfinished_requests",
            "Sequence groups the engine still holds (drops to 0 when cancelled clients' "
            "work is aborted).", registry=r,
        )
        self.gate_waiting = Gauge(
            "rollout_sidecar_requests_gated", "Requests held by a commit or min_weight_version.",
            registry=r,
        )
        self.weight_version = Gauge(
            "rollout_sidecar_weight_version", "Committed weight version.", registry=r
        )
        self.pushes = Counter(
            "rollout_sidecar_weight_pushes_total", "Weight pushes by outcome.", ["outcome"],
            registry=r,
        )
        self.push_seconds = Histogram(
            "rollout_sidecar_weight_push_seconds", "Begin-to-commit time of a push.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300), registry=r,
        )
        self.probe_gap = Gauge(
            "rollout_sidecar_weight_probe_abs_dlogp",
            "Post-push probe: |served - trainer| logprob over the probe tokens, of the "
            "latest probe.", ["stat"], registry=r,
        )
        self.probes = Counter(
            "rollout_sidecar_weight_probes_total", "Post-push probes by outcome.", ["outcome"],
            registry=r,
        )
        self.suspect = Gauge(
            "rollout_sidecar_weight_suspect", "1 while the served version failed its probe.",
            registry=r,
        )
        self.staged_bytes = Gauge(
            "rollout_sidecar_weight_staged_bytes", "Staging buffers every worker held when "
            "the last push ended (the staged copy plus pooled buffers).", registry=r,
        )
        self.commit_seconds = Histogram(
            "rollout_sidecar_weight_commit_seconds", "Pause-load-resume time of a commit.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r,
        )
        self.token_lag = TokenLagHistogram(r)
        # Speculative decoding (vLLM's spec_decode counters, under our names).
        self.draft_tokens = Counter(
            "rollout_sidecar_spec_decode_draft_tokens_total", "Tokens the drafter proposed.",
            registry=r)
        self.accepted_tokens = Counter(
            "rollout_sidecar_spec_decode_accepted_tokens_total", "Proposed tokens the target "
            "accepted.", registry=r)
        self.acceptance = Acceptance()  # since the last commit (engine/drafter.py)

    def drafted(self, drafted: int, accepted: int) -> None:
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.acceptance.add(drafted, accepted)

    def stat_logger_factory(self) -> Any:
        """A vLLM stat-logger class that copies scheduler stats into our gauges."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        metrics = self

        class _SchedulerGauges(StatLoggerBase):
            def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: SchedulerStats | None,
                       iteration_stats: IterationStats | None,
                       mm_cache_stats: MultiModalCacheStats | None = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    metrics.running.set(scheduler_stats.num_running_reqs)
                    metrics.waiting.set(scheduler_stats.num_waiting_reqs)
                    spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                    if spec is not None:
                        metrics.drafted(spec.num_draft_tokens, spec.num_accepted_tokens)
                if iteration_stats is not None:
                    metrics.engine_generation_tokens.inc(iteration_stats.num_generation_tokens)

            def log_engine_initialized(self) -> None:
                pass

        return _SchedulerGauges
