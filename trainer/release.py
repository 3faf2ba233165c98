"""Ending a pusher: `WeightPusher.close()`, and the same for a pusher never
closed, once it is collected or the interpreter exits, whichever comes first.

Why: a trainer script that never calls `close()` must still exit 0 and free
the replicas' data plane at once, rather than leave them a lease to wait out.
A pusher local to `main()` is collected when `main()` returns; one still
alive at exit is closed by `weakref.finalize`'s atexit hook, which runs while
the interpreter is whole, before finalization: what ending the gloo group
needs (its threads join there; protocol/data_plane/bucket_group.py,
`close_group`). The finalizer holds the pusher's parts, never the pusher, so
it keeps nothing alive; every part's close is idempotent.

Where the close runs: a collected pusher is finalized in whichever thread the
collection happened, often one that merely allocated (a training step, a
rollout, another pusher's push), and closing waits on HTTP and on threads (a
join given up on ends by its own timeout). Run there, it froze that thread:
in a test, another trainer's commit waited 93 s inside a GC pass. So a
collected pusher is closed in a thread of its own, not a daemon, so the
interpreter waits for it at exit; at exit itself (atexit, no new threads
then) the close runs where it is called.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)


def close_parts(transport: Any, replicas: Any, sender: Any, peer: Any = None) -> None:
    """Release the connection on every replica and end our side of the data
    plane (transport; a peer rank's group), close the HTTP clients, free the
    send buffers. Each part is closed whatever the one before did; the first
    error is raised."""
    first: Exception | None = None
    for part, how in ((transport, "close"), (peer, "close"), (replicas, "close"),
                      (sender, "release")):
        if part is None:
            continue
        try:
            getattr(part, how)()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


def _close_now(transport: Any, replicas: Any, sender: Any, peer: Any = None) -> None:
    try:
        close_parts(transport, replicas, sender, peer)
    except Exception as e:  # unasked: say so, never raise
        log.warning("closing a weight pusher nobody closed: %s: %s", type(e).__name__, e)


def _at_exit() -> bool:
    # threading's shutdown marks the main thread stopped before the atexit
    # hooks run (weakref.finalize's among them), and threads cannot finish then.
    return not threading.main_thread().is_alive() or sys.is_finalizing()


def _close_unclosed(transport: Any, replicas: Any, sender: Any, peer: Any = None) -> None:
    if not _at_exit():
        try:
            threading.Thread(target=_close_now, args=(transport, replicas, sender, peer),
                             name="rollout-sidecar-close-unclosed-pusher").start()
            return
        except RuntimeError:  # no new threads once the interpreter is shutting down
            pass
    _close_now(transport, replicas, sender, peer)


def close_when_gone(owner: object, transport: Any, replicas: Any, sender: Any,
                    peer: Any = None) -> weakref.finalize:
    """Close these parts once `owner` is collected, or at interpreter exit."""
    return weakref.finalize(owner, _close_unclosed, transport, replicas, sender, peer)
