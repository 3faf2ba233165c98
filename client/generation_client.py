"""`GenerationClient` and `AsyncGenerationClient`: typed /generate over httpx.

Each API method is written once, as a function that describes its call
(`_api`); the two clients bind the same functions, one running them blocking
and one awaiting them, so the two APIs cannot drift apart.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from rollout_sidecar.client.http import Attempts, Call, RetryPolicy, auth_headers
from rollout_sidecar.client.schema import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    SamplingConfig,
)

P = ParamSpec("P")
T = TypeVar("T")

# Scoring is a one-token generation with prompt logprobs (vLLM needs >= 1 token).
_SCORE = SamplingConfig(max_tokens=1, logprobs=False, prompt_logprobs=True)


class _api:  # noqa: N801 - a namespace of call descriptions
    @staticmethod
    def generate(prompts: list[str] | None = None, *,
                 prompt_token_ids: list[list[int]] | None = None,
                 sampling: SamplingConfig | dict | None = None,
                 min_weight_version: int | None = None) -> Call[GenerateResponse]:
        """Sample completions of `prompts` (strings) or `prompt_token_ids`.
        `min_weight_version`: wait (bounded by the server) until it is served."""
        fields = dict(prompts=prompts, prompt_token_ids=prompt_token_ids,
                      sampling=SamplingConfig.model_validate(sampling or {}),
                      min_weight_version=min_weight_version)
        # Absent, not null: the server refuses an explicit null prompt field.
        req = GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
        return Call("POST", "/generate", lambda r: GenerateResponse.model_validate(r.json()),
                    json=req.model_dump(exclude_none=True))

    @staticmethod
    def score(prompt_token_ids: list[list[int]], *,
              min_weight_version: int | None = None) -> Call[GenerateResponse]:
        """Logprob of every token given the ones before it, under the served
        weights: `results[i].prompt_logprobs` (the first entry is None). For
        reference-model or recomputed old logprobs in the RL loop."""
        return _api.generate(prompt_token_ids=prompt_token_ids, sampling=_SCORE,
                             min_weight_version=min_weight_version)

    @staticmethod
    def info() -> Call[InfoResponse]:
        """Model, dtype, max_model_len, served weight_version, boot id."""
        return Call("GET", "/info", lambda r: InfoResponse.model_validate(r.json()))


def _blocking(build: Callable[P, Call[T]]) -> Callable[Concatenate[Any, P], T]:
    @functools.wraps(build)
    def method(self: GenerationClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(build(*args, **kwargs))
    return method


def _awaited(build: Callable[P, Call[T]]) -> Callable[Concatenate[Any, P], Awaitable[T]]:
    @functools.wraps(build)
    async def method(self: AsyncGenerationClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(build(*args, **kwargs))
    return method


def _client_kwargs(base_url: str | None, token: str | None, timeout: float) -> dict[str, Any]:
    base_url = base_url or os.environ.get("ROLLOUT_SIDECAR_URL", "http://127.0.0.1:8000")
    token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_API_TOKEN")
    return dict(base_url=base_url, headers=auth_headers(token), timeout=timeout)


class GenerationClient:
    """Blocking client. `base_url` defaults to $ROLLOUT_SIDECAR_URL, the token
    to $ROLLOUT_SIDECAR_API_TOKEN. `transport` replaces httpx's (whose connect
    retries then are the transport's business)."""

    def __init__(self, base_url: str | None = None, token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.retry = retry or RetryPolicy()
        transport = transport or httpx.HTTPTransport(retries=self.retry.attempts - 1)
        self._http = httpx.Client(transport=transport, **_client_kwargs(base_url, token, timeout))

    def _run(self, call: Call[T]) -> T:
        attempts = Attempts(self.retry)
        while (r := attempts.outcome(self._http.request(call.method, call.path, json=call.json,
                                                         **call.kwargs))) is None:
            time.sleep(attempts.wait_s)
        return call.parse(r)

    generate = _blocking(_api.generate)
    score = _blocking(_api.score)
    info = _blocking(_api.info)

    def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 1.0) -> None:
        """Block until GET /ready answers 200, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while not _ready(lambda: self._http.get("/ready")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._http.base_url} not ready after {timeout:.0f}s")
            time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerationClient:
    """The same API as `GenerationClient`, for asyncio loops."""

    def __init__(self, base_url: str | None = None, token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.retry = retry or RetryPolicy()
        transport = transport or httpx.AsyncHTTPTransport(retries=self.retry.attempts - 1)
        self._http = httpx.AsyncClient(transport=transport,
                                       **_client_kwargs(base_url, token, timeout))

    async def _run(self, call: Call[T]) -> T:
        attempts = Attempts(self.retry)
        while (r := attempts.outcome(await self._http.request(
                call.method, call.path, json=call.json, **call.kwargs))) is None:
            await asyncio.sleep(attempts.wait_s)
        return call.parse(r)

    generate = _awaited(_api.generate)
    score = _awaited(_api.score)
    info = _awaited(_api.info)

    async def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 1.0) -> None:
        """See `GenerationClient.wait_until_ready`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (await self._http.get("/ready")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._http.base_url} not ready after {timeout:.0f}s")
            await asyncio.sleep(poll_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _ready(get: Callable[[], httpx.Response]) -> bool:
    try:
        return get().status_code == 200
    except httpx.TransportError:
        return False
