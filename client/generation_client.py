"""`GenerationClient` and `AsyncGenerationClient`: typed /generate over httpx.

Each API method is written once, as a function that describes its job
(`_api`); the two clients bind the same functions, one running the job's
plan blocking and one awaiting it, so the two APIs cannot drift apart.

Both talk to one server or several replicas (see protocol/endpoints.py for the URL
forms and replica_pool.py for which replica gets a request).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from rollout_sidecar.client.protocol import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    SamplingConfig,
)
from rollout_sidecar.client.protocol.endpoints import auth_headers
from rollout_sidecar.client.replica_pool import ReplicaPool, ReplicaState
from rollout_sidecar.client.request_plans import (
    Call,
    Job,
    Plan,
    ReadyCheck,
    ReplicaFrozen,
    RetryPolicy,
    Send,
    Sleep,
    Timeouts,
    Watch,
)
from rollout_sidecar.client.stall_watch import Silent, run_watched, run_watched_async

P = ParamSpec("P")
T = TypeVar("T")

# Scoring is a one-token generation with prompt logprobs (vLLM needs >= 1 token).
_SCORE = SamplingConfig(max_tokens=1, logprobs=False, prompt_logprobs=True)


class _api:  # noqa: N801 - a namespace of job descriptions
    @staticmethod
    def generate(prompts: list[str] | None = None, *,
                 prompt_token_ids: list[list[int]] | None = None,
                 sampling: SamplingConfig | dict | None = None,
                 min_weight_version: int | None = None,
                 session_key: str | None = None) -> Call[GenerateResponse]:
        """Sample completions of `prompts` (strings) or `prompt_token_ids`.
        `min_weight_version`: wait (bounded by the server) until it is served;
        only replicas known to hold it are asked when some are.
        `session_key`: requests with the same key go to the same replica while
        it is up (the turns of one episode reuse its prefix cache)."""
        fields = dict(prompts=prompts, prompt_token_ids=prompt_token_ids,
                      sampling=SamplingConfig.model_validate(sampling or {}),
                      min_weight_version=min_weight_version)
        # Absent, not null: the server refuses an explicit null prompt field.
        req = GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
        return Call("POST", "/generate", lambda r: GenerateResponse.model_validate(r.json()),
                    json=req.model_dump(exclude_none=True),
                    min_weight_version=min_weight_version, session_key=session_key)

    @staticmethod
    def score(prompt_token_ids: list[list[int]], *,
              min_weight_version: int | None = None,
              session_key: str | None = None) -> Call[GenerateResponse]:
        """Logprob of every token given the ones before it, under the served
        weights: `results[i].prompt_logprobs` (the first entry is None). For
        reference-model or recomputed old logprobs in the RL loop.
        `min_weight_version`, `session_key`: as for `generate`."""
        return _api.generate(prompt_token_ids=prompt_token_ids, sampling=_SCORE,
                             min_weight_version=min_weight_version, session_key=session_key)

    @staticmethod
    def info() -> Call[InfoResponse]:
        """Model, dtype, max_model_len, served weight_version, boot id (of one
        replica: the least busy)."""
        return Call("GET", "/info", lambda r: InfoResponse.model_validate(r.json()))

    @staticmethod
    def wait_until_ready(timeout: float = 300.0, poll_s: float = 1.0,
                         min_ready: int | None = None) -> ReadyCheck:
        """Wait until `min_ready` replicas (default: every one in the current
        list) answer GET /ready 200, or raise TimeoutError after `timeout`."""
        return ReadyCheck(timeout, poll_s, min_ready)


def _blocking(build: Callable[P, Job[T]]) -> Callable[Concatenate[Any, P], T]:
    @functools.wraps(build)
    def method(self: GenerationClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(build(*args, **kwargs).plan(self._pool, self.retry, self.timeouts))
    return method


def _awaited(build: Callable[P, Job[T]]) -> Callable[Concatenate[Any, P], Awaitable[T]]:
    @functools.wraps(build)
    async def method(self: AsyncGenerationClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(build(*args, **kwargs).plan(self._pool, self.retry,
                                                           self.timeouts))
    return method


class _Replicated:
    """What both clients hold: the retry policy, the timeouts and the replica pool."""

    def __init__(self, base_url: str | Sequence[str] | None, token: str | None,
                 timeout: float, retry: RetryPolicy | None, refresh_s: float,
                 stall_timeout_s: float | None) -> None:
        self.retry = retry or RetryPolicy()
        # Each request sets its own read timeout (the stall bound); see request_plans.py.
        self.timeouts = Timeouts(timeout, stall_timeout_s)
        self._pool = ReplicaPool(base_url or None, refresh_s=refresh_s)  # "": the default
        token = token if token is not None else os.environ.get("ROLLOUT_SIDECAR_API_TOKEN")
        # No base_url: every request names its replica. No transport retries:
        # a connect error must move to another replica (see request_plans.py).
        self._http_kwargs: dict[str, Any] = dict(headers=auth_headers(token), timeout=timeout)

    def replicas(self) -> list[ReplicaState]:
        """Each replica's URL, requests outstanding from this client, last seen
        weight_version, seconds it is still skipped for, and last error."""
        return self._pool.snapshot()


class GenerationClient(_Replicated):
    """Blocking client, safe to share between threads.

    `base_url`: one URL, several (a list or a comma-separated string), or
    `dns+http://name:port` for every address of a name (a Kubernetes headless
    Service; looked up again every `refresh_s` and when every replica is
    down). Defaults to $ROLLOUT_SIDECAR_URL; the token to
    $ROLLOUT_SIDECAR_API_TOKEN. `transport` replaces httpx's, for every replica.

    `stall_timeout_s`: every this long a request has not answered, its replica
    must answer GET /health (within 5 s); one that does not is frozen: the
    request goes to another replica, and it is skipped for
    `retry.stall_down_s`. A replica that answers keeps the request however
    long it runs. None: no check. `timeout`: every httpx bound, and no retry
    starts after it (see request_plans.py).
    """

    def __init__(self, base_url: str | Sequence[str] | None = None, token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None, refresh_s: float = 30.0,
                 stall_timeout_s: float | None = 30.0) -> None:
        super().__init__(base_url, token, timeout, retry, refresh_s, stall_timeout_s)
        self._http = httpx.Client(transport=transport, **self._http_kwargs)

    def _run(self, plan: Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                if isinstance(step, Send):
                    reply, error = None, None
                    try:
                        reply = self._send(step)
                    except httpx.TransportError as e:
                        error = e  # the plan decides: retry elsewhere, or raise
                    step = plan.send(reply) if error is None else plan.throw(error)
                elif isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    step = next(plan)
                else:
                    self._pool.refresh()
                    step = next(plan)
        except StopIteration as done:
            return done.value
        finally:
            plan.close()

    def _send(self, step: Send) -> httpx.Response:
        def call() -> httpx.Response:
            return self._http.request(step.method, step.url, json=step.json, **step.kwargs)

        watch = step.watch
        if watch is None:
            return call()
        try:
            return run_watched(call, lambda: self._probe(watch), watch.every_s)
        except Silent as e:
            raise ReplicaFrozen.after(watch, e) from e.cause

    def _probe(self, watch: Watch) -> None:
        self._http.get(watch.probe_url, timeout=watch.probe_s)

    generate = _blocking(_api.generate)
    score = _blocking(_api.score)
    info = _blocking(_api.info)
    wait_until_ready = _blocking(_api.wait_until_ready)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerationClient(_Replicated):
    """The same API as `GenerationClient`, for asyncio loops."""

    def __init__(self, base_url: str | Sequence[str] | None = None, token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 refresh_s: float = 30.0, stall_timeout_s: float | None = 30.0) -> None:
        super().__init__(base_url, token, timeout, retry, refresh_s, stall_timeout_s)
        self._http = httpx.AsyncClient(transport=transport, **self._http_kwargs)

    async def _run(self, plan: Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                if isinstance(step, Send):
                    reply, error = None, None
                    try:
                        reply = await self._send(step)
                    except httpx.TransportError as e:
                        error = e  # the plan decides: retry elsewhere, or raise
                    step = plan.send(reply) if error is None else plan.throw(error)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    step = next(plan)
                else:
                    await asyncio.to_thread(self._pool.refresh)  # DNS blocks
                    step = next(plan)
        except StopIteration as done:
            return done.value
        finally:
            plan.close()

    async def _send(self, step: Send) -> httpx.Response:
        call = self._http.request(step.method, step.url, json=step.json, **step.kwargs)
        watch = step.watch
        if watch is None:
            return await call
        try:
            return await run_watched_async(call, lambda: self._probe(watch), watch.every_s)
        except Silent as e:
            raise ReplicaFrozen.after(watch, e) from e.cause

    async def _probe(self, watch: Watch) -> None:
        await self._http.get(watch.probe_url, timeout=watch.probe_s)

    generate = _awaited(_api.generate)
    score = _awaited(_api.score)
    info = _awaited(_api.info)
    wait_until_ready = _awaited(_api.wait_until_ready)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

