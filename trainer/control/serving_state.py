"""What the replicas serve, read at the start of every push, and whether one
push can fit them all.

Each push begins by reading every replica's `/weights/status`: its boot id
(a replica that restarted serves its checkpoint again, which the caller
wants to know), its dtype (one bucket layout for all, so one dtype), and the
limits the push must respect (deadline, drain, probe length). The tensor
index (`/weights/index`: what a push must carry, in which wire dtype) is read
once and kept: it changes only when a replica restarts or the set of
replicas does.

A fleet changes while it trains (docs/replicas.md, "A fleet that changes"):
a listed replica that refuses connections is joining (never seen: still
starting) or away (seen before: restarting, or gone and still listed), and
one that answers 503 is leaving
(draining: `rollout-sidecar drain`, or SIGTERM). Each sits this push out:
the push goes on to the others on a data-plane group without it, and
`PushResult.absent` names it with why. A joiner catches up from a peer
(`serve --peers`); a restarted one is noticed by its boot id once it answers.
Any other failure (a frozen replica, a refusal) still fails the push: those
are faults, and the operator must hear of them. With
`on_absent_replica="raise"` an absent replica fails the push too.
"""

from __future__ import annotations

import logging

import torch

from rollout_sidecar.protocol.data_plane.wire_format import torch_dtype
from rollout_sidecar.protocol.schema import WeightIndex, WeightStatus
from rollout_sidecar.trainer.control.replica_admins import ReplicaAdmins, failed_on
from rollout_sidecar.trainer.errors import ReplicaError, ServerRestartedError, WeightPushError

log = logging.getLogger(__name__)


class ServingState:
    def __init__(self) -> None:
        self.statuses: list[WeightStatus] = []  # as of this push's begin, in replica order
        self.index: WeightIndex | None = None
        self._indexed: set[str] = set()  # the replicas `index` was checked against
        self._boot_ids: dict[str, str] = {}  # every replica seen, as last seen

    def read(self, replicas: ReplicaAdmins, version: int, on_server_restart: str = "repush",
             on_absent_replica: str = "skip") -> bool:
        """Read every replica's status (and the index when it may have
        changed), leaving out those joining or leaving (module docstring);
        True if a replica restarted since the previous push (with
        `on_server_restart="raise"`, raise `ServerRestartedError` instead)."""
        if replicas.refresh():  # a dns+ name resolved to other pods: a new group, a new index
            self.index = None
        self.statuses = statuses = self._answers(replicas, on_absent_replica)
        urls = replicas.urls
        restarted = [u for u, st in zip(urls, statuses, strict=True)
                     if u in self._boot_ids and self._boot_ids[u] != st.boot_id]
        if restarted:
            msg = (f"{', '.join(restarted)} restarted and serve their checkpoint's weights "
                   "again")
            if on_server_restart == "raise":
                raise ServerRestartedError(msg)
            log.warning("%s; pushing version %d restores the trained weights", msg, version)
        # An absent replica keeps its last boot id: a restart shows once it answers.
        self._boot_ids.update((u, st.boot_id) for u, st in zip(urls, statuses, strict=True))
        if len({st.dtype for st in statuses}) > 1:
            raise WeightPushError("replicas serve different dtypes: " + ", ".join(
                f"{u}: {st.dtype}" for u, st in zip(urls, statuses, strict=True)))
        if self.index is None or restarted or not self._indexed.issuperset(urls):
            self.index = same_index(replicas.all(lambda a, i: a.index(), "index"), urls)
            self._indexed = set(urls)
        return bool(restarted)

    def _answers(self, replicas: ReplicaAdmins, on_absent_replica: str) -> list[WeightStatus]:
        """The status of every replica taking part; the absent left out."""
        results = replicas.each(lambda a, i: a.status())
        absent: dict[str, str] = {}
        errors: list[tuple[str, Exception]] = []
        for url, r in zip(replicas.urls, results, strict=True):
            if isinstance(r, Exception):
                why = absence(r, url in self._boot_ids)
                if why is None or on_absent_replica == "raise":
                    errors.append((url, r))
                else:
                    absent[url] = why
        if errors:
            raise failed_on("status", errors, len(results))
        if len(absent) == len(results):
            raise WeightPushError("no replica can take this push: " + "; ".join(
                f"{u}: {why}" for u, why in absent.items()))
        if absent:
            log.info("this push goes on without %s", "; ".join(
                f"{u} ({why})" for u, why in absent.items()))
            replicas.leave_out(absent)
        return [r for r in results if not isinstance(r, Exception)]

    @property
    def serve_dtype(self) -> torch.dtype:
        return torch_dtype(self.statuses[0].dtype)

    @property
    def quantization(self) -> str | None:
        """The replicas' online quantization scheme (each re-quantizes what
        it is pushed), None, or "mixed" where they differ (the probe then
        holds them all to a quantized server's tolerance)."""
        schemes = {st.quantization for st in self.statuses}
        return next(iter(schemes)) if len(schemes) == 1 else "mixed"

    @property
    def wire_dtypes(self) -> dict[str, torch.dtype]:
        """Each tensor's dtype on the wire: what the served checkpoint holds."""
        assert self.index is not None
        return {n: torch_dtype(t.dtype) for n, t in self.index.tensors.items()}

    def lacks(self, capability: str) -> str | None:
        """Which replica does not offer `capability` (`WeightStatus.capabilities`),
        said for a `PushResult` reason; None when every one does."""
        old = [i for i, st in enumerate(self.statuses) if capability not in st.capabilities]
        return f"replica {old[0]} does not offer '{capability}' (an older server)" \
            if old else None

    @property
    def versions(self) -> list[int]:
        return [st.weight_version for st in self.statuses]

    @property
    def commit_timeout_s(self) -> float:
        """How long a prepare or commit may take: each server may wait for
        in-flight requests, then load; bound by the slowest one's numbers."""
        s = max(self.statuses, key=lambda st: st.push_timeout_s + st.commit_drain_s)
        return s.push_timeout_s + s.commit_drain_s + 60

    @property
    def vocab_size(self) -> int:
        return self.statuses[0].vocab_size

    @property
    def max_model_len(self) -> int:
        return min(s.max_model_len for s in self.statuses)


def absence(error: Exception, seen: bool) -> str | None:
    """Why a replica whose status call failed sits this push out (module
    docstring), or None: the failure fails the push."""
    if not isinstance(error, ReplicaError):
        return None
    if error.what == "unreachable":
        return ("away: it answered before and refuses connections now (restarting, or "
                "gone)" if seen else "joining: it does not answer yet")
    if error.status == 503:  # draining before it stops: the front door says so
        return f"leaving: {error.detail}"
    return None


def same_index(indexes: list[WeightIndex], urls: list[str]) -> WeightIndex:
    """Every replica must serve the same tensors, or one push cannot fit all."""
    first = indexes[0].tensors
    for url, idx in zip(urls[1:], indexes[1:], strict=True):
        if idx.tensors != first:
            diff = sorted(set(first) ^ set(idx.tensors)) or sorted(
                n for n in first if first[n] != idx.tensors[n])
            raise WeightPushError(f"{url} serves a different model than {urls[0]}: "
                                  f"tensors differ ({', '.join(diff[:5])})")
    return indexes[0]
