"""On CPU, vLLM's engine processes nap while they wait for work, not spin.

vLLM's shared-memory message queue (`shm_broadcast.SpinCondition`) keeps a
reader looping on `sched_yield()` for a second after every message. Under
steady rollouts, a CPU server's worker and engine core (pinned by vLLM's
auto-binding) never leave that loop. Two problems follow:

- The loop holds the GIL between yields, so our data-plane threads in the
  worker wait for it. A connect in compose took 10 to 100 s.
- Two replicas on one host are bound to the same core, which then runs two
  yield loops. In the replica tests, a trainer's `import torch` was moved
  onto that core by MKL, which visits each core to count them. It stayed
  runnable there without being scheduled for 10 minutes, in 2 of 2 runs and
  in CI.

Here a reader inside vLLM's busy window naps (`NAP_S`, about 0.1 ms) where
it would yield. It releases the core and the GIL, and it sees the next
message within one nap. Past the window it sleeps in vLLM's zmq poll, as
before.

Measured on a 2-core host (`bench/engine_wait.py`; the demo):
- Generation throughput, nap / spin: 0.99.
- The demo (trainer and server on one host): 39 s with nap, 42 s with spin.
- The replica tests: they pass, where spin hung.
- A CPU-bound neighbour pinned to the worker's own core gets 16% of that
  core with nap, against about 100% with spin. vLLM's yield hands the core
  over; a nap's wake-ups preempt the neighbour. `engine_wait=spin` keeps
  vLLM's loop for that case.

Waking only by notification (`busy_loop_s=0`) does not work. The writer's
PUB socket has a send high-water mark of 1, so notifications are dropped
while zmq's flow control catches up, and a reader then waits out the 5 s
recheck. We measured 10 to 25 s per weight commit that way.
"""

from __future__ import annotations

import os
import time

# A nap, not a yield: ~50 us asked, ~0.1 ms with the kernel's timer slack.
# (Naps growing with the wait, up to 1 ms, cost 31% of the throughput.)
NAP_S = 5e-5
# The `engine_wait` setting, as the engine's processes see it: the server sets
# it in the environment they inherit.
ENGINE_WAIT_ENV = "ROLLOUT_SIDECAR_ENGINE_WAIT"


def wait_idle_on_cpu() -> None:
    """Make every shared-memory queue reader of this process nap, not spin;
    CPU platform only, unless `engine_wait` is spin. Idempotent: plugins load
    more than once per process."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(ENGINE_WAIT_ENV, "nap") == "spin":
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    if getattr(spin, "naps", False):
        return

    class NappingCondition(spin):  # type: ignore[misc, valid-type]
        naps = True

        def wait(self, timeout_ms: int | None = None) -> None:
            if time.monotonic() <= self.last_read + self.busy_loop_s:
                time.sleep(NAP_S)
                return
            super().wait(timeout_ms)

    # MessageQueue looks the class up in its module when it builds a queue.
    shm_broadcast.SpinCondition = NappingCondition
