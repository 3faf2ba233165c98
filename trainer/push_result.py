"""What a push returns: the version every replica serves now, what travelled,
how long each step took, each replica's part, and the probe's verdict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rollout_sidecar.protocol.schema import (
    BucketManifest,
    CommitResponse,
    PrepareResponse,
    ProbeResult,
)

# What a replica did with one push. Only the commit produces outcomes: a push
# that fails before it raises instead, and no replica has published anything.
Outcome = Literal["committed", "failed"]

# What a push carries (push_plan.py says how each is decided).
Encoding = Literal["dense", "delta", "adapter", "adapter+base"]


@dataclass
class ReplicaOutcome:
    """One replica's part in one push."""

    url: str
    outcome: Outcome
    weight_version: int | None = None  # what it serves after the push
    reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class PushResult:
    """Timings (seconds): `open_s` (the replicas' status, connect), `begin_s`
    (from the start: open, a delta's diff, begin), `diff_s` (a delta: every
    rank's diff and the plan), `gather_send_s`, `commit_s` (the commit
    as rank 0 waited for it, with the probe's forward run meanwhile),
    `probe_forward_s` (that forward), `probe_s` (the probe after the commit:
    the replicas' scoring), `total_s` on the trainer; `server_check_s` (the
    slowest replica's check: receive joined, CRCs checked) and `server_<key>`
    for each key of the commit's timings (`server_commit_s`: drain + load +
    publish, and its steps: `drain_s`, `pause_s`, `patch_s`, `load_s`,
    `finish_s`, `label_s`, `publish_s`, `resume_s`), the slowest replica's each."""

    version: int
    nbytes: int
    buckets: int
    timings: dict[str, float] = field(default_factory=dict)
    probe: ProbeResult | None = None
    commit_policy: str | None = None
    server_restarted: bool = False  # a server had restarted since the previous push
    absent: dict[str, str] = field(default_factory=dict)
    """Listed replicas this push went on without, and why (joining, away,
    leaving: control/serving_state.py); `replicas` are those it reached."""
    replicas: list[ReplicaOutcome] = field(default_factory=list)
    encoding: Encoding = "dense"
    """"delta": only changes travelled (`nbytes` is what went on the wire);
    "adapter": a LoRA adapter alone; "adapter+base": the adapter with the
    base weights it applies to (a replica's first adapter push)."""
    adapter_reason: str | None = None  # why a PEFT model went merged
    delta_base: int | None = None  # the version a delta was applied to
    delta_reason: str | None = None  # why a push with delta on went dense
    changed: int | None = None  # a delta: changed elements sent as patches (not dense ones)
    senders: int = 1  # trainer ranks that sent bytes of this push (a bucket or more each)
    senders_reason: str | None = None  # why fewer than every rank, where each was asked to send
    route: str = "broadcast"  # how the buckets reached the replicas (Transport.route)
    own_rows: bool = False  # every rank sent its own FSDP2 rows, no gather (own_rows.py)
    own_rows_reason: str | None = None  # why they were gathered, where several ranks sent
    check: str = "crc32"  # each bucket's integrity check (bucket_check.py)
    elements: int | None = None  # a delta: elements of the whole model
    held_bytes: int | None = None
    """A push from named tensors: the most bytes held at once because they
    came before their bucket's turn (the first push, whose order is a guess;
    0 once the order is learned: gather/named_tensors.py)."""
    drafter: str | None = None
    """Replicas with a speculative drafter: "synced" (this push loaded it with
    the target on every one) or "frozen" (it kept older weights on some:
    acceptance falls, output stays exact); None without a drafter."""

    @property
    def probe_gap(self) -> float | None:
        """Mean |served - trainer| logprob over the probe tokens, if probed."""
        return self.probe.mean_abs_dlogp if self.probe else None

    @classmethod
    def committed(cls, buckets: Sequence[BucketManifest], prepared: Sequence[PrepareResponse],
                  committed: Sequence[CommitResponse], outcomes: list[ReplicaOutcome],
                  server_restarted: bool) -> PushResult:
        """The result of a push every replica committed."""
        first = committed[0]
        return cls(version=first.weight_version, nbytes=sum(b.nbytes for b in buckets),
                   buckets=len(buckets), commit_policy=first.commit_policy,
                   server_restarted=server_restarted, replicas=outcomes,
                   timings=server_timings(prepared, outcomes),
                   drafter=drafter_outcome(committed))


def drafter_outcome(committed: Sequence[CommitResponse]) -> str | None:
    """Frozen if any replica's drafter is; None if none has one."""
    outcomes = {c.drafter for c in committed} - {None}
    return None if not outcomes else "frozen" if "frozen" in outcomes else "synced"


def server_timings(prepared: Sequence[PrepareResponse], outcomes: Sequence[ReplicaOutcome]
                   ) -> dict[str, float]:
    """The slowest replica's time for each server step, as `server_<key>`."""
    commits = [o.timings for o in outcomes]
    keys = dict.fromkeys(k for t in commits for k in t)
    out = {f"server_{k}": max(t.get(k, 0.0) for t in commits) for k in keys}
    # The commit of a prepared push checks nothing; the prepare did. (One
    # replica commits unprepared: its commit's check_s is the check.)
    if prepared:
        out["server_check_s"] = max(p.timings.get("check_s", 0.0) for p in prepared)
    return out


def describe(outcomes: Sequence[ReplicaOutcome]) -> str:
    return "; ".join(f"{o.url}: {o.outcome}" + (f" ({o.reason})" if o.reason else "")
                     for o in outcomes)
