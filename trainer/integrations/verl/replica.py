"""verl's rollout replicas as rollout-sidecar servers (verl 0.9.1).

verl's agent loop reaches an engine through a Ray actor handle:
`LLMServerClient.generate` calls `server.generate.remote(request_id,
prompt_ids, sampling_params, ...)` and reads a `TokenOutput`. Here that
actor (`SidecarServer`) is a thin one: each call is one `POST /generate` to
a sidecar replica that the user runs (compose, the chart, by hand), and no
engine is started by verl. Set `actor_rollout_ref.rollout.name=rollout_sidecar`
and $ROLLOUT_SIDECAR_URL (several replicas comma-separated: replica i of
verl's is server i mod n; verl's load balancer spreads requests over them).

What each `TokenOutput` carries besides tokens and logprobs:
`extra_fields["global_steps"]`, the version that sampled the first token,
and `min_global_steps`/`max_global_steps`, the first and last versions that
sampled any (a push may commit while a sample runs: the server tags every
token, and verl's staleness check reads these); `weight_versions`, the
spans themselves.

verl calls sleep, wake_up, the KV-cache methods and abort around its own
weight syncs, to free the GPU its engines share with the trainer. The
sidecar's memory is its own and a push never exposes a half-loaded model,
so those calls do nothing; `abort_all_requests` leaves requests running
(they finish on the weights they were admitted under, and say so).
"""

from __future__ import annotations

import os
from typing import Any

from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from rollout_sidecar.client import AsyncGenerationClient

NAME = "rollout_sidecar"


def sampling(params: dict[str, Any], prompt_len: int, prompt_length: int,
             response_length: int) -> dict[str, Any]:
    """verl's sampling params as /generate's: no `max_tokens` comes from verl,
    so it is the rollout's `response_length`, within the model's window as
    verl's vLLM server computes it; top_k -1 (off) is 0 here."""
    unknown = set(params) - {"temperature", "top_p", "top_k", "repetition_penalty",
                             "logprobs", "seed", "max_tokens"}
    if unknown:
        raise ValueError(f"sampling params not served by rollout-sidecar: {sorted(unknown)}")
    if params.get("repetition_penalty", 1.0) != 1.0:
        raise ValueError("repetition_penalty is not served by rollout-sidecar")
    top_k = int(params.get("top_k", -1))
    out = dict(temperature=float(params.get("temperature", 1.0)),
               top_p=float(params.get("top_p", 1.0)), top_k=max(top_k, 0),
               logprobs=bool(params.get("logprobs", False)),
               max_tokens=params.get("max_tokens") or max(1, min(
                   response_length, prompt_length + response_length - prompt_len)))
    if params.get("seed") is not None:
        out["seed"] = int(params["seed"])
    return out


class SidecarServer:
    """The Ray actor verl's agent loop calls: one sidecar replica (or a list,
    which the client fails over between)."""

    def __init__(self, url: str, prompt_length: int, response_length: int) -> None:
        self.url = url
        self.lengths = prompt_length, response_length
        self.client = AsyncGenerationClient(url)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                       request_id: str, image_data: Any = None, video_data: Any = None,
                       **kwargs: Any) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data"):
            raise ValueError("multimodal inputs are not served by rollout-sidecar")
        res = await self.client.generate(prompt_token_ids=[list(prompt_ids)],
                                         sampling=sampling(sampling_params, len(prompt_ids),
                                                           *self.lengths),
                                         session_key=request_id)
        sample = res.results[0].samples[0]
        spans = sample.weight_versions or []
        versions = [s.version for s in spans if s.end > s.start] or [res.weight_version]
        return TokenOutput(
            token_ids=sample.token_ids, log_probs=sample.logprobs,
            stop_reason="completed", num_preempted=res.results[0].restarts,
            extra_fields={"global_steps": versions[0], "min_global_steps": min(versions),
                          "max_global_steps": max(versions),
                          "weight_versions": [s.model_dump() for s in spans]})

    # verl's control calls on `replica.servers`: see the module docstring.
    async def wake_up(self) -> None: ...
    async def sleep(self) -> None: ...
    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def resume_generation(self) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def set_global_steps(self, global_steps: int) -> None: ...


def sidecar_urls() -> list[str]:
    urls = [u.strip() for u in os.environ.get("ROLLOUT_SIDECAR_URL", "").split(",") if u.strip()]
    if not urls:
        raise RuntimeError("rollout.name=rollout_sidecar needs $ROLLOUT_SIDECAR_URL: the "
                           "sidecar servers' URLs, comma-separated")
    return urls


class SidecarReplica(RolloutReplica):
    """A verl rollout replica that is a sidecar server: nothing to place on
    GPUs, nothing to launch but the thin actor."""

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE  # no placement group: no engine here
        await self.launch_servers()

    async def init_hybrid(self, worker_group: Any) -> None:
        self.rollout_mode = RolloutMode.HYBRID  # the trainer's GPUs stay the trainer's
        await self.launch_servers()

    async def launch_servers(self) -> None:
        import ray

        urls = sidecar_urls()
        url = urls[self.replica_rank % len(urls)]
        # The API token is read in the actor's process ($ROLLOUT_SIDECAR_API_TOKEN,
        # as Ray workers inherit it, or the cluster's env): never in Ray's args.
        actor = ray.remote(SidecarServer).options(
            name=f"rollout_sidecar_{self.replica_rank}_{os.getpid()}",
        ).remote(url, self.config.prompt_length, self.config.response_length)
        self.servers = [actor]
        self._server_handle = actor
        self._server_address = f"{url}#{self.replica_rank}"  # verl's balancer keys by it
