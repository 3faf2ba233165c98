"""`GenerationClient` and `AsyncGenerationClient`: typed /generate over httpx."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx

from rollout_sidecar.client.http import RetryPolicy, auth_headers, settle
from rollout_sidecar.client.schema import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    SamplingConfig,
)

# Scoring is a one-token generation with prompt logprobs (vLLM needs >= 1 token).
_SCORE = SamplingConfig(max_tokens=1, logprobs=False, prompt_logprobs=True)


def _request_body(prompts: list[str] | None, prompt_token_ids: list[list[int]] | None,
                  sampling: SamplingConfig | dict | None, min_weight_version: int | None,
                  ) -> dict[str, Any]:
    fields = dict(prompts=prompts, prompt_token_ids=prompt_token_ids,
                  sampling=SamplingConfig.model_validate(sampling or {}),
                  min_weight_version=min_weight_version)
    # Absent, not null: the server refuses an explicit null prompt field.
    req = GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    return req.model_dump(exclude_none=True)


class GenerationClient:
    """Blocking client. `base_url` defaults to $ROLLOUT_SIDECAR_URL, the token
    to $ROLLOUT_SIDECAR_API_TOKEN."""

    def __init__(self, base_url: str | None = None, token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        base_url = base_url or os.environ.get("ROLLOUT_SIDECAR_URL", "http://127.0.0.1:8000")
        token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_API_TOKEN")
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(base_url=base_url, headers=auth_headers(token),
                                  timeout=timeout, transport=transport)

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        for attempt in range(self.retry.attempts):
            exc, r = None, None
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                exc = e
            if (done := settle(self.retry, attempt, exc, r)) is not None:
                return done
            time.sleep(self.retry.delay(attempt))
        raise AssertionError("unreachable")

    def generate(self, prompts: list[str] | None = None, *,
                 prompt_token_ids: list[list[int]] | None = None,
                 sampling: SamplingConfig | dict | None = None,
                 min_weight_version: int | None = None) -> GenerateResponse:
        body = _request_body(prompts, prompt_token_ids, sampling, min_weight_version)
        return GenerateResponse.model_validate(self._call("POST", "/generate", json=body).json())

    def score(self, prompt_token_ids: list[list[int]], *,
              min_weight_version: int | None = None) -> GenerateResponse:
        """Logprob of every token given the ones before it, under the served
        weights: `results[i].prompt_logprobs` (the first entry is None). For
        reference-model or recomputed old logprobs in the RL loop."""
        return self.generate(prompt_token_ids=prompt_token_ids, sampling=_SCORE,
                             min_weight_version=min_weight_version)

    def info(self) -> InfoResponse:
        return InfoResponse.model_validate(self._call("GET", "/info").json())

    def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 1.0) -> None:
        """Block until GET /ready answers 200, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._http.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
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
        base_url = base_url or os.environ.get("ROLLOUT_SIDECAR_URL", "http://127.0.0.1:8000")
        token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_API_TOKEN")
        self.retry = retry or RetryPolicy()
        self._http = httpx.AsyncClient(base_url=base_url, headers=auth_headers(token),
                                       timeout=timeout, transport=transport)

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        for attempt in range(self.retry.attempts):
            exc, r = None, None
            try:
                r = await self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                exc = e
            if (done := settle(self.retry, attempt, exc, r)) is not None:
                return done
            await asyncio.sleep(self.retry.delay(attempt))
        raise AssertionError("unreachable")

    async def generate(self, prompts: list[str] | None = None, *,
                       prompt_token_ids: list[list[int]] | None = None,
                       sampling: SamplingConfig | dict | None = None,
                       min_weight_version: int | None = None) -> GenerateResponse:
        body = _request_body(prompts, prompt_token_ids, sampling, min_weight_version)
        r = await self._call("POST", "/generate", json=body)
        return GenerateResponse.model_validate(r.json())

    async def score(self, prompt_token_ids: list[list[int]], *,
                    min_weight_version: int | None = None) -> GenerateResponse:
        """See `GenerationClient.score`."""
        return await self.generate(prompt_token_ids=prompt_token_ids, sampling=_SCORE,
                                   min_weight_version=min_weight_version)

    async def info(self) -> InfoResponse:
        return InfoResponse.model_validate((await self._call("GET", "/info")).json())

    async def wait_until_ready(self, timeout: float = 300.0, poll_s: float = 1.0) -> None:
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
