"""What each op carries: one typed request per `WorkerOp`, and per `SideOp`
that carries anything (CONNECT's is vLLM's init info, StagedInitInfo), instead
of one record of optional fields. The API process builds them (service.py,
commit.py) and `ops.send` flattens one into the worker method's payload; the
worker builds the same class back from it (`parse`, worker_calls.py) and the
transfer engine dispatches on its type. FINISH and ABORT carry nothing and
never reach the engine's `update_weights` (worker_calls.py ends the session).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from rollout_sidecar.protocol.schema import BucketManifest
from rollout_sidecar.protocol.schema import Check as BucketCheck
from rollout_sidecar.server.weights.ops import SideOp, WorkerOp


@dataclass(frozen=True)
class Open:
    """Opens a push: lays out staging for its buckets and starts the receive
    its transport names (protocol/transports.py: the row's receive path)."""

    op: ClassVar[WorkerOp] = WorkerOp.OPEN
    transport: str
    manifest: list[dict]  # BucketManifest dumps, validated once already, at begin
    version: int
    delta_base: int | None = None  # a delta push's base (patching.py)
    adapter: dict | None = None  # a LoRA adapter push's AdapterSpec
    check: BucketCheck = "crc32"  # what each bucket's checksum is (bucket_check.py)

    def buckets(self) -> list[BucketManifest]:
        return [BucketManifest.model_validate(b) for b in self.manifest]

    @property
    def small(self) -> bool:
        """Patches (a delta's, an adapter's): small, and applied on the host."""
        return self.delta_base is not None or self.adapter is not None

    @property
    def adapter_only(self) -> bool:
        """An adapter over the weights already loaded: the staged copy stays."""
        return self.adapter is not None and self.adapter.get("base_version") is not None


@dataclass(frozen=True)
class Stage:
    """One bucket's bytes, from an HTTP body."""

    op: ClassVar[WorkerOp] = WorkerOp.STAGE
    bucket: int
    data: bytes | bytearray


@dataclass(frozen=True)
class Check:
    """Phase 1: every bucket arrived (waiting at most `timeout_s`) and matches
    its CRC and, with a connection secret, its tag over `version`."""

    op: ClassVar[WorkerOp] = WorkerOp.CHECK
    checksums: list[int]
    timeout_s: float
    macs: list[str] | None = None
    version: int | None = None


@dataclass(frozen=True)
class Patch:
    """A delta: write its patches into the staged copy (the model untouched)."""

    op: ClassVar[WorkerOp] = WorkerOp.PATCH


@dataclass(frozen=True)
class Load:
    """The commit: load the staged push, all of it or none of it. An adapter
    push's load names its fresh vLLM LoRA id and the ids kept loaded."""

    op: ClassVar[WorkerOp] = WorkerOp.LOAD
    lora_id: int | None = None
    keep_ids: list[int] | None = None


@dataclass(frozen=True)
class Relabel:
    """An unchanged push: the staged copy of `base` is `version` too."""

    op: ClassVar[SideOp] = SideOp.RELABEL
    base: int
    version: int


@dataclass(frozen=True)
class Layout:
    """Every worker's role in the staging layout (staging_layout.py), keyed
    by its rank as a string (it crosses vLLM's RPC), and the server's boot id
    (worker/host_share.py)."""

    op: ClassVar[SideOp] = SideOp.LAYOUT
    roles: dict[str, dict]
    boot_id: str


@dataclass(frozen=True)
class Read:
    """A replica catching up from this one (catch_up.py): the staged copy's
    version and manifest (`bucket` None), or one bucket's bytes. Answered by
    worker rank 0, which holds the whole copy (or, sharing one per host, leads)."""

    op: ClassVar[SideOp] = SideOp.READ
    bucket: int | None = None


WorkerRequest = Open | Stage | Check | Patch | Load
SideRequest = Relabel | Layout | Read
Request = WorkerRequest | SideRequest

REQUESTS: dict[WorkerOp | SideOp, type[Request]] = {
    cls.op: cls for cls in (Open, Stage, Check, Patch, Load, Relabel, Layout,
                            Read)}


def payload(request: Request) -> dict[str, Any]:
    """The request as the worker method's payload (shallow: a bucket's bytes
    are not copied)."""
    return {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}


def parse(op: WorkerOp | SideOp, fields: dict[str, Any]) -> Request:
    """The worker's side: the typed request of `op`; a ValueError names what
    does not fit."""
    cls = REQUESTS.get(op)
    if cls is None:
        raise ValueError(f"{op.value} carries no request")
    try:
        return cls(**fields)
    except TypeError as e:
        raise ValueError(f"{op.value}: {e}") from None


R = TypeVar("R", bound=Request)


def parse_as(cls: type[R], fields: dict[str, Any]) -> R:
    """`parse`, for a caller that dispatched on the op already."""
    request = parse(cls.op, fields)
    if not isinstance(request, cls):
        raise ValueError(f"{cls.op.value}: not a {cls.__name__}")
    return request
