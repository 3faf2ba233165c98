"""Wire types of the push protocol's control plane: the /weights/* requests
and answers of a push (pydantic only). What a push carries, its manifest,
is manifest_api.py; what a server says of its weights, status_api.py.

Vocabulary: *allocate* lays out staging for a manifest; *check* is the CRC and
coverage check of what arrived; *prepare* is phase 1 of a commit across
replicas (every bucket arrived and passed its check); *commit* loads and
serves; *probe* compares the served logprobs with the trainer's forward pass.
The bytes travel over torch.distributed (gloo/NCCL, see bucket_group.py) or,
with transport "http", as bodies of PUT /weights/bucket/{index}.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from rollout_sidecar.protocol.schema.adapter_api import AdapterSpec
from rollout_sidecar.protocol.schema.drafter_api import DraftOutcome
from rollout_sidecar.protocol.schema.fields import (
    Bool,
    CommitPolicy,
    Float,
    Int,
    Port,
    Positive,
    ReplyModel,
    Seconds,
    StrictModel,
    not_null,
)
from rollout_sidecar.protocol.schema.manifest_api import BucketManifest
from rollout_sidecar.protocol.transports import TRANSPORTS

# The names of protocol/transports.py's table: a new row is a new wire name.
if TYPE_CHECKING:  # a checker cannot read a Literal built from the table
    Transport = str
else:
    Transport = Literal[tuple(TRANSPORTS)]
# A bucket's integrity check (protocol/data_plane/bucket_check.py computes them).
Check = Literal["crc32", "sum64"]
# What a server takes beyond the first protocol (`WeightStatus.capabilities`).
SENDERS = "senders"  # buckets from several trainer ranks (`ConnectRequest.senders`)
CHECK_SUM64 = "check:sum64"  # `BeginRequest.check` "sum64"
# Several senders over NCCL too (relayed in fused steps, data_plane/chain_steps.py).
SENDERS_NCCL = "senders:nccl"
# A split tensor's chunks in any order, anywhere in the manifest: each trainer
# rank sends the rows of its own FSDP2 shards (trainer/gather/own_rows.py).
CHUNKS_INTERLEAVED = "chunks:interleaved"
# gloo: each bucket enters the chain at a replica of its own (`ConnectRequest.ring_starts`).
CHAIN_RING = "chain:ring"
# gloo's chain: a bucket holding a chunk comes slot by slot (`ConnectRequest.slot_pieces`).
PIECES_SLOTS = "pieces:slots"
CAPABILITIES = (SENDERS, CHECK_SUM64, SENDERS_NCCL, CHUNKS_INTERLEAVED, CHAIN_RING,
                PIECES_SLOTS)
# What a server requires of a connect (`WeightStatus.requires`; server/config.py).
REQUIRES_SECRET = "data_plane_secret"  # a `ConnectRequest.secret`
REQUIRES_BUCKET_MACS = "bucket_macs"  # `ConnectRequest.bucket_macs`: every bucket tagged
Mac = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]  # bucket_mac.py's tag
_HEX_SECRET = re.compile(r"(?:[0-9a-fA-F]{2})+")


def _hex_secret_schema(schema: dict) -> None:
    not_null(schema)
    schema["pattern"] = f"^{_HEX_SECRET.pattern}$"  # what the validator enforces


class ConnectRequest(StrictModel):
    connection_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: Float = Field(300.0, gt=0, le=3600, description="How long to wait for the "
                             "trainer to join the group (capped by the server).")
    # The bounds inside the optional type, so the OpenAPI schema carries them
    # (on the Field they vanish from the `anyOf`; schemathesis sent 0.0).
    op_timeout_s: Seconds | None = Field(
        None, description="Once the group formed: how long one piece of a "
        "transfer may not move before the transfer fails (the trainer's stall bound). "
        "Default: timeout_s.")
    takeover: Bool = Field(False, description="Replace another trainer's connection even "
                           "within its lease (that trainer's next begin is refused).")
    trainer_id: str | None = Field(
        None, max_length=128, description="The pusher's id: the trainer that owns the data "
        "plane may replace its own connection within the lease (to bring a restarted replica "
        "back into the group).")
    world_size: Int = Field(2, ge=2, le=65536, description="Ranks in the group: the trainer's "
                            "`senders` plus every worker of every replica.")
    rank_offset: Int = Field(1, ge=1, description="This server's first worker rank; its "
                             "workers take rank_offset .. rank_offset + data_plane_ranks - 1.")
    senders: Int = Field(1, ge=1, le=65536, description="Trainer ranks in the group, ranks "
                         "0 .. senders - 1: each bucket comes from the one its manifest names "
                         "(`BucketManifest.sender`). More than one needs `fanout` chain and "
                         "the capability `senders` (`WeightStatus.capabilities`).")
    store_host: str | None = Field(None, max_length=255, description="Rendezvous store host "
                                   "(another replica's data plane); default: this server's.")
    store_port: Port | None = Field(None, description="Rendezvous store port; default: this "
                                    "server's data-plane port.")
    fanout: Literal["broadcast", "chain"] = Field(
        "broadcast", description="How each bucket reaches every rank: one broadcast, or "
        "(gloo) a chain that relays it piece by piece from rank to rank, so rank 0 sends it "
        "once however many replicas listen.")
    ring_starts: list[Int] | None = Field(
        None, max_length=65536, json_schema_extra=not_null,
        description="gloo chains with several replicas: the ranks where buckets enter the "
        "chain, each replica's first (increasing). Bucket k enters at ring_starts[k % n] "
        "and goes round every receiver, rank `senders` .. world_size - 1 and back, so each "
        "replica's link relays (n - 1) / n of the push instead of the first one relaying all "
        "of it (protocol/data_plane/ring_route.py). Absent: every bucket enters at rank "
        "`senders`. Needs the capability `chain:ring`.")
    slot_pieces: Bool = Field(
        False, description="gloo chains: a bucket that holds a chunk of a split tensor "
        "(`TensorSlot.chunk_offset`) travels as one piece per slot (at most 16 MiB each) and "
        "one per gap between slots, in byte order, so each piece lands in its tensor's place "
        "with no receive buffer (protocol/data_plane/bucket_pieces.py). Other buckets go "
        "in 16 MiB pieces. Needs the capability `pieces:slots`.")
    secret: SecretStr | None = Field(
        None, min_length=32, max_length=128, json_schema_extra=_hex_secret_schema,
        description="This connection's data-plane key, hex (the trainer draws 32 random bytes "
        "per connection). With it, the rendezvous values are signed and, with `bucket_macs`, "
        "every bucket's keyed BLAKE2b tag must come with the prepare (`macs`). Never logged "
        "or echoed. Absent: an older trainer, unsigned rendezvous, CRC-32 only.")
    bucket_macs: Bool = Field(
        True, description="With a `secret`: this connection's prepares carry every bucket's "
        "tag (`macs`), checked before anything loads; a prepare without them is refused. "
        "False: the secret signs the rendezvous only (bytes get CRC-32).")

    @field_validator("secret")
    @classmethod
    def _hex_secret(cls, v: SecretStr | None) -> SecretStr | None:
        # The schema's pattern, enforced here (SecretStr takes no pattern);
        # the message never quotes the value.
        if v is not None and not _HEX_SECRET.fullmatch(v.get_secret_value()):
            raise ValueError("must be an even number of hex digits")
        return v


class ConnectResponse(BaseModel):
    connection_id: str
    backend: str


class DisconnectRequest(StrictModel):
    """`POST /weights/disconnect`: a trainer done pushing (`WeightPusher.close()`)
    releases the data plane at once instead of leaving its lease to run out."""

    connection_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    trainer_id: str | None = Field(
        None, max_length=128, description="The pusher's id, as sent to /weights/connect: "
        "checked against the owner's when both are known.")


class DisconnectResponse(BaseModel):
    connection_id: str
    released: bool = Field(description="True: this call released the data plane; false: "
                           "the connection was already released (an earlier disconnect, or "
                           "a failed push that dropped it).")
    connected: str | None = Field(description="Connection id that holds the data plane now.")


class BeginRequest(StrictModel):
    version: Int = Field(description="Weight version this push becomes; must increase.")
    transport: Transport = "gloo"
    connection_id: str | None = Field(
        None, description="gloo/nccl: the connection that carries the data; it must own the "
        "data plane.")
    commit_policy: CommitPolicy | None = Field(
        None, description="In-flight requests at this push's commit; default: the server's.")
    buckets: list[BucketManifest] = Field(
        description="The buckets, in order. Empty only in a delta push (`delta_base`) of "
        "weights that did not change since that base: nothing moves, and the commit "
        "publishes the weights this replica holds as `version` without loading them.")
    delta_base: Int | None = Field(
        None, json_schema_extra=not_null,
        description="A delta push: every slot carries a `patch` against this version, which "
        "must be the one this replica's staged copy holds (`WeightStatus.delta_base`). "
        "Absent: a dense push, every slot the whole tensor.")
    adapter: AdapterSpec | None = Field(
        None, json_schema_extra=not_null,
        description="A LoRA adapter push (adapter_api.py): the slots are adapter factors, "
        "with every checkpoint tensor too when `adapter.base_version` is absent. Needs a "
        "server started with --enable-lora (`WeightStatus.lora`).")
    check: Check = Field(
        "crc32", description="What each bucket's checksum is (protocol/data_plane/"
        "bucket_check.py): `crc32` of the bytes (every trainer; the default), or `sum64`, "
        "computed where the bucket lives, in GPU memory for NCCL (gloo/NCCL only; the "
        "capability `check:sum64`).")

    @property
    def adapter_only(self) -> bool:
        """LoRA factors over the full weights this replica holds: no base
        weight moves, and no running request changes version."""
        return self.adapter is not None and not self.adapter.with_base

    @property
    def unchanged(self) -> bool:
        """A delta with nothing in it: the weights of `delta_base`, relabelled."""
        return self.delta_base is not None and not self.buckets


class BeginResponse(BaseModel):
    push_id: str
    deadline_s: float = Field(description="The push must commit within this; the server ends "
                              "it after.")
    commit_policy: CommitPolicy


class PrepareRequest(StrictModel):
    """Phase 1 of a commit across replicas: every bucket arrived and matches."""

    push_id: str
    checksums: list[Int] = Field(description="Each bucket's check value (the push's `check`: "
                                 "CRC-32 by default), in order.")
    macs: list[Mac] | None = Field(
        None, json_schema_extra=not_null, description="Keyed BLAKE2b-128 of each bucket "
        "(hex, in order), bound to the connection, the version and the bucket's index: "
        "required when the connection was made with a `secret`.")


class PrepareResponse(BaseModel):
    push_id: str
    deadline_s: float = Field(description="Commit (phase 2) or abort within this; the server "
                              "aborts the prepared push after.")
    timings: dict[str, float]


class CommitRequest(StrictModel):
    push_id: str
    checksums: list[Int] | None = Field(
        None, description="CRC-32 of each bucket's bytes, in order; needed unless the push "
        "was prepared (POST /weights/prepare), which checked them already.")
    macs: list[Mac] | None = Field(
        None, json_schema_extra=not_null, description="As in the prepare: needed with "
        "`checksums` when the connection has a `secret`.")


class CommitResponse(BaseModel):
    weight_version: int
    push_id: str
    commit_policy: CommitPolicy = Field(description="The policy the commit used: `abort` if "
                                        "a `wait` drain ran past commit_drain_s.")
    timings: dict[str, float]
    drafter: DraftOutcome | None = Field(
        None, description="A server with a speculative drafter: `synced` if this push "
        "loaded the drafter with the target, `frozen` if it kept its weights "
        "(drafter_api.py). Null without a drafter.")


class AbortRequest(StrictModel):
    push_id: str
    reason: str = "aborted by trainer"


class LastPush(BaseModel):
    version: int
    outcome: Literal["committed", "failed", "aborted"]
    reason: str | None = None
    push_id: str | None = None


class ProbeRequest(StrictModel):
    """`POST /weights/probe`: the trainer's logprobs of a fixed token sequence,
    computed by its own forward pass right after pushing `version`."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    version: Int = Field(description="The version just committed; must be the served one.")
    token_ids: list[Int] = Field(min_length=2, max_length=4096)
    trainer_logprobs: list[Float] = Field(
        description="logprob of token_ids[i] given token_ids[:i], for i = 1..len-1.")
    tolerance: Float = Field(gt=0, description="Largest acceptable mean |dlogp|.")
    drift_tolerance: Positive | None = Field(
        None, description="A mean |dlogp| over this (and within `tolerance`) passes, "
        "reported as drift: the gap rose well above the last passed probe's.")


class ProbeResult(ReplyModel):
    version: int
    mean_abs_dlogp: float = Field(description="Mean |served - trainer| over the probe tokens.")
    max_abs_dlogp: float
    tolerance: float
    passed: bool
    tokens: int
    drift_tolerance: float | None = None
    drifted: bool = Field(False, description="Passed, but over `drift_tolerance`: a warning, "
                          "not a verdict (the version is not marked suspect).")
