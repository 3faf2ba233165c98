"""Server settings: environment (`ROLLOUT_SIDECAR_*`), then CLI flags on top."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from rollout_sidecar.protocol.schema import CommitPolicy
from rollout_sidecar.server.engine_settings import EngineSettings

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
ENV_PREFIX = "ROLLOUT_SIDECAR_"
# Settings a flag alone sets, never the environment: arming failpoints must be
# a deliberate act of whoever starts a server for tests (protocol/failpoints.py).
FLAG_ONLY = {"failpoints"}
MAKE_TOKEN = "make one with `openssl rand -hex 32`"


class _EnvWithoutFlagOnly(PydanticBaseSettingsSource):
    """The environment's settings, less the flag-only ones."""

    def __init__(self, settings_cls: type[BaseSettings], env: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self.env = env

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self.env().items() if k not in FLAG_ONLY}


class ServerSettings(EngineSettings, BaseSettings):
    """Everything `rollout-sidecar serve` can be told: the engine's settings
    (engine_settings.py) and the server's own, here.

    Tokens are `SecretStr` so they never print in a repr, a log line or /info.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvWithoutFlagOnly(settings_cls, env_settings),
                dotenv_settings, file_secret_settings)

    host: str = Field("127.0.0.1", description="HTTP bind address. Ours is loopback where "
                      "vLLM binds all interfaces: a sidecar talks to its trainer over "
                      "localhost, and exposing it is a choice (the chart sets 0.0.0.0).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    http_fd: int | None = Field(
        None, ge=0, description="Serve on this inherited TCP socket instead of binding `port` "
        "(socket activation: a supervisor that picked the port holds it until the server "
        "serves).")
    data_plane_advertise_host: str | None = Field(
        None, description="The address this server's workers reach its data-plane store "
        "at, when some run on other hosts (nnodes > 1, Ray). Unset: master_addr with "
        "nnodes > 1, else VLLM_HOST_IP or this host's routable address (as vLLM finds it).")

    max_sequences_per_request: int = Field(
        4096, ge=1, description="Cap on prompts x n in one /generate request (400 above it), "
        "so one request cannot queue work for minutes.")
    max_prompt_bytes: int | None = Field(
        None, ge=1, description="Longest prompt string in bytes, checked before tokenising; "
        "default 32 bytes per token of max_model_len.")
    api_token: SecretStr | None = Field(
        None, description="Bearer token for /generate, /info and the OpenAI routes (/v1/*); "
        "/health, /ready and /metrics stay open. Unset: open. Set but empty, or with "
        "white space in it: the server refuses to start."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token for /weights/* and the other weight-changing routes. Must "
        "differ from api_token. Unset: weight routes refuse every call. Set but empty, or "
        "with white space in it: the server refuses to start.",
    )
    max_request_bytes: int = Field(
        64 << 20, ge=4096, description="The largest request body any route takes, checked "
        "after the token and before the body is read (413 above it). A bucket over HTTP is "
        "bounded by its manifest entry instead.")
    require_data_plane_secret: bool = Field(
        False, description="Refuse a /weights/connect that brings no data-plane secret "
        "(every rendezvous value is then signed; WeightPusher always sends one). The chart "
        "turns it on.")
    require_bucket_macs: bool = Field(
        False, description="Refuse a /weights/connect whose buckets carry no keyed tag "
        "(bucket_macs): every bucket is then proven to come from the trainer that holds the "
        "connection's secret. WeightPusher tags its buckets for servers that require it "
        "(it reads this from /weights/status). The chart turns it on.")
    weight_sync_root: Path | None = Field(
        None, description="SkyRL's delta weight sync: the directory its deltas are published "
        "under (the store trainer and servers share); /fetch_weights reads nothing outside "
        "it. Unset: SkyRL's fetch is refused (docs/skyrl.md).")
    failpoints: Path | None = Field(
        None, description="Tests only, and a flag only (never read from the environment): "
        "arm the failpoints this file names (protocol/failpoints.py), which can make the "
        "server serve weights nobody pushed. A server started with it says so in its log; "
        "one started with ROLLOUT_SIDECAR_FAILPOINTS in its environment and no flag refuses "
        "to start.")

    openai_args: str = Field(
        "", description="Extra `vllm serve` frontend flags for the OpenAI routes (/v1/*), "
        "parsed by vLLM's own parser, e.g. '--chat-template FILE' or "
        "'--enable-auto-tool-choice --tool-call-parser hermes'. Engine flags here have no "
        "effect: the engine is configured by the settings above."
    )

    commit_policy: CommitPolicy = Field(
        "wait", description="In-flight requests at a weight commit: wait (finish on the old "
        "weights first) | abort (end them) | keep (continue on the new weights, which "
        "prefill prompt and tokens so far again) | resume (keep by its other name)."
    )
    data_plane_port: int = Field(
        29600, ge=0, le=65535, description="TCPStore port trainers rendezvous on (gloo/NCCL)."
    )
    weight_staging: Literal["auto", "host", "device"] = Field(
        "auto", description="Where a distributed push's buckets wait for the commit. host: "
        "host memory (pinned on a GPU server), outside the GPU budget; device: GPU memory, "
        "faster to load but a second copy of the model outside gpu_memory_utilization (a "
        "0.9-utilisation server runs out of memory); auto: host. gloo always stages on host.")
    share_host_staging: bool | None = Field(
        None, description="With TP > 1 and host staging, the workers of an engine that see "
        "one /dev/shm share one staged copy there: the first receives each push and the "
        "others read their shards from it, so a host holds one copy, not one per worker. "
        "/dev/shm must hold the push plus 5% (Docker's default is 64 MB; docs/deploy.md, "
        "\"Sizing /dev/shm\"), which is checked at start. Unset: shared where it fits, else "
        "per worker with a warning naming the size needed; true: required (the server "
        "refuses to start where it does not fit); false: every worker receives and keeps "
        "its own.")
    data_plane_host: str | None = Field(
        None, description="Address the data-plane TCPStore listens on; default: `host`."
    )
    data_plane_fd: int | None = Field(
        None, ge=0, description="The data plane's TCPStore listens on this inherited TCP "
        "socket instead of binding `data_plane_port` (as `http_fd`).")
    push_timeout_s: float = Field(
        300.0, gt=0, description="The one deadline of a push, begin to commit; trainers "
        "read it from /weights/status to bound their begin, prepare, commit and probe calls "
        "(plus commit_drain_s); their data plane times out on their own stall_timeout_s."
    )
    commit_drain_s: float = Field(
        30.0, ge=0, description="Policy wait: how long a commit waits for in-flight requests "
        "before it aborts them; no request is held at the gate longer than this plus the load."
    )
    peers: str | None = Field(
        None, description="Replicas of this model to catch up from at start: comma-separated "
        "URLs, or dns+http://name:port for every address of a headless Service. A replica that "
        "starts while they serve a newer version takes it from the healthiest before it reports "
        "ready, through the same check and commit as a push (docs/replicas.md); they share "
        "this server's admin token.")
    catch_up_timeout_s: float = Field(
        600.0, gt=0, description="Longest a catch-up from a peer may take. One that fails "
        "while a peer serves a newer version leaves this replica not ready, refusing "
        "generation, until a push commits on it; one that finds nothing newer serves the "
        "checkpoint.")
    connection_lease_s: float = Field(
        30.0, ge=0, description="A trainer's data-plane connection is its own for this long "
        "after its last push call, or for the trainer's own stall bound if that is shorter; "
        "another trainer's connect is refused within it (or takes over with takeover=true)."
    )
    connect_timeout_max_s: float = Field(
        300.0, gt=0, description="Cap on how long /weights/connect waits for the trainer to "
        "join the data-plane group."
    )
    min_version_wait_s: float = Field(
        60.0, ge=0, description="How long /generate waits for min_weight_version before 409."
    )
    drain_timeout_s: float = Field(60.0, ge=0, description="SIGTERM: time to finish requests.")
    log_level: LogLevel = Field("info", description="Server and uvicorn log level.")

    @field_validator("api_token", "admin_token")
    @classmethod
    def _a_real_token(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        """An empty token (an empty key in a Secret, `export X=`) or one with
        white space (a Secret made from a file ends with a newline) is a
        mistake, never a token: refused at start, naming the variable."""
        if value is None:
            return None
        token, env = value.get_secret_value(), ENV_PREFIX + str(info.field_name).upper()
        unset = ("unset it to leave the generate routes open" if info.field_name == "api_token"
                 else "unset, the weight routes refuse every call")
        if not token.strip():
            raise ValueError(f"{env} is set but empty: {MAKE_TOKEN} ({unset})")
        if any(c.isspace() for c in token):
            raise ValueError(f"{env} has white space in it (a Secret made from a file keeps "
                             f"its newline: use --from-literal): {MAKE_TOKEN}")
        return value

    @model_validator(mode="after")
    def _tokens_differ(self) -> ServerSettings:
        api = self.api_token.get_secret_value() if self.api_token else None
        admin = self.admin_token.get_secret_value() if self.admin_token else None
        if admin is not None and admin == api:
            raise ValueError("admin_token must differ from api_token")
        return self

    @model_validator(mode="after")
    def _failpoints_by_flag_only(self) -> ServerSettings:
        from rollout_sidecar.protocol.failpoints import ENV

        if self.failpoints is None and os.environ.get(ENV):
            raise ValueError(f"{ENV} is set, but failpoints are armed only by `serve "
                             "--failpoints FILE`, in a server started for tests: unset it")
        return self
