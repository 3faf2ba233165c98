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
    """A push failed; the server keeps serving its previous weights."""


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
    the others serve the new version. The message lists every replica."""


ErrorKind = str  # one of ERROR_KINDS' keys
Error = tuple[ErrorKind, str]  # (kind, message): an error as it crosses ranks

ERROR_KINDS: dict[ErrorKind, type[WeightPushError]] = {
    "push": WeightPushError, "nonfinite": NonFiniteWeightsError,
    "mismatch": WeightMismatchError, "restarted": ServerRestartedError,
    "partial": PartialCommitError}


def kind_of(e: WeightPushError) -> ErrorKind:
    """The exact type's kind; a subclass defined elsewhere travels as "push"."""
    return next((k for k, t in ERROR_KINDS.items() if type(e) is t), "push")


def from_kind(kind: ErrorKind, message: str) -> WeightPushError:
    return ERROR_KINDS.get(kind, WeightPushError)(message)
