"""A push that starts inside the server, not at a trainer: a catch-up from a
peer (peer_copy.py) and SkyRL's delta sync (skyrl_api/delta_sync.py). It
goes through the same begin, staging, checks and commit as a trainer's HTTP
push, so it is all or nothing and every check a push gets applies.

The buckets come one at a time from an async iterator, so the server holds
one bucket of them at once besides the staged copy (a peer's is streamed;
SkyRL's is packed when it is staged).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from rollout_sidecar.protocol.data_plane.bucket_check import crc32_of_bytes
from rollout_sidecar.protocol.schema import BeginRequest, CommitRequest

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.service import WeightService

Bucket = tuple[bytes | bytearray, int | None]  # its bytes, their CRC-32 (None: computed here)


async def push_in_process(svc: WeightService, req: BeginRequest,
                          buckets: AsyncIterator[Bucket], what: str,
                          before_commit: Callable[[], Awaitable[None]] | None = None) -> None:
    """Begin `req` (an HTTP push), stage each of `buckets` in manifest order,
    commit; on any error abort it (naming `what`) and raise."""
    begun = await svc.begin_now(req)
    checksums = []
    try:
        index = 0
        async for data, checksum in buckets:
            if checksum is None:  # off the event loop: ~60 ms a 256 MiB bucket
                checksum = await asyncio.to_thread(crc32_of_bytes, data)
            await svc.stage_bucket(begun.push_id, index, data, checksum)
            checksums.append(checksum)
            index += 1
        if before_commit is not None:
            await before_commit()
        await svc.commit(CommitRequest(push_id=begun.push_id, checksums=checksums))
    except BaseException as e:
        current = svc.session.current
        if current is not None and current.push_id == begun.push_id:
            await svc.abort(begun.push_id, f"{what}: {e}")
        raise
