"""Who may call a route (server/auth.py), without a server: a token as a
Bearer token or as the password of HTTP Basic auth (clients that carry
credentials only in ~/.netrc, as SkyRL's weight client); an empty or
whitespace credential never matches; the API token never opens an admin
route; a peer's proof opens the peer routes only, for its own method and
path. Tokens that are empty or carry white space are refused at start,
naming the variable (server/config.py). The app-wide matrix over every
served route is tests/e2e/test_route_access.py."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from pydantic import SecretStr, ValidationError

from rollout_sidecar.server.auth import Access, authorize
from rollout_sidecar.server.config import ServerSettings
from rollout_sidecar.server.weights.peer_auth import PeerAnswerer, _derive, tag

ADMIN, API = "admin-secret-0123", "api-secret-4567"


def settings(admin: str | None = ADMIN, api: str | None = API) -> SimpleNamespace:
    return SimpleNamespace(admin_token=SecretStr(admin) if admin is not None else None,
                           api_token=SecretStr(api) if api is not None else None)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def check(access: Access, header: str | None, s: SimpleNamespace | None = None,
          peers: PeerAnswerer | None = None, method: str = "GET", path: str = "/x") -> int:
    """The status `authorize` gives (200: let through)."""
    headers = {"authorization": header} if header is not None else {}
    try:
        authorize(access, headers, s or settings(), peers, method, path)
    except HTTPException as e:
        return e.status_code
    return 200


@pytest.mark.parametrize("header", [f"Bearer {ADMIN}", basic("skyrl", ADMIN), basic("", ADMIN),
                                    f"bearer  {ADMIN} "])
def test_the_admin_token_as_bearer_or_basic_password_passes(header):
    assert check(Access.ADMIN, header) == 200
    assert check(Access.PEER, header) == 200


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Bearer    ", "Bearer nope",
                                    basic(ADMIN, "nope"), basic("u", ""), basic("u", "   "),
                                    "Basic !!notbase64", f"Token {ADMIN}", f"Bearer {API}",
                                    basic("u", API), f"Peer {ADMIN}"])
def test_anything_else_is_a_401_on_admin_routes(header):
    assert check(Access.ADMIN, header) == 401


def test_weight_routes_are_off_without_an_admin_token_and_open_routes_need_nothing():
    assert check(Access.ADMIN, f"Bearer {ADMIN}", settings(admin=None)) == 403
    assert check(Access.OPEN, None) == 200


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer ", basic("u", ""), "Bearer nope"])
def test_the_generate_routes_want_their_token_when_there_is_one(header):
    assert check(Access.API, f"Bearer {API}") == 200
    assert check(Access.API, basic("u", API)) == 200
    assert check(Access.API, header) == 401
    assert check(Access.API, header, settings(api=None)) == 200  # unset: open


@pytest.mark.parametrize("value, why", [("", "set but empty"), ("   ", "set but empty"),
                                        ("abc\n", "white space"), ("a b", "white space")])
@pytest.mark.parametrize("variable", ["ROLLOUT_SIDECAR_ADMIN_TOKEN",
                                      "ROLLOUT_SIDECAR_API_TOKEN"])
def test_an_empty_or_whitespace_token_is_refused_at_start_naming_it(monkeypatch, variable,
                                                                     value, why):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as e:
        ServerSettings()
    assert variable in str(e.value) and why in str(e.value) and "openssl rand" in str(e.value)


def test_failpoints_in_the_environment_without_the_flag_refuse_the_start(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_SIDECAR_FAILPOINTS", str(tmp_path / "f"))
    with pytest.raises(ValidationError, match="armed only by `serve --failpoints FILE`"):
        ServerSettings()
    assert ServerSettings(failpoints=tmp_path / "f").failpoints == tmp_path / "f"
    monkeypatch.delenv("ROLLOUT_SIDECAR_FAILPOINTS")
    # A flag only: the environment never arms them.
    monkeypatch.setenv("ROLLOUT_SIDECAR_FAILPOINTS_FILE", str(tmp_path / "f"))
    assert ServerSettings().failpoints is None


def peer_credential(answerer: PeerAnswerer, token: str, method: str, path: str) -> str:
    """What a catching-up replica holding `token` sends (peer_auth.PeerSession);
    the answerer's proof checks out only if it holds `token` too."""
    nc = bytes(range(32))
    answer = answerer.challenge(nc.hex())
    assert answer is not None
    ns = bytes.fromhex(answer["nonce"])
    proven = answer["proof"] == _derive(token, b"server", nc, ns).hex()
    assert proven == (token == ADMIN)
    key = _derive(token, b"session", nc, ns)
    return f"Peer {answer['nonce']}.{tag(key, 'request', method, path)}"


def test_a_peer_proof_opens_its_own_route_on_peer_routes_only():
    peers = PeerAnswerer(ADMIN)
    good = peer_credential(peers, ADMIN, "GET", "/weights/staged/0")
    assert check(Access.PEER, good, peers=peers, path="/weights/staged/0") == 200
    assert check(Access.PEER, good, peers=peers, path="/weights/staged/1") == 401
    assert check(Access.PEER, good, peers=peers, method="POST", path="/weights/staged/0") == 401
    assert check(Access.ADMIN, good, peers=peers, path="/weights/staged/0") == 401
    # Someone without the token answers the challenge's proof wrong and tags wrong.
    forged = peer_credential(peers, "not-the-token-9", "GET", "/weights/staged/0")
    assert check(Access.PEER, forged, peers=peers, path="/weights/staged/0") == 401
    assert check(Access.PEER, "Peer unknown.00", peers=peers, path="/weights/staged/0") == 401
    assert peers.challenge("zz" * 32) is None and PeerAnswerer(None).challenge("00" * 32) is None
