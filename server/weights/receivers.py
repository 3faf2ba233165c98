"""What each transport asks of this server, by name: the one place the server
tells transports apart. The trainer's counterpart is
trainer/transport/registry.py; the names are the wire's `Transport`
(client/protocol/weights_api.py).

Adding a transport is one name there, one sender in the trainer and one
`Receiver` here; the push path asks the receiver what it does (joins the
trainer's group? which worker op opens the receive?) instead of comparing
names.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_sidecar.server.weights.ops import WorkerOp


@dataclass(frozen=True)
class Receiver:
    name: str
    # The bytes come over the trainer's data-plane group (server/weights/
    # data_plane.py): a push needs the connection that owns it, the workers
    # receive in a thread, and a failed push drops the group on both sides.
    # Otherwise they come as HTTP bodies, PUT /weights/bucket/{index}.
    joins_group: bool
    # Offered only where vLLM's platform is CUDA-alike (asked once the engine runs).
    needs_gpu: bool = False

    @property
    def opens_with(self) -> WorkerOp:
        """The worker op that opens a push's receive."""
        return WorkerOp.RECEIVE if self.joins_group else WorkerOp.ALLOCATE


RECEIVERS = {r.name: r for r in (
    Receiver("gloo", joins_group=True),  # host memory, everywhere
    Receiver("nccl", joins_group=True, needs_gpu=True),  # GPU to GPU
    Receiver("http", joins_group=False),  # only the HTTP port open between the two
)}


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
