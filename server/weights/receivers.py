"""This server's half of each transport (protocol/transports.py
says what each one is; trainer/transport/registry.py holds the senders): how
a push over it is received. The push path asks the receiver (joins the
trainer's group? which worker op opens the receive?) instead of comparing
names.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_sidecar.protocol.transports import TRANSPORTS, TransportKind
from rollout_sidecar.server.weights.worker_requests import Allocate, Receive


@dataclass(frozen=True)
class Receiver:
    kind: TransportKind

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def joins_group(self) -> bool:
        """The bytes come over the trainer's data-plane group (data_plane.py): a
        push needs the connection that owns it, the workers receive in a thread,
        and a failed push drops the group on both sides. Otherwise they come as
        HTTP bodies, PUT /weights/bucket/{index}."""
        return self.kind.joins_group

    @property
    def needs_gpu(self) -> bool:
        """Offered only where vLLM's platform is CUDA-alike (asked once the engine runs)."""
        return self.kind.needs_gpu

    @property
    def opens_with(self) -> type[Receive] | type[Allocate]:
        """The worker request that opens a push's receive."""
        return Receive if self.joins_group else Allocate


RECEIVERS = {name: Receiver(kind) for name, kind in TRANSPORTS.items()}


def receiver(name: str) -> Receiver:
    return RECEIVERS[name]


def offered() -> list[str]:
    """The transports this server takes. NCCL needs a GPU on the server; gloo
    and HTTP work everywhere, including one GPU shared by trainer and server.
    Asked of vLLM's platform (NVML on CUDA), once the engine runs: never of
    `torch.cuda` at import, which would initialise CUDA in the process vLLM
    then forks its engine core from."""
    from vllm.platforms import current_platform

    gpu = current_platform.is_cuda_alike()
    return [r.name for r in RECEIVERS.values() if gpu or not r.needs_gpu]
