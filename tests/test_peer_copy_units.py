"""A catch-up reads a peer's answers as a stream, bounded, and uses none it
could not verify (server/weights/peer_copy.py `_get`, peer_auth.py), with
httpx's mock transport as the peer (no server): a bucket longer than its
manifest entry is refused before the rest is read, a shorter one and a
compressed one are refused, and one whose tag does not match is never
returned."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rollout_sidecar.server.weights.peer_auth import (
    MAC_HEADER,
    PeerAnswerer,
    PeerRefused,
    PeerSession,
)
from rollout_sidecar.server.weights.peer_copy import _get

TOKEN = "fleet-admin-token-01"
PATH = "/weights/staged/0"


def streamed(body: object) -> httpx.Response:
    """A JSON answer as a network peer sends it: a stream, read as it comes."""
    return httpx.Response(200, stream=httpx.ByteStream(json.dumps(body).encode()))


def peer(body: bytes, tag: str | None = "good", headers: dict | None = None) -> httpx.MockTransport:
    """A peer holding the token that answers the challenge, then `PATH`
    with `body`, tagged right (`good`), wrong, or not at all."""
    answerer = PeerAnswerer(TOKEN)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/challenge"):
            return streamed(answerer.challenge(json.loads(request.content)["nonce"]))
        scheme, _, credential = request.headers["authorization"].partition(" ")
        assert scheme == "Peer" and answerer.verify(credential, "GET", PATH)
        sealed = answerer.seal(credential, PATH, body) if tag == "good" else (
            {MAC_HEADER: "0" * 32} if tag == "wrong" else {})
        return httpx.Response(200, stream=httpx.ByteStream(body),
                              headers={**sealed, **(headers or {})})

    return httpx.MockTransport(handle)


def fetch(transport: httpx.MockTransport, limit: int) -> bytes:
    async def main() -> bytes:
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
            session = await PeerSession.open(http, "http://peer", TOKEN)
            data, _ = await _get(http, session, PATH, limit, whole=True)
            return bytes(data)

    return asyncio.run(main())


def test_a_bucket_of_its_size_and_tag_is_read():
    assert fetch(peer(b"x" * 64), 64) == b"x" * 64


@pytest.mark.parametrize("body, tag, headers, words", [
    (b"x" * 65, "good", None, "more than the 64 bytes"),
    (b"x" * 63, "good", None, "63 bytes, its manifest says 64"),
    (b"x" * 64, "wrong", None, "fails its tag"),
    (b"x" * 64, None, None, "fails its tag"),
    (b"x" * 64, "good", {"content-encoding": "gzip"}, "content-encoding gzip"),
])
def test_a_bucket_that_is_not_what_was_promised_is_refused(body, tag, headers, words):
    with pytest.raises(PeerRefused, match=words):
        fetch(peer(body, tag, headers), 64)


def test_a_peer_without_the_token_is_refused_at_the_challenge():
    impostor = PeerAnswerer("another-fleets-token")
    transport = httpx.MockTransport(lambda r: streamed(impostor.challenge("00" * 32)))

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport) as http:
            await PeerSession.open(http, "http://peer", TOKEN)

    with pytest.raises(PeerRefused, match="did not prove it holds"):
        asyncio.run(main())


def test_a_challenge_answer_too_large_is_refused_before_it_is_read_whole():
    transport = httpx.MockTransport(lambda r: streamed({"nonce": "x" * 100_000}))

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport) as http:
            await PeerSession.open(http, "http://peer", TOKEN)

    with pytest.raises(PeerRefused, match="a challenge answer over"):
        asyncio.run(main())
