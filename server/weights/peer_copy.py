"""A replica that starts while its peers serve a newer version catches up
from one of them, without the trainer (issue 44).

The peer's side: its staged copy (the buckets of the last push, patched by
every delta since) holds the version it serves bit for bit, the same copy a
delta applies to (`WeightStatus.delta_base`). `GET /weights/staged` gives its
version and manifest, `GET /weights/staged/{index}` one bucket's bytes with
their CRC-32, read by worker rank 0 under the push lock, so no push can write
into a bucket while it is read; a push that begins between two reads makes
the next one refuse, and one that ended in between shows as another version:
either way the catch-up fails whole and nothing of it loads. A peer in the
middle of a push is waited for and read again, while the catch-up's bound
lasts.

The new replica's side (`catch_up`, started once it serves, before it
reports ready): every peer (`--peers`: URLs or a `dns+` name) first proves
it holds the fleet's admin token, which is never sent (peer_auth.py); one
that cannot is refused and named in the status. Then read every proven
peer's status (this server itself skipped by its boot id), take the newest
version a healthy peer's staged copy holds, and push it into itself as an
HTTP push: begin, each bucket streamed up to its manifest size, its tag and
CRC checked, staged, commit (all or nothing, the version the peer serves).
Meanwhile a request with `min_weight_version` waits at the gate and a
trainer's connect or begin waits for the catch-up (both bounded), so a push
is ordered after it; generation is refused (front_door.py) until it ends.
A catch-up that fails while a proven peer serves a newer version keeps
generation refused and the replica not ready, saying why (`held`), until a
push commits: the trainer's next push (dense, as after any restart) brings it
up. One that finds no newer version anywhere (the fleet's first start) serves
its checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from rollout_sidecar.protocol import failpoints
from rollout_sidecar.protocol.calls.tls import shared_tls
from rollout_sidecar.protocol.data_plane.bucket_check import crc32_of_bytes
from rollout_sidecar.protocol.schema import BeginRequest, StagedCopy, WeightStatus, routes
from rollout_sidecar.protocol.schema.endpoints import expand_urls
from rollout_sidecar.server.errors import PushConflict
from rollout_sidecar.server.weights import ops
from rollout_sidecar.server.weights.in_process_push import Bucket, push_in_process
from rollout_sidecar.server.weights.ops import SideOp
from rollout_sidecar.server.weights.peer_auth import MAC_HEADER, PeerRefused, PeerSession
from rollout_sidecar.server.weights.worker_replies import Staged

if TYPE_CHECKING:
    from rollout_sidecar.server.weights.service import WeightService

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 60.0  # one status or bucket; the whole catch-up has its own bound
PUSH_WAIT_S = 0.2  # a peer mid-push: read its status again this often


class PeerCopy:
    def __init__(self, service: WeightService) -> None:
        self.service = service
        self.done = asyncio.Event()  # set once no catch-up is running or pending
        self.done.set()
        self.timeline: dict[str, float | int | str] = {}
        # Why this replica must not serve yet, after a catch-up that failed
        # behind the fleet (module docstring); None: it may serve.
        self.held: str | None = None

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    # ------------------------------------------------------------ a peer's side

    async def _read(self, bucket: int | None) -> Staged:
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
        if reply.version is None or reply.manifest is None:
            raise PushConflict("no staged copy to read: worker rank 0 answered none")
        return StagedCopy(version=reply.version, buckets=reply.manifest)

    async def bucket(self, index: int) -> tuple[int, bytes]:
        reply = await self._read(index)
        if reply.version is None or reply.data is None:
            raise PushConflict("no staged copy to read: worker rank 0 answered none")
        return reply.version, reply.data

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
        except Exception as e:  # the trainer's next push brings it up
            self.timeline["error"] = error = \
                f"not done within --catch-up-timeout-s ({s.catch_up_timeout_s:g}s)" \
                if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            log.warning("catch-up from a peer failed after %.1fs: %s", time.monotonic() - t0,
                        error)
            fleet = self.timeline.get("fleet_version")
            if isinstance(fleet, int) and fleet > self.service.engine.gate.version:
                self.held = self.timeline["held"] = (
                    f"the catch-up failed ({error}) while a peer serves version {fleet}: "
                    "this replica serves once a push commits")
        finally:
            self.timeline["done_s"] = round(time.monotonic() - t0, 3)
            self.done.set()

    async def _catch_up(self, t0: float) -> None:
        svc = self.service
        peers = await asyncio.to_thread(expand_urls, svc.settings.peers)
        token = svc.settings.admin_token.get_secret_value() if svc.settings.admin_token else None
        if token is None:
            raise PeerRefused("no admin token: nothing to prove a peer holds it with")
        limit = svc.settings.max_request_bytes
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, verify=shared_tls()) as http:
            found = await self._statuses(http, peers, token, limit, t0)
            own = svc.engine.gate.version
            usable = [(st, session) for st, session in found
                      if st is not None and session is not None and st.boot_id != svc.boot_id
                      and st.broken is None and st.delta_base == st.weight_version
                      and st.weight_version > own]
            if not usable:
                fleet = self.timeline.get("fleet_version")
                if isinstance(fleet, int) and fleet > own:
                    raise RuntimeError(f"a peer serves version {fleet}, none from a staged copy "
                                       "this replica can read")
                self.timeline["outcome"] = "no peer serves a newer version"
                log.info("catch-up: %s (own version %d)", self.timeline["outcome"], own)
                return
            status, session = max(usable, key=lambda x: x[0].weight_version)
            copy = StagedCopy.model_validate_json(await _get(http, session, routes.STAGED.path,
                                                             limit))
            if copy.version != status.weight_version:
                raise RuntimeError(f"{session.url} moved from version {status.weight_version} "
                                   f"to {copy.version} while this replica read it")
            self.timeline.update(peer=session.url, version=copy.version,
                                 found_s=round(time.monotonic() - t0, 3))
            await self._push_from(http, session, copy, t0)

    async def _statuses(self, http: httpx.AsyncClient, peers: list[str], token: str,
                        limit: int, t0: float) -> list[tuple[WeightStatus | None,
                                                             PeerSession | None]]:
        """Every proven peer's status (`_status`), read again while a peer
        is mid-push (its staged copy is being replaced) and the catch-up's
        bound allows; the newest version a proven peer serves is kept as
        `fleet_version`."""
        bound = self.service.settings.catch_up_timeout_s
        while True:
            found = await asyncio.gather(*(self._status(http, u, token, limit) for u in peers))
            seen = [st for st, _ in found if st is not None and st.boot_id != self.service.boot_id]
            if seen:
                fleet = max(st.weight_version for st in seen)
                self.timeline["fleet_version"] = max(
                    fleet, int(self.timeline.get("fleet_version", -1)))
            if not any(st.push_in_progress for st in seen) or \
                    time.monotonic() - t0 > bound / 2:
                return found
            await asyncio.sleep(PUSH_WAIT_S)

    async def _status(self, http: httpx.AsyncClient, url: str, token: str, limit: int
                      ) -> tuple[WeightStatus | None, PeerSession | None]:
        """A peer's status once it proved it holds the token; (None, None)
        if it is down, starting (another may do) or refused (named in the
        timeline: it never learns the token, and nothing of it is read)."""
        try:
            session = await PeerSession.open(http, url, token)
            return WeightStatus.model_validate_json(
                await _get(http, session, routes.STATUS.path, limit)), session
        except PeerRefused as e:
            refused: Any = self.timeline.setdefault("refused", {})  # type: ignore[arg-type]
            refused[url] = str(e)
            log.warning("catch-up: %s", e)
        except Exception as e:
            log.info("catch-up: %s not usable: %s", url, e)
        return None, None

    async def _push_from(self, http: httpx.AsyncClient, peer: PeerSession, copy: StagedCopy,
                         t0: float) -> None:
        """`copy` into this replica as an in-process push, bucket by bucket."""
        async def buckets() -> AsyncIterator[Bucket]:
            for b in copy.buckets:
                path = routes.STAGED_BUCKET.url(index=b.index)
                data, headers = await _get(http, peer, path, b.nbytes, whole=True)
                if int(headers["X-Weight-Version"]) != copy.version:
                    raise RuntimeError(f"{peer.url} moved to version "
                                       f"{headers['X-Weight-Version']} while this replica read "
                                       f"version {copy.version}")
                yield data, int(headers["X-Checksum"])
            self.timeline["received_s"] = round(time.monotonic() - t0, 3)

        async def hold() -> None:
            if (until := failpoints.fire("catch_up.hold")) is not None:
                while not Path(until).exists():  # bounded by the catch-up's timeout
                    await asyncio.sleep(0.05)

        await push_in_process(self.service, BeginRequest(
            version=copy.version, transport="http", buckets=copy.buckets), buckets(),
            f"catch-up from {peer.url} failed", before_commit=hold)
        self.timeline.update(outcome="caught up", committed_s=round(time.monotonic() - t0, 3))
        log.info("catch-up: version %d from %s in %.1fs", copy.version, peer.url,
                 time.monotonic() - t0)


def bucket_headers(version: int, data: bytes) -> dict[str, str]:
    """A staged bucket's response headers: its version and CRC-32."""
    return {"X-Weight-Version": str(version), "X-Checksum": str(crc32_of_bytes(data))}


async def _get(http: httpx.AsyncClient, peer: PeerSession, path: str, limit: int,
               whole: bool = False) -> Any:
    """GET `path` of `peer`, streamed: refused past `limit` bytes before any
    more is read (or short of it, `whole`: a bucket is exactly its manifest
    size); its tag checked. The body, and with `whole` its headers too."""
    async with http.stream("GET", peer.url + path, headers=peer.headers("GET", path)) as r:
        if r.headers.get("content-encoding", "identity") != "identity":  # no bombs
            raise PeerRefused(f"{peer.url}{path}: content-encoding "
                              f"{r.headers['content-encoding']}; peers send bytes as they are")
        body = bytearray()
        async for chunk in r.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise PeerRefused(f"{peer.url}{path}: more than the {limit} bytes it may be")
        if r.status_code != 200:
            raise RuntimeError(f"GET {peer.url}{path}: {r.status_code} {bytes(body[:300])!r}")
        if whole and len(body) != limit:
            raise PeerRefused(f"{peer.url}{path}: {len(body)} bytes, its manifest says {limit}")
        await asyncio.to_thread(peer.check, path, body, r.headers.get(MAC_HEADER))
        return (body, r.headers) if whole else bytes(body)
