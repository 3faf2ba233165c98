"""Ending a pusher: `WeightPusher.close()`, and the same for a pusher never
closed, once it is collected or the interpreter exits, whichever comes first.

Why: a trainer script that never calls `close()` must still exit 0 and free
the replicas' data plane at once, rather than leave them a lease to wait out.
A pusher local to `main()` is collected when `main()` returns; one still
alive at exit is closed by `weakref.finalize`'s atexit hook, which runs while
the interpreter is whole, before finalization: what ending the gloo group
needs (its threads join there; client/protocol/bucket_group.py,
`close_group`). The finalizer holds the pusher's parts, never the pusher, so
it keeps nothing alive; every part's close is idempotent.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)


def close_parts(transport: Any, replicas: Any, sender: Any) -> None:
    """Release the connection on every replica and end our side of the data
    plane (transport), close the HTTP clients, free the send buffers."""
    if transport is not None:
        transport.close()
    if replicas is not None:
        replicas.close()
    sender.release()


def _close_unclosed(transport: Any, replicas: Any, sender: Any) -> None:
    try:
        close_parts(transport, replicas, sender)
    except Exception as e:  # at exit: say so, never raise
        log.warning("closing a weight pusher nobody closed: %s: %s", type(e).__name__, e)


def close_when_gone(owner: object, transport: Any, replicas: Any, sender: Any
                    ) -> weakref.finalize:
    """Close these parts once `owner` is collected, or at interpreter exit."""
    return weakref.finalize(owner, _close_unclosed, transport, replicas, sender)
