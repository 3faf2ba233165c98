"""What the server asks of vLLM, and nothing more: its surface as protocols.

vLLM's classes are imported lazily (a unit test, the trainer and the CLI's
`--help` never import vLLM), so the code that calls them cannot name their
types; before this module it held them as `Any`, and a reader, a type
checker and a vLLM upgrade all lost the path where it crossed into vLLM.
Each protocol here is the part of one vLLM class we use, member by member,
and `STANDS_FOR` names that class: tests/vllm_api reads every member listed
here against the installed vLLM (tests/test_vllm_api_units.py) and against
the newest wheel the gpu extra admits (CI's `.ci/run`), so a member vLLM
renames fails by name before any server starts.

The protocols are split by what a caller needs: the worker calls
(`WorkerRpc`: ops.py, the data plane, the staging layout) and the sampling
calls (`Sampler`: generate/, openai_api/) are what the unit tests' fakes
implement; `VllmEngine` is AsyncLLM as a whole, which the engine holds.
mypy holds every call site to these (tests/test_types.py): a use of vLLM
not declared here fails there, naming the line.
The other side of `collective_rpc`, vLLM's worker as our worker method sees
it, is server/weights/worker/vllm_worker.py (the engine imports nothing of
weights/).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol


class ModelConfigView(Protocol):
    """vLLM's ModelConfig: what the engine's info reports (lifecycle.py)."""

    dtype: Any  # a torch.dtype
    head_dtype: Any
    max_model_len: int
    logprobs_mode: str
    quantization: str | None

    def get_vocab_size(self) -> int: ...


class ParallelConfigView(Protocol):
    """vLLM's ParallelConfig: a worker's place among the engine's ranks."""

    world_size: int
    world_size_across_dp: int
    data_parallel_index: int


class VllmConfigView(Protocol):
    parallel_config: ParallelConfigView
    model_config: ModelConfigView


class OutputProcessorView(Protocol):
    def get_num_unfinished_requests(self) -> int: ...


class Collector(Protocol):
    """What `add_request` returns: one request's outputs as they come
    (vLLM's RequestOutputCollector)."""

    request_id: str

    def get_nowait(self) -> Any: ...
    async def get(self) -> Any: ...
    def close(self) -> None: ...


class WorkerRpc(Protocol):
    """The engine's workers: how many (the config) and the one way into them,
    our worker method on every rank (ops.py)."""

    vllm_config: VllmConfigView

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple = (), kwargs: dict[str, Any] | None = None
                             ) -> list[Any]: ...


class Sampler(Protocol):
    """Submitting and aborting requests (generate/, openai_api/)."""

    async def add_request(self, request_id: str, prompt: Any, params: Any,
                          *args: Any, **kwargs: Any) -> Collector: ...
    def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                 *args: Any, **kwargs: Any) -> AsyncIterator[Any]: ...
    async def abort(self, request_id: str | Sequence[str], internal: bool = False
                    ) -> None: ...


class VllmEngine(WorkerRpc, Sampler, Protocol):
    """vLLM's AsyncLLM, as the engine holds it once started."""

    model_config: ModelConfigView
    output_processor: OutputProcessorView

    # A commit pauses generation around a load (server/weights/commit.py).
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True
                               ) -> None: ...
    async def resume_generation(self) -> None: ...
    # The label vLLM stamps on every step's outputs (engine/version_spans.py).
    async def update_weight_version(self, new_version: str) -> None: ...
    async def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


# The vLLM class each protocol is the surface of (tests/vllm_api checks every
# member above exists there, in the installed vLLM and the newest supported).
STANDS_FOR: dict[type, str] = {
    ModelConfigView: "vllm.config.model.ModelConfig",
    ParallelConfigView: "vllm.config.parallel.ParallelConfig",
    VllmConfigView: "vllm.config.vllm.VllmConfig",
    OutputProcessorView: "vllm.v1.engine.output_processor.OutputProcessor",
    Collector: "vllm.v1.engine.output_processor.RequestOutputCollector",
    WorkerRpc: "vllm.v1.engine.async_llm.AsyncLLM",
    Sampler: "vllm.v1.engine.async_llm.AsyncLLM",
    VllmEngine: "vllm.v1.engine.async_llm.AsyncLLM",
}
