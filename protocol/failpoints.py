"""Failpoints: the named places where a test makes the push path fail, and
the one way to arm them. Off unless armed; production never arms one.

A server arms them only when started for tests with `serve --failpoints
FILE` (a flag, never the environment: server/config.py refuses to start a
server that finds `$ROLLOUT_SIDECAR_FAILPOINTS` in its environment without
the flag). `arm_file` then says so in the log, loudly, and hands the file
to the engine's workers through their environment.

Every place is a row of `FAILPOINTS` and one `fire(name, ...)` call at the
site, which returns None unless the failpoint is armed. Armed:

- in the process (a test that runs the trainer itself): `armed(name, action)`
  calls `action(**site)` at each hit (the site's values: a bucket's index,
  its buffer, the worker's rank) and the site uses what it returns;
- from outside (a server's vLLM workers, in processes of their own): the file
  named by `$ROLLOUT_SIDECAR_FAILPOINTS`, read again at every hit so that one
  server goes through several faults, holds one line `name[:arg][@rank]`
  (`@rank`: worker rank R alone, as a fault on one TP rank is what puts
  vLLM's worker replies out of step; server/weights/ops.py). The site gets
  `arg` ("" when there is none).

A name that is not a row is refused loudly: a misspelt fault must not pass
for a fault the code survived.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV = "ROLLOUT_SIDECAR_FAILPOINTS"
log = logging.getLogger(__name__)

FAILPOINTS: dict[str, str] = {
    # The trainer (trainer/control/admin_client.py, trainer/pack/sender.py):
    # armed in the process only, since their actions are code.
    "push.call": "before rank 0 calls a replica's weight route; (phase, url)",
    "push.send": "before a bucket leaves rank 0; (index, buf) -> the bytes to send "
                 "instead (the CRC stays the true bytes'), or None",
    # The server's vLLM workers (server/weights/worker/).
    "check.corrupt": "flip a staged byte after it arrived: the CRC check must refuse the push",
    "load.drop": "arg NAME: the staged tensor NAME is not loaded (a skipped or mis-mapped "
                 "parameter): the layer-coverage check must refuse it",
    "load.stale": "arg NAME: NAME is loaded from the checkpoint on disk, not the push (the "
                  "layer is complete but old): only the probe can see it",
    "load.crash": "the load raises after it changed the model (past the point of no return), "
                  "as a device error mid-load would",
    # The server's API process (server/weights/peer_copy.py).
    "catch_up.hold": "arg PATH: a catch-up from a peer waits, every bucket staged, until PATH "
                     "exists (a test pushes meanwhile, to see the push ordered after it)",
    "quant.skip": "arg NAME: the layer NAME (an online-quantized one) is not re-quantized at "
                  "a push: it keeps the previous version's quantized weights and scales, as "
                  "a reload that skips the repack does (verl 7986)",
    "adapter.scaling_twice": "a LoRA adapter's scaling (alpha/r) is applied twice, as "
                             "SkyRL's rebuilt adapters were (SkyRL 2221): only the probe sees it",
}

IN_PROCESS_ONLY = {"push.call", "push.send"}
_actions: dict[str, Callable[..., Any]] = {}


def _known(name: str) -> str:
    if name not in FAILPOINTS:
        raise ValueError(f"no failpoint {name!r}; known: {sorted(FAILPOINTS)}")
    return name


@contextlib.contextmanager
def armed(name: str, action: Callable[..., Any]) -> Iterator[None]:
    """Arm `name` in this process while the block runs."""
    _actions[_known(name)] = action
    try:
        yield
    finally:
        _actions.pop(name, None)


def arm_file(path: Path) -> None:
    """Arm the failpoints `path` names in this process and the processes it
    starts (a server's vLLM workers inherit its environment)."""
    os.environ[ENV] = str(path)
    log.warning("FAILPOINTS ARMED from %s: this server is started for tests and can be made "
                "to serve weights nobody pushed; never run it for users", path)


def _from_file(name: str, rank: int | None) -> str | None:
    path = os.environ.get(ENV)
    spec = Path(path).read_text().strip() if path and Path(path).exists() else ""
    if not spec:
        return None
    spec, at, only = spec.partition("@")
    armed_name, _, arg = spec.partition(":")
    if _known(armed_name) in IN_PROCESS_ONLY:
        raise ValueError(f"failpoint {armed_name} is armed in the process only (armed())")
    if armed_name != name or (at and rank is not None and int(only) != rank):
        return None
    log.warning("failpoint %s%s fires%s (tests only)", name, f":{arg}" if arg else "",
                "" if rank is None else f" on rank {rank}")
    return arg


def fire(name: str, rank: int | None = None, **site: Any) -> Any:
    """None unless `name` is armed; else what its action returns (in the
    process) or its argument (from the file)."""
    action = _actions.get(_known(name))
    if action is not None:
        return action(rank=rank, **site)
    return _from_file(name, rank)
