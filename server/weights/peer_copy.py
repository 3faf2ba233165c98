"""A replica that starts while its peers serve a newer version catches up
from one of them, without the trainer (issue 44).

The peer's side: its staged copy (the buckets of the last push, patched by
every delta since) holds the version it serves bit for bit, the same copy a
delta applies to (`WeightStatus.delta_base`). `GET /weights/staged` gives its
version and manifest, `GET /weights/staged/{index}` one bucket's bytes with
their CRC-32, read by worker rank 0 under the push lock, so no push can write
into a bucket while it is read; a push that begins between two reads makes
the next one refuse, and one that ended in between shows as another version:
either way the catch-up fails whole and nothing of it loads.

The new replica's side (`catch_up`, started once it serves, before it
reports ready): read every peer's status (`--peers`: URLs or a `dns+` name,
this server itself skipped by its boot id), take the newest version a healthy
peer's staged copy holds, and push it into itself as an HTTP push: begin,
each bucket staged and CRC-checked, commit (all or nothing, the version the
peer serves). Meanwhile a request with `min_weight_version` waits at the gate
and a trainer's connect or begin waits for the catch-up (both bounded), so a push is
ordered after it. A catch-up that fails leaves the replica on what it serves,
ready, and the trainer's next push (dense, as after any restart) brings it up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from rollout_sidecar.protocol import failpoints
from rollout_sidecar.protocol.data_plane.bucket_check import crc32_of_bytes
from rollout_sidecar.protocol.schema import (
    BeginRequest,
    CommitRequest,
    StagedCopy,
    WeightStatus,
)
from rollout_sidecar.protocol.schema.endpoints import auth_headers, expand_urls
from rollout_sidecar.server.errors import PushConflict
from rollout_sidecar.server.weights import ops
from rollout_sidecar.server.weights.ops import SideOp

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.service import WeightService

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 60.0  # one status or bucket; the whole catch-up has its own bound


class PeerCopy:
    def __init__(self, service: WeightService) -> None:
        self.service = service
        self.done = asyncio.Event()  # set once no catch-up is running or pending
        self.done.set()
        self.timeline: dict[str, float | int | str] = {}

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    # ------------------------------------------------------------ a peer's side

    async def _read(self, bucket: int | None) -> dict:
        svc = self.service
        async with svc.session.lock:
            if (p := svc.session.current) is not None:
                raise PushConflict(f"push {p.push_id} (version {p.req.version}) is "
                                   f"{p.state.value}: the staged copy is being replaced")
            try:
                return (await ops.call(svc.llm, SideOp.READ, bucket=bucket))[0]
            except ops.WorkerCallFailed as e:
                raise PushConflict(f"no staged copy to read: {e}") from None

    async def manifest(self) -> StagedCopy:
        reply = await self._read(None)
        return StagedCopy(version=reply["version"], buckets=reply["manifest"])

    async def bucket(self, index: int) -> tuple[int, bytes]:
        reply = await self._read(index)
        return reply["version"], reply["data"]

    # ---------------------------------------------------- the new replica's side

    def start(self) -> asyncio.Task | None:
        """Catch up in the background if peers are configured."""
        if not self.service.settings.peers:
            return None
        self.done.clear()
        return asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        t0 = time.monotonic()
        s = self.service.settings
        try:
            await asyncio.wait_for(self._catch_up(t0), s.catch_up_timeout_s)
        except Exception as e:  # the replica serves what it has; the trainer brings it up
            self.timeline["error"] = f"{type(e).__name__}: {e}"
            log.warning("catch-up from a peer failed after %.1fs: %s", time.monotonic() - t0,
                        self.timeline["error"])
        finally:
            self.timeline["done_s"] = round(time.monotonic() - t0, 3)
            self.done.set()

    async def _catch_up(self, t0: float) -> None:
        svc = self.service
        peers = await asyncio.to_thread(expand_urls, svc.settings.peers)
        token = svc.settings.admin_token.get_secret_value() if svc.settings.admin_token else None
        async with httpx.AsyncClient(headers=auth_headers(token), timeout=HTTP_TIMEOUT_S) as http:
            found = await asyncio.gather(*(_status(http, u) for u in peers))
            own = svc.engine.gate.version
            usable = [(st, u) for st, u in zip(found, peers, strict=True) if st is not None
                      and st.boot_id != svc.boot_id and st.broken is None
                      and st.delta_base == st.weight_version and st.weight_version > own]
            if not usable:
                self.timeline["outcome"] = "no peer serves a newer version from a staged copy"
                log.info("catch-up: %s (own version %d)", self.timeline["outcome"], own)
                return
            status, url = max(usable, key=lambda x: x[0].weight_version)
            copy = StagedCopy.model_validate((await _get(http, f"{url}/weights/staged")).json())
            if copy.version != status.weight_version:
                raise RuntimeError(f"{url} moved from version {status.weight_version} to "
                                   f"{copy.version} while this replica read it")
            self.timeline.update(peer=url, version=copy.version,
                                 found_s=round(time.monotonic() - t0, 3))
            await self._push_from(http, url, copy, t0)

    async def _push_from(self, http: httpx.AsyncClient, url: str, copy: StagedCopy,
                         t0: float) -> None:
        """`copy` into this replica as an HTTP push: begin, stage, commit."""
        svc = self.service
        begun = await svc.begin_now(BeginRequest(version=copy.version, transport="http",
                                                 buckets=copy.buckets))
        checksums = []
        try:
            for b in copy.buckets:
                r = await _get(http, f"{url}/weights/staged/{b.index}")
                if int(r.headers["X-Weight-Version"]) != copy.version:
                    raise RuntimeError(f"{url} moved to version {r.headers['X-Weight-Version']} "
                                       f"while this replica read version {copy.version}")
                checksum = int(r.headers["X-Checksum"])
                await svc.stage_bucket(begun.push_id, b.index, r.content, checksum)
                checksums.append(checksum)
            self.timeline["received_s"] = round(time.monotonic() - t0, 3)
            if (hold := failpoints.fire("catch_up.hold")) is not None:
                while not Path(hold).exists():  # bounded by the catch-up's timeout
                    await asyncio.sleep(0.05)
            await svc.commit(CommitRequest(push_id=begun.push_id, checksums=checksums))
        except BaseException as e:
            if svc.session.current is not None and svc.session.current.push_id == begun.push_id:
                await svc.abort(begun.push_id, f"catch-up from {url} failed: {e}")
            raise
        self.timeline.update(outcome="caught up", committed_s=round(time.monotonic() - t0, 3))
        log.info("catch-up: version %d from %s in %.1fs", copy.version, url,
                 time.monotonic() - t0)


def bucket_headers(version: int, data: bytes) -> dict[str, str]:
    """A staged bucket's response headers: its version and CRC-32."""
    return {"X-Weight-Version": str(version), "X-Checksum": str(crc32_of_bytes(data))}


async def _get(http: httpx.AsyncClient, url: str) -> httpx.Response:
    r = await http.get(url)
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}: {r.status_code} {r.text[:300]}")
    return r


async def _status(http: httpx.AsyncClient, url: str) -> WeightStatus | None:
    try:
        return WeightStatus.model_validate((await _get(http, f"{url}/weights/status")).json())
    except Exception as e:  # a peer down or still starting: another may do
        log.info("catch-up: %s not usable: %s", url, e)
        return None
