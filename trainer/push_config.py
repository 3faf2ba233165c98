"""`PushConfig`: how a `WeightPusher` pushes, one documented field each.

`WeightPusher(url, admin_token, config=PushConfig(...))`, or the same fields
as keyword arguments (`WeightPusher(url, transport="http")`), which build the
config. Checked when built, on every rank, so a typo fails before the first
collective rather than on rank 0 alone in the middle of a push.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from rollout_sidecar.protocol.schema import CommitPolicy, Transport
from rollout_sidecar.protocol.transports import transport
from rollout_sidecar.trainer.probe import Forward

Fanout = Literal["auto", "broadcast", "chain"]
OnServerRestart = Literal["repush", "raise"]
OnAbsentReplica = Literal["skip", "raise"]
DeltaMode = Literal["auto", True, False]
AdapterMode = Literal["auto", True, False]  # the same three answers, another question
CopyLocation = Literal["host", "device"]

@dataclass
class PushConfig:
    transport: Transport = "gloo"
    """How bucket bytes travel: "gloo" (host memory), "nccl" (GPU to GPU) or
    "http" (request bodies, when only the HTTP port is open)."""

    bucket_mb: float = 256
    """Bucket size in MiB. Rank 0's extra peak is about 3 x bucket: two send
    buffers (a tensor larger than a bucket is split across buckets) plus at
    most 0.75 bucket of a gather (FSDP2 brings a parameter larger than a
    quarter bucket to rank 0 in half-bucket blocks of rows, see `row_blocks`;
    FSDP1 gathers one unit at a time). The server copies each split tensor
    once while loading."""

    device: torch.device | None = None
    """Compute device for FSDP gathers and the probe's input (default: the
    mesh's device)."""

    data_plane_host: str | None = None
    """Where the first replica's TCPStore listens (default: its URL's host)."""

    probe: bool | Forward = True
    """After each commit, compare the served logprobs with this trainer's own
    forward pass over a fixed sequence (probe.py). True uses
    `model(input_ids=...)`; pass a callable `(model, input_ids) -> logits`
    for other models, or False."""

    probe_tolerance: float | None = None
    """Largest acceptable mean |dlogp| of the probe. Default: by precision
    (fp32 1e-3, fp16 0.05, bf16 0.1); a gap within it but over max(3 x, + 0.008)
    the last passed probe's passes as drift (`PushResult.probe.drifted`, a
    warning: in bf16 a healthy run's gap wanders that far; probe.py)."""

    probe_every: int = 1
    """Probe every N-th push (the first always), to amortise the probe's
    forward pass when pushes are frequent."""

    commit_policy: CommitPolicy | None = None
    """In-flight requests at this trainer's commits ("wait", "abort",
    "keep"); default: the server's."""

    on_server_restart: OnServerRestart = "repush"
    """A replica restarted (new boot id) since the last push and serves its
    checkpoint again: "repush" (log it, push this version as usual,
    `PushResult.server_restarted`) or "raise" (`ServerRestartedError`)."""

    on_absent_replica: OnAbsentReplica = "skip"
    """A listed replica joining (not answering yet), away (refusing
    connections after it answered: restarting, or gone) or leaving (draining)
    at a push's start: "skip" (push to the
    others; `PushResult.absent` names it, and it catches up from a peer) or
    "raise" (fail the push naming it, for a fleet that must move as one)."""

    takeover: bool = False
    """Connect even while another trainer's connection is live."""

    stall_timeout_s: float = 15.0
    """The one deadline setting: no progress for this long, in any phase of a
    push, fails it (control/deadlines.py derives every wait from it). A
    replica that froze fails the push within about twice this, naming the
    replica, while the others keep serving. The trainer must also hand the
    data plane each bucket within it (gathering one bucket is seconds)."""

    connect_timeout_s: float = 120.0
    """How long forming the data-plane group may take (every replica's
    workers and this trainer meet). Not the stall bound: a fresh container's
    first connect loads gloo's code cold and has taken 15-30 s on two cores.
    The connect call stays watched, so a replica that freezes meanwhile still
    fails it within the stall bound."""

    lease_wait_s: float = 60.0
    """How long to wait for another trainer's connection lease to run out (a
    restarted trainer finds its old self there) before raising."""

    split_tensors: bool = True
    """False gives a tensor larger than a bucket a bucket of its own instead
    of splitting it (for servers that predate chunked manifests); the send
    buffers then grow to 2 x the largest tensor."""

    row_blocks: bool = True
    """False gathers every FSDP2 parameter whole with `full_tensor()` (on
    every rank at once) instead of bringing those larger than a quarter
    bucket to rank 0 in blocks of rows."""

    fanout: Fanout = "auto"
    """How each bucket reaches every receiver over gloo/NCCL: "broadcast",
    "chain" (rank 0 sends it once and each receiver relays it to the next,
    so the trainer's link carries each bucket once however many replicas
    listen), or "auto" (chain for gloo with more than one receiver, else
    broadcast: NCCL's broadcast is a pipelined ring already). Several
    senders always chain. With "auto", a gloo chain over several replicas
    that all offer `chain:ring` is entered at each replica in turn (bucket
    k at replica k mod R: protocol/data_plane/ring_route.py), so each
    replica's link relays (R - 1) / R of the push instead of the first
    replica's relaying all of it; "chain" keeps one entry."""

    senders: Literal["all", "one"] = "all"
    """Which trainer ranks send a dense push's buckets over gloo or NCCL: "all" (each
    bucket from one rank, shared out by bytes, so N ranks' links each carry
    about 1/N of the push; every rank then holds two send buffers) or "one"
    (rank 0 sends every bucket, as before). "all" falls back to one sender,
    and `PushResult.senders_reason` says why, where it cannot go: a replica
    that predates it (no `senders` in its capabilities, or no `senders:nccl`
    for NCCL), HTTP, one rank, a delta or an adapter
    push (rank 0 encodes them), a PEFT model or checkpoint conversion (rank 0
    converts). Each FSDP2 rank then sends its own rows (`own_rows`), holding
    two buckets and nothing gathered; where those cannot go, every rank
    gathers each parameter whole (`full_tensor()`, as FSDP2 does itself):
    `row_blocks`, which bring a large one to rank 0 alone, apply to one
    sender only, so a rank's transient peak is then its largest parameter
    (about 3 copies for a moment) plus two buckets. "one" keeps row blocks'
    bound."""

    own_rows: bool = True
    """With every rank sending an FSDP2 (or HSDP) model, each rank sends the
    rows of its own shards as they are, and nothing is gathered
    (gather/own_rows.py): each trainer link carries model / N bytes, against
    about model bytes with the gathers, and no rank holds a full parameter
    (2-3x faster pushes between nodes: docs/benchmarks.md). It goes where
    every parameter is a dim-0 shard over the whole trainer group (FSDP2's
    default, HSDP's replica groups each sending a part) or held whole, and
    every replica takes `chunks:interleaved` (every server since chunks land
    in place: server placed_tensors.py; older ones with one worker and host
    staging); otherwise every rank gathers, and `PushResult.own_rows_reason`
    says why (FSDP1's flat parameters, a shard on another dim). False:
    always gather, as before."""

    authenticate_buckets: bool = False
    """gloo/NCCL: tag every bucket with a keyed BLAKE2b under the connection's
    secret, checked by every replica before anything loads, so bytes from
    anyone without the secret never load. Off by default: BLAKE2b runs at
    about 1 GB/s a core, which made a push's transfer 3.4x slower over
    loopback gloo (bench/data_plane_mac.py); CRC-32 still catches accidents.
    The rendezvous is signed with the connection's secret either way."""

    delta: DeltaMode = "auto"
    """Send only what changed since the last version every replica committed
    (trainer/delta/): each rank diffs its own shard against a copy of it, in
    the wire dtype, and only changed (position, value) pairs travel, losslessly.
    "auto" (or True) falls back to a dense push where a delta cannot go (the
    first push, a replica restarted or missed a push, a PEFT model, a
    patch over half the dense bytes); `PushResult.encoding` says which went,
    `delta_reason` why not. False: always dense, and no copy is kept."""

    adapter: AdapterMode = "auto"
    """A PEFT LoRA model: send its adapter, not the merged model, where every
    replica was started with --enable-lora and can apply it (trainer/adapter/).
    "auto" falls back to merged (`PushResult.adapter_reason` says why), True
    raises instead, False always merges. The first adapter push to a replica
    carries the base weights too; later ones the adapter alone."""

    delta_copy: CopyLocation = "host"
    """Where each rank keeps its shard copy for `delta`: host memory (1/N of
    the model in the wire dtype) or the shard's own device (faster diffs on a
    GPU, at the cost of that much GPU memory)."""

    delta_dense_above: float = 0.25
    """A tensor with more than this share of its elements changed travels
    whole inside a delta push (protocol/data_plane/delta_codec.py measures the
    break-even)."""

    def __post_init__(self) -> None:
        _one_of("transport", self.transport, Transport)
        _one_of("fanout", self.fanout, Fanout)
        _one_of("senders", self.senders, Literal["all", "one"])
        _one_of("on_server_restart", self.on_server_restart, OnServerRestart)
        _one_of("on_absent_replica", self.on_absent_replica, OnAbsentReplica)
        _one_of("delta", self.delta, DeltaMode)
        _one_of("delta_copy", self.delta_copy, CopyLocation)
        _one_of("adapter", self.adapter, AdapterMode)
        if not 0 < self.delta_dense_above <= 1:
            raise ValueError(f"delta_dense_above must be in (0, 1], not "
                             f"{self.delta_dense_above!r}")
        if self.commit_policy is not None:
            _one_of("commit_policy", self.commit_policy, CommitPolicy)
        transport(self.transport).check_fanout(self.fanout)
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, not {self.bucket_mb!r}")
        if self.probe_tolerance is not None and not self.probe_tolerance > 0:
            raise ValueError(f"probe_tolerance must be positive, not {self.probe_tolerance!r}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, not {self.stall_timeout_s!r}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be positive, not {self.connect_timeout_s!r}")
        if self.lease_wait_s < 0:
            raise ValueError(f"lease_wait_s must be >= 0, not {self.lease_wait_s!r}")
        # Values under 1 always meant "every push"; keep accepting them.
        self.probe_every = max(1, int(self.probe_every))

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @classmethod
    def build(cls, config: PushConfig | None, options: dict[str, Any]) -> PushConfig:
        """`config` (or the defaults) with `options` (PushConfig's field names)
        applied on top."""
        return dataclasses.replace(config, **options) if config else cls(**options)


def _one_of(name: str, value: object, allowed: Any) -> None:
    if value not in get_args(allowed):
        choices = ", ".join(str(a) for a in get_args(allowed))
        raise ValueError(f"{name} must be one of {choices}, not {value!r}")
