"""Server settings: environment (`ROLLOUT_SIDECAR_*`), then CLI flags on top."""

from __future__ import annotations

import json
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

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
ServeDtype = Literal["auto", "bfloat16", "float16", "float32"]
# vLLM 0.32's online quantization of an unquantized checkpoint, by its names.
Quantization = Literal["fp8_per_tensor", "fp8_per_block", "fp8_per_channel",
                       "int8_per_channel_weight_only"]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
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


class ServerSettings(BaseSettings):
    """Everything `rollout-sidecar serve` can be told.

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
    model: str | None = Field(
        None, description="A local HF checkpoint dir or a Hugging Face hub id (resolved as "
        "vLLM does: HF_HOME cache, HF_HUB_OFFLINE honoured); unset serves the embedded default "
        "model."
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "rollout-sidecar",
        description="Where the embedded default model is built once.",
    )
    dtype: ServeDtype = Field(
        "bfloat16", description="Serving dtype; pushes are cast to it. Ours is bfloat16 where "
        "vLLM's is auto: RL trainers compute in bf16 mixed precision, and a checkpoint saved "
        "in fp32 would otherwise be served at twice the memory. float32 makes served logprobs "
        "reproduce a trainer's fp32 forward exactly.")
    quantization: Quantization | None = Field(
        None, description="Serve quantized, as vLLM's --quantization does to an unquantized "
        "checkpoint: every push is re-quantized by vLLM's layerwise reload exactly as a fresh "
        "load quantizes the same weights (docs/fast-rollouts.md). vLLM 0.32: the fp8 schemes "
        "need a GPU (fp8_per_block: or an AMX CPU); int8_per_channel_weight_only quantizes "
        "MoE experts only (linear layers stay in the serving dtype) and needs AMX on x86. "
        "Serving dtype bfloat16 or float16: vLLM quantizes online from those only.")
    speculative_config: str | None = Field(
        None, description="Speculative decoding, as vLLM's --speculative-config: a JSON "
        "object, e.g. {\"method\": \"draft_model\", \"model\": \"/ckpt/draft\", "
        "\"num_speculative_tokens\": 3}. A drafter with a checkpoint of its own (a local "
        "dir) takes pushes with the target, in the same commit; one a push leaves out is "
        "reported frozen (docs/fast-rollouts.md). vLLM 0.32 on CPU runs draft_model, ngram "
        "and the EAGLE family.")
    lm_head_fp32: bool = Field(
        False,
        description="Compute the lm_head's logits in float32 over the serving-dtype body "
        "(vLLM's head_dtype): removes most of the bf16 train/rollout logprob mismatch "
        "(ScaleRL, MiniMax-M1). Compute your trainer's head in fp32 too. Costs a cast of "
        "the head's weight per step on CPU; free on CUDA.",
    )
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="What sampled-token logprobs are (vLLM's logprobs_mode). "
        "raw_logprobs: log-softmax of the model's logits, the distribution a trainer's plain "
        "forward computes. processed_logprobs: log-softmax of the logits vLLM sampled from, "
        "after penalties, logit bias, bad words, temperature, min_p and top-k/top-p (tokens "
        "masked out are -inf); TRL's GRPO importance-sampling correction expects it (its "
        "forward divides the logits by the temperature). Prompt logprobs are raw in both.")
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + completion in tokens. Unset: the model's "
        "own (as vLLM), lowered only if the KV cache cannot hold one such sequence.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory for weights + KV cache. Unset, on a GPU: vLLM's "
        "0.9 less what a push needs outside it (2 GiB of receive and load scratch, plus the "
        "model with weight_staging=device), divided by the GPU's memory; lower it when the "
        "GPU is shared with a trainer. On CPU, given explicitly: the share of host memory "
        "vLLM-CPU reserves for its worker (the KV cache is that less the worker's RSS), "
        "unless kv_cache_gib or VLLM_CPU_KVCACHE_SPACE is set; unset, the KV cache is sized "
        "to the model (kv_cache_gib).",
    )
    kv_cache_gib: float | None = Field(
        None, gt=0, description="KV cache per worker, GiB (vLLM's kv_cache_memory_bytes); wins "
        "over VLLM_CPU_KVCACHE_SPACE (removed from the engine's environment) and, on a GPU, "
        "over gpu_memory_utilization's KV sizing. Unset, on CPU: VLLM_CPU_KVCACHE_SPACE if "
        "set, else vLLM's host share if gpu_memory_utilization is given, else sized to the "
        "model: 2 x layers x KV heads x head dim x dtype bytes per token, times "
        "min(max_num_seqs, 8) x max_model_len in whole blocks, capped at 0.3 of host memory "
        "(docs/deploy.md, \"KV cache on CPU\"). Unset, on a GPU: what "
        "gpu_memory_utilization leaves.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences batched at once (vLLM's "
                              "default on most GPUs).")
    max_sequences_per_request: int = Field(
        4096, ge=1, description="Cap on prompts x n in one /generate request (400 above it), "
        "so one request cannot queue work for minutes.")
    max_prompt_bytes: int | None = Field(
        None, ge=1, description="Longest prompt string in bytes, checked before tokenising; "
        "default 32 bytes per token of max_model_len.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs (or CPU worker processes) one copy of the model is split "
        "over; every worker joins the weight data plane and loads its own shard of a push.")
    nnodes: int = Field(
        1, ge=1, description="Hosts one engine spans with vLLM's multiprocessing executor "
        "(vLLM's --nnodes): this server runs on the first (node_rank 0) and serves; every "
        "other host runs `serve --headless` with the same settings and its own node_rank "
        "(docs/deploy.md, \"Several hosts\").")
    node_rank: int = Field(0, ge=0, description="This host's rank among nnodes (vLLM's "
                           "--node-rank); 0 serves, the others run --headless.")
    master_addr: str = Field(
        "127.0.0.1", description="With nnodes > 1: node 0's address, reachable from every "
        "node (vLLM's --master-addr); the workers on other hosts also meet the data plane's "
        "store there.")
    master_port: int = Field(29501, ge=1, le=65535, description="With nnodes > 1: the port "
                             "torch.distributed meets on at master_addr (vLLM's "
                             "--master-port).")
    headless: bool = Field(
        False, description="Run only this host's workers of an engine served by node 0 "
        "(nnodes > 1, node_rank > 0): no HTTP, no API; exits when its workers do.")
    head_gone_s: float = Field(
        60.0, gt=0, description="With --headless: how long node 0 may not answer before this "
        "host's workers stop (exit 0), so that a supervisor restarts them against the next "
        "node 0. Long enough to ride out a network blip; a node 0 that restarted serves "
        "with a new engine, which these workers are not part of.")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="vLLM's executor: mp (processes, one host or, with nnodes, "
        "several) or ray (a Ray cluster's actors, across hosts; extra `ray`). Unset: vLLM's "
        "choice.")
    data_plane_advertise_host: str | None = Field(
        None, description="The address this server's workers reach its data-plane store "
        "at, when some run on other hosts (nnodes > 1, Ray). Unset: master_addr with "
        "nnodes > 1, else VLLM_HOST_IP or this host's routable address (as vLLM finds it).")
    enforce_eager: bool | None = Field(
        None, description="Skip CUDA graph capture and compilation. Unset: false on a GPU "
        "(CUDA graphs, as vLLM), true on CPU (a server starts in seconds, not after minutes "
        "of compilation).")
    seed: int = Field(0, description="Engine seed.")
    enable_lora: bool = Field(
        False, description="Accept LoRA adapter pushes (`WeightPusher.push(peft_model, v)` "
        "then sends the adapter, not the merged model): vLLM's LoRA layers wrap the model, "
        "which costs some decode speed, so it is off unless asked for.")
    max_lora_rank: int = Field(64, ge=1, le=512, description="The largest adapter rank "
                               "accepted (vLLM sizes its LoRA buffers for it).")
    lora_keep: int = Field(
        3, ge=1, le=64, description="Adapter versions kept loaded: requests admitted under "
        "an older version finish on its adapter while newer ones serve the newest.")

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
    engine_wait: Literal["nap", "spin"] = Field(
        "nap", description="CPU only: how vLLM's engine core and workers wait for their next "
        "message. nap: sleep ~0.1 ms between checks, which frees the GIL for the data plane "
        "and avoids the sched_yield loop that stalled a process on a core shared by two "
        "replicas; spin: vLLM's own loop for 1 s after each message, which hands its core "
        "over to a CPU-bound process pinned to it more readily. A GPU server always waits as "
        "vLLM does.")
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
        600.0, gt=0, description="Longest a catch-up from a peer may take; after it this "
        "replica reports ready on the weights it has, and the trainer's next push brings it "
        "up to date.")
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

    @field_validator("speculative_config")
    @classmethod
    def _json_object(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from e
        if not isinstance(parsed, dict) or not ({"method", "model"} & parsed.keys()):
            raise ValueError("a JSON object naming at least `method` or `model`, as vLLM's "
                             "--speculative-config")
        return value

    @property
    def speculative(self) -> dict[str, Any] | None:
        """`speculative_config` parsed, as vLLM's engine args take it."""
        return json.loads(self.speculative_config) if self.speculative_config else None

    @field_validator("quantization", "speculative_config", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value  # compose passes an unset variable as ""

    @field_validator("quantization")
    @classmethod
    def _quantized_from_16_bits(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("dtype") == "float32":
            raise ValueError(f"{value} quantizes online from bfloat16 or float16 weights "
                             "(vLLM refuses float32): serve with --dtype bfloat16")
        return value

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
