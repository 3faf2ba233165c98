"""Client retry and errors. Uses httpx.MockTransport (a fake server) for the
503 sequence; the connect-error case uses a real closed port."""

from __future__ import annotations

import httpx
import pytest

from rollout_sidecar.client import GenerationClient, RetryPolicy, SidecarError
from tests.conftest import free_port

OK = {"results": [{"prompt_token_ids": [1], "samples": [
    {"text": "a", "token_ids": [97], "logprobs": [-0.5], "finish_reason": "length"}]}],
    "weight_version": 3, "versions_used": [3],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
FAST = RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.02)


def test_retries_503_then_succeeds():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, json={"error": "server is shutting down"})
        return httpx.Response(200, json=OK)

    with GenerationClient("http://x", retry=FAST, transport=httpx.MockTransport(handler)) as c:
        r = c.generate(["a"])
    assert len(calls) == 3 and r.weight_version == 3


def test_4xx_is_not_retried_and_names_the_field():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(400, json={"error": "bad", "field": "sampling.top_p"})

    with GenerationClient("http://x", retry=FAST, transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SidecarError) as e:
            c.generate(["a"])
    assert len(calls) == 1 and e.value.status == 400 and e.value.field == "sampling.top_p"


def test_connect_error_is_retried_then_raised():
    port = free_port()  # nothing listens here
    with GenerationClient(f"http://127.0.0.1:{port}", retry=FAST) as c:
        with pytest.raises(httpx.ConnectError):
            c.generate(["a"])
        with pytest.raises(TimeoutError):
            c.wait_until_ready(timeout=0.3, poll_s=0.1)


def test_retry_after_is_honoured_in_both_forms():
    import email.utils
    import time

    policy = RetryPolicy(backoff_s=100, max_backoff_s=100, max_retry_after_s=30)
    seconds = httpx.Response(503, headers={"Retry-After": "2"})
    date = httpx.Response(503, headers={"Retry-After": email.utils.formatdate(
        time.time() + 10, usegmt=True)})
    huge = httpx.Response(503, headers={"Retry-After": "3600"})
    assert policy.delay(0, seconds) == 2
    assert 8 <= policy.delay(0, date) <= 10
    assert policy.delay(0, huge) == 30  # capped
    assert 0 <= policy.delay(0, httpx.Response(503)) <= 100  # no header: jittered backoff


def test_async_client_is_the_same_api():
    import asyncio
    import inspect

    from rollout_sidecar.client import AsyncGenerationClient

    for name in ("generate", "score", "info"):
        sync, coro = getattr(GenerationClient, name), getattr(AsyncGenerationClient, name)
        assert inspect.signature(sync) == inspect.signature(coro) and sync.__doc__
        assert inspect.iscoroutinefunction(coro)
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": "draining"})
        return httpx.Response(200, json=OK)

    async def run():
        async with AsyncGenerationClient("http://x", retry=FAST,
                                         transport=httpx.MockTransport(handler)) as c:
            return await c.generate(["a"], min_weight_version=3)

    assert asyncio.run(run()).weight_version == 3
    assert len(calls) == 2 and b'"min_weight_version":3' in calls[1].content


def test_the_client_takes_url_and_api_token_as_the_pusher_names_them():
    """`url` and `api_token`, as WeightPusher and sidecar_rollout_func name
    them; a misspelt keyword is a TypeError, not ignored."""
    from rollout_sidecar.client import GenerationClient

    c = GenerationClient("http://a:1", api_token="t")
    assert c.replicas()[0].url == "http://a:1"
    assert c._http_kwargs["headers"]["Authorization"] == "Bearer t"
    c.close()
    with pytest.raises(TypeError, match="tokn"):
        GenerationClient("http://a:1", tokn="t")  # type: ignore[call-arg]
