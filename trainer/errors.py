"""The exceptions a push raises, and the short names they travel under.

Every trainer rank raises the same exception at the same point of a push
(rank_agreement.py): rank 0 hits the error, and the other ranks learn of it as
a `(kind, message)` pair broadcast between processes, so each exception type
here has a kind, and `from_kind` rebuilds it on the far side. The packing
loop (pack/sender.py) reports its errors as such pairs too, never raising,
so that it keeps taking part in every FSDP gather.
"""

from __future__ import annotations


class WeightPushError(RuntimeError):
    """A push failed; the server keeps serving its previous weights.

    `live`: once any replica committed, the version each replica serves now
    (url -> version, None where unknown or none: a replica that failed
    mid-load, or one that cannot be reached); empty before any commit, when
    every replica keeps its previous version."""

    def __init__(self, message: str = "", live: dict[str, int | None] | None = None) -> None:
        super().__init__(message)
        self.live: dict[str, int | None] = dict(live or {})


class NonFiniteWeightsError(WeightPushError):
    """A tensor held NaN or infinity; nothing was sent, the old weights serve."""


class ServerRestartedError(WeightPushError):
    """The server restarted since the last push and serves its checkpoint's
    weights again (raised with `on_server_restart="raise"`)."""


class WeightMismatchError(WeightPushError):
    """The push committed, but the server's logprobs for the probe sequence
    differ from the trainer's own forward pass by more than the tolerance. The
    server marks the version suspect until a later push passes."""


class PartialCommitError(WeightPushError):
    """Every replica prepared the push, but the load failed on some: those
    leave the pool (/ready 503 with the reason) until a push succeeds, while
    the others serve the new version. The message lists every replica, and
    `live` what each serves."""


class ReplicaLostError(WeightPushError):
    """The push committed (`live` says where), then a replica could not be
    reached for a later step (the probe): it froze, died or restarted. The
    others serve the new version; the next push finds out about the lost one
    at its begin."""


class ReplicaError(WeightPushError):
    """One replica's failure in one control call, in one of four words:
    "unreachable" (no connection: down, or the wrong address), "frozen"
    (connected, then silent for the stall bound), "refused" (it answered no,
    with its reason) or "failed" (it answered that a load failed mid-way)."""

    def __init__(self, url: str, phase: str, what: str, detail: str,
                 status: int | None = None) -> None:
        super().__init__(f"{url}: {what} during {phase}: {detail}")
        self.url, self.phase, self.what, self.detail = url, phase, what, detail
        self.status = status  # the HTTP status it answered with, if it answered

    @property
    def reason(self) -> str:
        """The message without the URL, for lists that lead with it."""
        return f"{self.what} during {self.phase}: {self.detail}"


ErrorKind = str  # one of ERROR_KINDS' keys
Error = tuple[ErrorKind, str]  # (kind, message): an error as it crosses ranks

ERROR_KINDS: dict[ErrorKind, type[WeightPushError]] = {
    "push": WeightPushError, "nonfinite": NonFiniteWeightsError,
    "mismatch": WeightMismatchError, "restarted": ServerRestartedError,
    "partial": PartialCommitError, "lost": ReplicaLostError}


def kind_of(e: WeightPushError) -> ErrorKind:
    """The exact type's kind; a subclass defined elsewhere travels as "push"."""
    return next((k for k, t in ERROR_KINDS.items() if type(e) is t), "push")


def from_kind(kind: ErrorKind, message: str, live: dict[str, int | None] | None = None
              ) -> WeightPushError:
    return ERROR_KINDS.get(kind, WeightPushError)(message, live)
