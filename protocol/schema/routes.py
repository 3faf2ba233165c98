"""Every HTTP route the server serves, in one table: its method, its path,
who may call it, and the types of its body and its answer where they are
ours. The server's routers are declared from it (server/routes.py), the
trainer's admin client, the peer catch-up and the generation client call
through it, the front door labels its metrics by its paths, and a test
holds the served app, this table and docs/api.md's route list to each other
(tests/test_route_table_units.py). A new route is one row here, one handler
in its feature's router, and one line in docs/api.md.

`request` / `response` are None where the body is not one of our models:
bytes (a bucket), vLLM's or SkyRL's own types, or a route that answers a
bare dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, SecretStr

from rollout_sidecar.protocol.schema import generate_api as g
from rollout_sidecar.protocol.schema import status_api as st
from rollout_sidecar.protocol.schema import weights_api as w


class Access(str, Enum):
    """Who may call a route (server/auth.py checks it)."""

    OPEN = "open"  # probes, scrapes, the peer challenge: no credential
    API = "api"  # the generate token; open when the server has none
    ADMIN = "admin"  # the admin token
    PEER = "peer"  # the admin token, or a peer's proof that it holds it


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # FastAPI's template: /weights/bucket/{index}
    access: Access
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    in_schema: bool = True  # in /openapi.json (SkyRL's and vLLM's shapes are not ours)

    def body(self, req: BaseModel) -> dict:
        """`req` as this route's JSON body: the fields the caller set, no
        nulls, no defaults (the server fills in the same model's defaults, and
        one that predates a field refuses it even at its default), secrets in
        clear (only a body carries them: never a log line or an error)."""
        if self.request is None or not isinstance(req, self.request):
            raise TypeError(f"{self.method} {self.path} takes "
                            f"{getattr(self.request, '__name__', 'no model')}, not "
                            f"{type(req).__name__}")
        out = req.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        for name in out:
            if isinstance(value := getattr(req, name), SecretStr):  # dumped as "**********"
                out[name] = value.get_secret_value()
        return out

    def url(self, **params: object) -> str:
        """The path with its parameters filled in: BUCKET.url(index=3)."""
        return self.path.format(**params)


# Probes and scrapes: open, answered in the HTTP process.
HEALTH = Route("GET", "/health", Access.OPEN, response=g.HealthResponse)
READY = Route("GET", "/ready", Access.OPEN, response=g.HealthResponse)
METRICS = Route("GET", "/metrics", Access.OPEN)

# Generation (the generate token).
GENERATE = Route("POST", "/generate", Access.API, g.GenerateRequest, g.GenerateResponse)
INFO = Route("GET", "/info", Access.API, response=g.InfoResponse)
CHAT_COMPLETIONS = Route("POST", "/v1/chat/completions", Access.API, in_schema=False)
COMPLETIONS = Route("POST", "/v1/completions", Access.API, in_schema=False)
MODELS = Route("GET", "/v1/models", Access.API, in_schema=False)
TOKENS_GENERATE = Route("POST", "/inference/v1/generate", Access.API, in_schema=False)

# The push's control plane (the admin token; what a catching-up peer reads
# also takes its proof, and the challenge that starts the proof is open).
PEER_CHALLENGE = Route("POST", "/weights/peer/challenge", Access.OPEN)
STATUS = Route("GET", "/weights/status", Access.PEER, response=st.WeightStatus)
INDEX = Route("GET", "/weights/index", Access.ADMIN, response=st.WeightIndex)
PROBE = Route("POST", "/weights/probe", Access.ADMIN, w.ProbeRequest, w.ProbeResult)
CONNECT = Route("POST", "/weights/connect", Access.ADMIN, w.ConnectRequest, w.ConnectResponse)
DISCONNECT = Route("POST", "/weights/disconnect", Access.ADMIN, w.DisconnectRequest,
                   w.DisconnectResponse)
BEGIN = Route("POST", "/weights/begin", Access.ADMIN, w.BeginRequest, w.BeginResponse)
BUCKET = Route("PUT", "/weights/bucket/{index}", Access.ADMIN)  # the bucket's bytes
PREPARE = Route("POST", "/weights/prepare", Access.ADMIN, w.PrepareRequest, w.PrepareResponse)
COMMIT = Route("POST", "/weights/commit", Access.ADMIN, w.CommitRequest, w.CommitResponse)
ABORT = Route("POST", "/weights/abort", Access.ADMIN, w.AbortRequest, w.LastPush)
STAGED = Route("GET", "/weights/staged", Access.PEER, response=st.StagedCopy)
STAGED_BUCKET = Route("GET", "/weights/staged/{index}", Access.PEER)  # the bucket's bytes
# A replica's leave (a Kubernetes preStop: `rollout-sidecar drain`).
DRAIN = Route("POST", "/drain", Access.ADMIN, st.DrainRequest, st.DrainResponse)

# SkyRL's RemoteInferenceClient (server/skyrl_api): control calls take the
# generate token, its delta weight sync the admin token.
SKYRL_WORLD_SIZE = Route("GET", "/get_world_size", Access.API, in_schema=False)
SKYRL_PAUSE = Route("POST", "/pause", Access.API, in_schema=False)
SKYRL_RESUME = Route("POST", "/resume", Access.API, in_schema=False)
SKYRL_SLEEP = Route("POST", "/sleep", Access.API, in_schema=False)
SKYRL_WAKE_UP = Route("POST", "/wake_up", Access.API, in_schema=False)
SKYRL_IS_SLEEPING = Route("GET", "/is_sleeping", Access.API, in_schema=False)
SKYRL_RESET_PREFIX_CACHE = Route("POST", "/reset_prefix_cache", Access.API, in_schema=False)
SKYRL_INIT_TRANSFER = Route("POST", "/init_weight_transfer_engine", Access.ADMIN,
                            in_schema=False)
SKYRL_FETCH = Route("POST", "/fetch_weights", Access.ADMIN, in_schema=False)
SKYRL_START_UPDATE = Route("POST", "/start_weight_update", Access.ADMIN, in_schema=False)
SKYRL_UPDATE = Route("POST", "/update_weights", Access.ADMIN, in_schema=False)
SKYRL_FINISH_UPDATE = Route("POST", "/finish_weight_update", Access.ADMIN, in_schema=False)

ROUTES: tuple[Route, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Route))
