"""A replica catching up from a peer and the peer prove to each other that
both hold the fleet's admin token, without either sending it, and every
byte the peer answers is tagged under a key only the two of them hold.

Why: a replica started with `--peers` used to send `Authorization: Bearer
<admin token>` in clear to whatever answered at a peer's address, and to
commit whatever it was given. A stub there took the token and had its
all-zero weights served as version 10^12.

The exchange (both halves here, the catching-up side first):

  C -> P  POST /weights/peer/challenge {"nonce": nc}      (no credential)
  P -> C  {"nonce": ns, "proof": HMAC(token, "server", nc, ns)}
          C checks the proof: a peer without the token cannot make it.
  C -> P  GET /weights/status, /weights/staged, /weights/staged/{i}
          Authorization: Peer ns.TAG(K, method, path)
          where K = HMAC(token, "session", nc, ns): P checks it, so only a
          replica with the token reads the staged weights;
  P -> C  the body, and X-Peer-Mac: TAG(K, "response", path, body), checked
          before anything of it is used: a bucket that fails is never staged.

A peer keeps its last `SESSIONS` sessions (an idle one ends after
`SESSION_TTL_S`): a flood of challenges can end a catch-up early, which the
trainer's next push then covers, but never lets anyone read or write.
A request tag replayed by someone on the path reads the same route again
within the session; they saw that answer go by already.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict

import httpx

from rollout_sidecar.protocol.schema import routes

NONCE_BYTES = 32
ANSWER_BYTES = 4096  # a challenge's answer is two hex strings
SESSIONS = 64
SESSION_TTL_S = 3600.0
SCHEME = "Peer"
MAC_HEADER = "X-Peer-Mac"
CHALLENGE_PATH = routes.PEER_CHALLENGE.path
_PERSON = b"rs-peer-v1"  # BLAKE2b personalisation: peer tags only


class PeerRefused(RuntimeError):
    """The peer could not prove it holds the admin token, or an answer of
    it failed its tag."""


def _derive(token: str, what: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(token.encode(), b"\0".join([_PERSON, what, nc, ns]),
                    hashlib.sha256).digest()


def tag(key: bytes, *parts: bytes | bytearray | str) -> str:
    """Keyed BLAKE2b of `parts` (length-prefixed: no two splits collide).
    hashlib releases the GIL on large buffers."""
    h = hashlib.blake2b(key=key, digest_size=16, person=_PERSON)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _nonce(hex_value: object) -> bytes | None:
    if not isinstance(hex_value, str) or len(hex_value) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(hex_value)
    except ValueError:
        return None


class PeerAnswerer:
    """The peer's side: answers challenges, checks request tags, seals answers."""

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._sessions: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def challenge(self, nonce: object) -> dict[str, str] | None:
        """The answer to a challenge; None if `nonce` is malformed or this
        server has no admin token (then it proves nothing)."""
        nc = _nonce(nonce)
        if nc is None or not self._token:
            return None
        ns = secrets.token_bytes(NONCE_BYTES)
        self._sessions[ns.hex()] = (_derive(self._token, b"session", nc, ns), time.monotonic())
        while len(self._sessions) > SESSIONS:
            self._sessions.popitem(last=False)
        return {"nonce": ns.hex(),
                "proof": _derive(self._token, b"server", nc, ns).hex()}

    def _key(self, credential: str) -> tuple[bytes, str] | None:
        ns, _, request_tag = credential.partition(".")
        entry = self._sessions.get(ns)
        if entry is None or time.monotonic() - entry[1] > SESSION_TTL_S:
            self._sessions.pop(ns, None)
            return None
        self._sessions[ns] = (entry[0], time.monotonic())
        self._sessions.move_to_end(ns)
        return entry[0], request_tag

    def verify(self, credential: str, method: str, path: str) -> bool:
        """Whether `credential` (`Authorization: Peer ...`) opens `method path`."""
        found = self._key(credential)
        return found is not None and hmac.compare_digest(
            found[1].encode(), tag(found[0], "request", method, path).encode())

    def seal(self, credential: str, path: str, body: bytes | bytearray) -> dict[str, str]:
        """The tag header of an answer to a peer (none for an admin caller)."""
        found = self._key(credential)
        return {} if found is None else {MAC_HEADER: tag(found[0], "response", path, body)}


class PeerSession:
    """The catching-up side of one peer, once it proved it holds the token."""

    def __init__(self, url: str, key: bytes, ns: str) -> None:
        self.url, self._key, self._ns = url, key, ns

    @classmethod
    async def open(cls, http: httpx.AsyncClient, url: str, token: str) -> PeerSession:
        """Challenge `url`; its answer is read up to `ANSWER_BYTES`, as sent."""
        nc = secrets.token_bytes(NONCE_BYTES)
        body = bytearray()
        async with http.stream("POST", url + CHALLENGE_PATH, json={"nonce": nc.hex()}) as r:
            async for chunk in r.aiter_raw():
                body += chunk
                if len(body) > ANSWER_BYTES:
                    raise PeerRefused(f"{url}: a challenge answer over {ANSWER_BYTES} bytes")
        try:
            answer = json.loads(body) if r.status_code == 200 else {}
        except ValueError:
            answer = {}
        ns = _nonce(answer.get("nonce")) if isinstance(answer, dict) else None
        proof = answer.get("proof") if ns is not None else None
        if ns is None or not isinstance(proof, str) or not hmac.compare_digest(
                proof.encode(), _derive(token, b"server", nc, ns).hex().encode()):
            raise PeerRefused(f"{url} did not prove it holds this fleet's admin token "
                              f"(challenge: {r.status_code})")
        return cls(url, _derive(token, b"session", nc, ns), ns.hex())

    def headers(self, method: str, path: str) -> dict[str, str]:
        return {"Authorization": f"{SCHEME} {self._ns}.{tag(self._key, 'request', method, path)}"}

    def check(self, path: str, body: bytes | bytearray, sealed: str | None) -> None:
        """Raise `PeerRefused` unless `sealed` is this session's tag of `body`."""
        if sealed is None or not hmac.compare_digest(
                sealed.encode(), tag(self._key, "response", path, body).encode()):
            raise PeerRefused(f"{self.url}{path}: the answer fails its tag (not from the peer "
                              "that proved the token, or changed on the way)")
