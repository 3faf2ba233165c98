"""One push across every replica, all or nothing: begin, prepare, commit, abort.

Each replica begins (checks the manifest, allocates staging) and receives the
buckets; then `prepare` (phase 1: every bucket arrived and passed its CRC,
nothing is loaded yet) runs on all of them, and only if all of them prepared
does `commit` (phase 2: load and serve) run anywhere. A replica that refuses
before the commit makes this abort the push everywhere, so the previous
version keeps serving on every replica and no response ever carries a version
another replica refused. Once every replica prepared, a commit that fails on
some cannot be taken back on the others: `PartialCommitError` names each.

Every error names each replica and what happened to it (unreachable,
frozen, refused, failed: admin_client.py). Once any replica committed, the error's
`live` says which version each one serves.

Rank 0 alone runs these; the pusher shares the outcome with the other ranks
(rank_agreement.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_sidecar.protocol.schema import CommitPolicy, CommitResponse, PrepareResponse
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins, failures
from rollout_sidecar.trainer.errors import PartialCommitError, ReplicaError, WeightPushError
from rollout_sidecar.trainer.push_result import ReplicaOutcome, describe
from rollout_sidecar.trainer.transport.base import Transport


class TwoPhaseCommit:
    """The replica protocol of one pusher; `push_ids` are each replica's id
    of the push, in replica order (None: that replica holds no push)."""

    def __init__(self, replicas: ReplicaAdmins, transport: Transport) -> None:
        self.replicas = replicas
        self.transport = transport

    def begin(self, version: int, manifest: list[dict], commit_policy: CommitPolicy | None,
              budget_s: float, delta_base: int | None = None,
              adapter: dict | None = None, check: str = "crc32") -> list[str]:
        """Begin on every replica; if any fails, abort on the others and
        raise before a byte is sent."""
        rs, tr = self.replicas, self.transport
        begun = rs.each(lambda a, i: a.begin(version, tr.name, manifest, tr.connection_id,
                                             commit_policy, budget_s, delta_base, adapter,
                                             check))
        if bad := failures(begun):
            ids = [None if isinstance(r, Exception) else r.push_id for r in begun]
            self.abort(ids, "another replica failed the push at begin")
            raise WeightPushError(f"begin failed on {len(bad)} of {len(begun)} replicas, "
                                  "nothing sent, every replica keeps its version: "
                                  + "; ".join(_error(rs.urls[i], begun[i]) for i in bad))
        return [r.push_id for r in begun]  # type: ignore[union-attr]

    def abort(self, push_ids: Sequence[str | None], reason: str) -> list[str]:
        """Abort on every replica that holds the push (a failed one already
        ended it); the data-plane group is out of step with at least one of
        them, so it is dropped too. Returns what each replica answered."""
        # The servers first, so each records the trainer's reason; dropping
        # our side of the group first would fail their receives with a
        # connection error that races the abort.
        results = self.replicas.each(lambda a, i: a.abort(pid, reason)
                                     if (pid := push_ids[i]) is not None else None)
        self.transport.reset()
        return [_error(u, r) if isinstance(r, Exception) else f"{u}: aborted"
                for u, r in zip(self.replicas.urls, results, strict=True)]

    def abort_after_send_error(self, push_ids: Sequence[str], error: str) -> str:
        """A bucket failed to send (the data plane timed out or broke): abort
        everywhere, and say what each replica answered, so a frozen or dead
        one is named rather than only the sender's socket error."""
        answers = self.abort(push_ids, error)
        return f"{error}; every replica keeps its version: " + "; ".join(answers)

    def prepare(self, push_ids: Sequence[str], checksums: list[int], timeout_s: float,
                serving: Sequence[int], macs: list[str] | None = None
                ) -> list[PrepareResponse]:
        """Phase 1 on every replica: each has every bucket, CRC-checked (and,
        with `macs`, tag-checked). If any refuses, abort everywhere and raise;
        `serving`: the versions the replicas keep serving then (for the
        message)."""
        rs = self.replicas
        tags = {"macs": macs} if macs is not None else {}
        prepared = rs.each(lambda a, i: a.prepare(push_ids[i], checksums, timeout_s, **tags))
        if bad := failures(prepared):
            # A replica whose prepare failed has ended the push itself.
            self.abort([None if i in bad else p for i, p in enumerate(push_ids)],
                       f"another replica failed the push: {prepared[bad[0]]}")
            versions = ", ".join(str(v) for v in serving)
            raise WeightPushError(
                f"push failed before the commit, on {len(bad)} of {len(push_ids)} replicas, "
                f"so no replica published it (versions {versions} keep serving): "
                + "; ".join(_error(rs.urls[i], prepared[i]) for i in bad))
        return prepared  # type: ignore[return-value]

    def commit(self, push_ids: Sequence[str], timeout_s: float,
               checksums: list[int] | None = None, macs: list[str] | None = None
               ) -> tuple[list[CommitResponse], list[ReplicaOutcome]]:
        """Phase 2 on every replica: load and serve. Raises unless all did.
        With `checksums` (one replica: nothing to hold the others to) both
        phases go in one call, one round trip fewer."""
        rs = self.replicas
        committed = rs.each(lambda a, i: a.commit(push_ids[i], checksums, timeout_s, macs))
        outcomes = [ReplicaOutcome(u, "failed", None, _reason(r)) if isinstance(r, Exception)
                    else ReplicaOutcome(u, "committed", r.weight_version, None, r.timings)
                    for u, r in zip(rs.urls, committed, strict=True)]
        if bad := failures(committed):
            # A failed push drops the servers' side of the group: drop ours to match.
            self.transport.reset()
            if len(bad) == len(committed):  # e.g. a load refused before touching the model
                raise WeightPushError("push failed at the commit on every replica, nothing "
                                      f"published: {describe(outcomes)}")
            live = {o.url: o.weight_version for o in outcomes}
            raise PartialCommitError(
                "every replica prepared the push, but the commit failed on some (a failed load "
                "answers 503 until a push succeeds; a frozen replica serves what it held): "
                f"{describe(outcomes)}; live: {live_versions(live)}", live)
        return committed, outcomes  # type: ignore[return-value]


def live_versions(live: dict[str, int | None]) -> str:
    """`url v7, url unknown`: which version each replica serves now."""
    return ", ".join(f"{u} v{v}" if v is not None else f"{u} unknown" for u, v in live.items())


def _reason(error: Exception) -> str:
    return error.reason if isinstance(error, ReplicaError) else str(error)


def _error(url: str, error: object) -> str:
    return str(error) if isinstance(error, ReplicaError) else f"{url}: {error}"
