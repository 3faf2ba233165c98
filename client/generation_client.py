"""`GenerationClient` and `AsyncGenerationClient`: typed /generate over httpx.

Each API method is written once, as a function that describes its job
(`_api`); the two clients bind the same functions, one running the job's
plan blocking and one awaiting it, so the two APIs cannot drift apart.

Both talk to one server or several replicas (see protocol/endpoints.py for the URL
forms and replica_pool.py for which replica gets a request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from rollout_sidecar.client.liveness_registry import client_liveness
from rollout_sidecar.client.plan_steps import (
    Done,
    Outcome,
    Plan,
    Send,
    Sleep,
    Step,
    Watch,
    next_step,
)
from rollout_sidecar.client.replica_pool import ReplicaPool, ReplicaState
from rollout_sidecar.client.request_plans import (
    Call,
    Job,
    ReadyCheck,
    ReplicaFrozen,
    RetryPolicy,
    Timeouts,
)
from rollout_sidecar.protocol.calls.liveness import LivenessPolicy
from rollout_sidecar.protocol.calls.stall_watch import Silent, run_watched, run_watched_async
from rollout_sidecar.protocol.calls.tls import shared_tls
from rollout_sidecar.protocol.schema import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    SamplingConfig,
    routes,
)
from rollout_sidecar.protocol.schema.endpoints import auth_headers

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
                 session_key: str | None = None,
                 max_version_lag: int | None = None) -> Call[GenerateResponse]:
        """Sample completions of `prompts` (strings) or `prompt_token_ids`.
        `min_weight_version`: wait (bounded by the server) until it is served;
        only replicas known to hold it are asked when some are.
        `session_key`: requests with the same key go to the same replica while
        it is up (the turns of one episode reuse its prefix cache).
        `max_version_lag`: no token more than this many versions behind the
        newest committed one while the request runs (docs/async-rl.md)."""
        fields = dict(prompts=prompts, prompt_token_ids=prompt_token_ids,
                      sampling=SamplingConfig.model_validate(sampling or {}),
                      min_weight_version=min_weight_version, max_version_lag=max_version_lag)
        # Absent, not null: the server refuses an explicit null prompt field.
        req = GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
        return Call(routes.GENERATE.method, routes.GENERATE.path,
                    lambda r: GenerateResponse.model_validate(r.json()),
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
        return Call(routes.INFO.method, routes.INFO.path,
                    lambda r: InfoResponse.model_validate(r.json()))

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
    """What both clients hold: the retry policy, the timeouts, the replica
    pool and its hold on the process-wide liveness verdicts."""

    def __init__(self, url: str | Sequence[str] | None, api_token: str | None,
                 timeout: float, retry: RetryPolicy | None, refresh_s: float,
                 stall_timeout_s: float | None, liveness: LivenessPolicy | None,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None) -> None:
        self.retry = retry or RetryPolicy()
        # Each request sets its own read timeout (the stall bound); see request_plans.py.
        self.timeouts = Timeouts(timeout, stall_timeout_s)
        self._liveness = client_liveness(liveness, self, transport, self._loop_ping())
        self._pool = ReplicaPool(url or None, refresh_s=refresh_s,  # "": the default
                                 liveness=self._liveness)
        if api_token is None:
            api_token = os.environ.get("ROLLOUT_SIDECAR_API_TOKEN")
        # No base_url: every request names its replica. No transport retries:
        # a connect error must move to another replica (see request_plans.py).
        self._http_kwargs: dict[str, Any] = dict(headers=auth_headers(api_token),
                                                 timeout=timeout, verify=shared_tls())

    def replicas(self) -> list[ReplicaState]:
        """Each replica's URL, requests outstanding from this client, last seen
        weight_version, seconds it is still skipped for, last error, and
        whether the process's liveness ping finds it frozen."""
        return self._pool.snapshot()

    def _loop_ping(self) -> Callable[[str, float], None] | None:
        return None

    def _release_liveness(self) -> None:
        if self._liveness is not None:
            self._liveness.close()


class GenerationClient(_Replicated):
    """Blocking client, safe to share between threads.

    `url`: one URL, several (a list or a comma-separated string), or
    `dns+http://name:port` for every address of a name (a Kubernetes headless
    Service; looked up again every `refresh_s` and when every replica is
    down). Defaults to $ROLLOUT_SIDECAR_URL; `api_token` to
    $ROLLOUT_SIDECAR_API_TOKEN. `transport` replaces httpx's, for every replica.

    `liveness`: while a request has waited a second on a replica, one thread
    per replica for the whole process (shared by every client over the same
    URL) asks its GET /health every 2 s, bounded by 2 s; unanswered twice, the
    replica is frozen for every client: skipped until it answers again, and
    each request waiting there is retried on another replica, so a frozen
    replica is left within about 7 s (see liveness.py). None: no shared ping.
    `stall_timeout_s`: besides, every this long a request has not answered,
    its replica must answer GET /health (within 5 s); one that does not is
    frozen: the request goes to another replica, and this client skips it
    for `retry.stall_down_s`. None: no such check. A replica that answers
    keeps the request however long it runs. `timeout`: every httpx bound,
    and no retry starts after it (see request_plans.py).
    """

    def __init__(self, url: str | Sequence[str] | None = None, api_token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None, refresh_s: float = 30.0,
                 stall_timeout_s: float | None = 30.0,
                 liveness: LivenessPolicy | None = LivenessPolicy()) -> None:
        super().__init__(url, api_token, timeout, retry, refresh_s, stall_timeout_s,
                         liveness, transport)
        self._http = httpx.Client(transport=transport, **self._http_kwargs)

    def _run(self, plan: Plan[T]) -> T:
        with contextlib.closing(plan):
            step = next_step(plan, None)
            while not isinstance(step, Done):
                step = next_step(plan, self._outcome(step))
            return step.value

    def _outcome(self, step: Step) -> Outcome:
        if isinstance(step, Send):
            try:
                return Outcome(reply=self._send(step))
            except httpx.TransportError as e:
                return Outcome(error=e)
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
        else:
            self._pool.refresh()
        return Outcome()

    def _send(self, step: Send) -> httpx.Response:
        def call() -> httpx.Response:
            return self._http.request(step.method, step.url, json=step.json, **step.kwargs)

        watch = step.watch
        shared = self._liveness.get(watch.replica) if watch and self._liveness else None
        if watch is None or (watch.every_s is None and shared is None):
            return call()
        try:
            return run_watched(call, lambda: self._ping(watch), watch.every_s, shared)
        except Silent as e:
            raise ReplicaFrozen.after(watch, e) from e.cause

    def _ping(self, watch: Watch) -> None:
        self._http.get(watch.ping_url, timeout=watch.ping_s)

    generate = _blocking(_api.generate)
    score = _blocking(_api.score)
    info = _blocking(_api.info)
    wait_until_ready = _blocking(_api.wait_until_ready)

    def close(self) -> None:
        self._release_liveness()
        self._http.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerationClient(_Replicated):
    """The same API as `GenerationClient`, for asyncio loops."""

    def __init__(self, url: str | Sequence[str] | None = None, api_token: str | None = None,
                 timeout: float = 300.0, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 refresh_s: float = 30.0, stall_timeout_s: float | None = 30.0,
                 liveness: LivenessPolicy | None = LivenessPolicy()) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None  # the last one a call ran on
        super().__init__(url, api_token, timeout, retry, refresh_s, stall_timeout_s,
                         liveness, transport)
        self._http = httpx.AsyncClient(transport=transport, **self._http_kwargs)

    def _loop_ping(self) -> Callable[[str, float], None]:
        """A GET through this client's own transport, from the pinger's
        thread: sent on the loop of the client's last call (weakly held)."""
        me = weakref.ref(self)

        def ping(url: str, timeout_s: float) -> None:
            client = me()
            loop = client._loop if client is not None else None
            if client is None or loop is None or loop.is_closed():
                raise RuntimeError("no event loop to ping from yet")
            sent = asyncio.run_coroutine_threadsafe(client._http.get(url, timeout=timeout_s),
                                                    loop)
            try:
                sent.result(timeout_s + 5)  # its own timeout ends it first
            except concurrent.futures.TimeoutError:
                sent.cancel()
                raise RuntimeError("event loop too busy to ping") from None
        return ping

    async def _run(self, plan: Plan[T]) -> T:
        self._loop = asyncio.get_running_loop()
        with contextlib.closing(plan):
            step = next_step(plan, None)
            while not isinstance(step, Done):
                step = next_step(plan, await self._outcome(step))
            return step.value

    async def _outcome(self, step: Step) -> Outcome:
        if isinstance(step, Send):
            try:
                return Outcome(reply=await self._send(step))
            except httpx.TransportError as e:
                return Outcome(error=e)
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
        else:
            await asyncio.to_thread(self._pool.refresh)  # DNS blocks
        return Outcome()

    async def _send(self, step: Send) -> httpx.Response:
        call = self._http.request(step.method, step.url, json=step.json, **step.kwargs)
        watch = step.watch
        shared = self._liveness.get(watch.replica) if watch and self._liveness else None
        if watch is None or (watch.every_s is None and shared is None):
            return await call
        try:
            return await run_watched_async(call, lambda: self._ping(watch), watch.every_s,
                                           shared)
        except Silent as e:
            raise ReplicaFrozen.after(watch, e) from e.cause

    async def _ping(self, watch: Watch) -> None:
        await self._http.get(watch.ping_url, timeout=watch.ping_s)

    generate = _awaited(_api.generate)
    score = _awaited(_api.score)
    info = _awaited(_api.info)
    wait_until_ready = _awaited(_api.wait_until_ready)

    async def aclose(self) -> None:
        self._release_liveness()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

