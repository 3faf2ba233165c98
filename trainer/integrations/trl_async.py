"""TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo`, TRL 1.16)
on rollout-sidecar: our data plane instead of its NCCL weight transfer, and
each sample's version from our spans instead of its own counter.

    from rollout_sidecar.trainer.integrations.trl_async import SidecarAsyncGRPOTrainer
    trainer = SidecarAsyncGRPOTrainer(model=path, reward_funcs=..., args=AsyncGRPOConfig(
        vllm_server_base_url=url, ...), train_dataset=dataset)

The URL is the config's `vllm_server_base_url` (or `url=`); the tokens come
from $ROLLOUT_SIDECAR_API_TOKEN and $ROLLOUT_SIDECAR_ADMIN_TOKEN (or the
arguments). What changes against TRL's own trainer:

* **Weights.** TRL pauses vLLM, streams every parameter from rank 0 over NCCL
  and resumes (`_sync_weight_merged`). Here every rank calls
  `WeightPusher.push` at the same point (a collective: FSDP gathers, one
  all-or-nothing commit with policy `keep`, the probe), so rollouts in flight
  continue on the new weights and their spans say where. The versions are
  ours: the served version + 1, + 2, ... (a version names the same weights on
  every replica).
* **Versions.** TRL stamps a group with its counter when it dispatches the
  group, before the server admits or samples anything. Our rollout loop reads
  each completion's spans and stamps each sample with the oldest version that
  sampled a token of it, so TRL's staleness filter (`max_staleness`, at
  consumption) and its metrics `sample/staleness_*` count what the server did.
* **No vLLM dev-mode routes.** Nothing calls /pause, /resume,
  /init_weight_transfer_engine or /server_info, which our server does not
  serve; LoRA models are pushed merged (or as adapters: `WeightPusher`'s
  `adapter` option), not through TRL's adapter sync.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

from rollout_sidecar.protocol.calls.tls import shared_tls
from rollout_sidecar.trainer.integrations.trl_trainer import push_target
from rollout_sidecar.trainer.pusher import WeightPusher

__all__ = ["SidecarAsyncGRPOTrainer", "SidecarRolloutLoop"]

# The versions of the turns of the conversation this asyncio task rolls out.
_TURN_VERSIONS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("turn_versions")


class SidecarRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in its spawned process), with our API token on
    every request and each sample stamped with the oldest version of its
    spans. TRL imports it there by reference: it lives in a module."""

    def __init__(self, *, api_token: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._auth = {"Authorization": f"Bearer {api_token}"} if api_token else {}

    async def _post(self, path: str, payload: dict, timeout: float,
                    max_retries: int = 3) -> dict:
        import aiohttp

        async def post() -> dict:
            async with self.session.post(f"{self.vllm_server_url}{path}", json=payload,
                                         headers=self._auth,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                r.raise_for_status()
                return await r.json() or {}

        out = await self._retry(post, label=f"POST {path}", max_attempts=max_retries)
        turns = _TURN_VERSIONS.get(None)
        if path == "/v1/completions" and turns is not None:
            choice = out["choices"][0]
            spans = choice.get("weight_versions")
            if spans:
                turns.extend(s["version"] for s in spans)
            else:  # `[]`: no token sampled; null: a server without spans
                turns.append(int(out.get("weight_version", self.model_version)))
        return out

    async def _generate_one(self, prompt: Any, tool_dict: dict, tools: list,
                            group_id: int = 0) -> tuple:
        versions: list[int] = []
        _TURN_VERSIONS.set(versions)  # each rollout is an asyncio task of its own
        result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        for sequence in result[2]:  # the conversation's training rows
            sequence.sidecar_version = min(versions, default=self.model_version)
        return result

    async def _score_group(self, group: Any) -> list:
        samples = await super()._score_group(group)
        # One sample per training row, conversation by conversation (TRL's order).
        rows = [seq for conversation in group.completions_sequences for seq in conversation]
        for sample, row in zip(samples, rows, strict=True):
            sample.model_version = row.sidecar_version
        return samples


def _get(url: str, headers: dict[str, str]) -> dict:
    """A GET of the server's JSON; a 401 (no or a wrong API token) says so."""
    r = httpx.get(url, headers=headers, timeout=60, verify=shared_tls())
    r.raise_for_status()
    return r.json()


@contextmanager
def plain_attention(model: Any) -> Iterator[None]:
    """PyTorch's SDPA attention for the push's probe, whose forward is a plain
    causal one: TRL loads the model with its packed "tree" attention, which
    needs the packing's segment tables on every call."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    before = inner.config._attn_implementation
    if before == "sdpa":
        yield
        return
    inner.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        inner.set_attn_implementation(before)


class _OurDataPlane:
    """TRL's `WeightTransferProtocol`, with nothing to do: the pushes happen in
    `_sync_weight_merged` on every rank. Passing one also keeps TRL from
    building its NCCL client and from probing vLLM's /server_info."""

    def init_weight_transfer(self) -> None: ...
    def pause(self) -> None: ...
    def send_weights(self, iterator: Any) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...


class SidecarAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` pushing through rollout-sidecar; see the module
    docstring. `pusher`: a `WeightPusher` of your own (it is not closed at the
    end); else one is made with `push_options` (commit policy `keep`)."""

    def __init__(self, *args: Any, url: str | None = None, api_token: str | None = None,
                 admin_token: str | None = None, pusher: WeightPusher | None = None,
                 **kwargs: Any) -> None:
        push_options = kwargs.pop("push_options", {})
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is None:
            raise ValueError("SidecarAsyncGRPOTrainer needs args=AsyncGRPOConfig(...): its "
                             "vllm_server_base_url names the server")
        self.sidecar_url = (url or config.vllm_server_base_url).rstrip("/")
        api_token = api_token or os.environ.get("ROLLOUT_SIDECAR_API_TOKEN")
        headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        info = _get(f"{self.sidecar_url}/info", headers)
        if config.token_budget is None:  # TRL would ask /v1/models without a token
            config.token_budget = info["max_model_len"]
        super().__init__(*args, weight_transfer=_OurDataPlane(), **kwargs)
        # Made once accelerate formed the process group: the pusher reads its rank.
        self._own_pusher = pusher is None
        self.pusher = pusher or WeightPusher(
            self.sidecar_url, admin_token, **{"commit_policy": "keep", **push_options})
        # Versions only grow: go on from what the server serves (every rank read it).
        self.model_version = info["weight_version"]
        self.pushes: list[dict] = []
        if self.rollout_worker is not None:  # rank 0, before train() starts it
            models = _get(f"{self.sidecar_url}/v1/models", headers)
            self.rollout_worker._loop_cls = SidecarRolloutLoop
            self.rollout_worker._loop_kwargs.update(
                api_token=api_token, vllm_server_url=self.sidecar_url,
                model_name=models["data"][0]["id"])  # what the server calls its model
            self.rollout_worker.update_model_version(self.model_version)

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        """TRL's sync point (after every `weight_sync_steps` steps, and once
        before the first rollout), on every rank: one push."""
        t1 = time.time()
        with plain_attention(self.accelerator.unwrap_model(self.model)):
            result = self.pusher.push(push_target(self), version=self.model_version + 1)
        t2 = time.time()
        self.model_version = result.version
        probe = result.probe
        self.pushes.append(dict(step=self.state.global_step, version=result.version,
                                seconds=t2 - t1, nbytes=result.nbytes,
                                probe_gap=probe.mean_abs_dlogp if probe else None,
                                probe_passed=probe.passed if probe else None))
        self._metrics["train"]["sidecar/weight_version"].append(float(result.version))
        if self.rollout_worker is not None:
            self.rollout_worker.update_model_version(result.version)
        return t1, t1, t2

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._own_pusher:
                self.pusher.close()  # the server's data plane is free for the next trainer
