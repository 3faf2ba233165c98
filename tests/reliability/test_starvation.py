"""No request can starve the rest: a flood whose client left is cancelled, a
10 MB prompt is refused before tokenising."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.polling import metric as gauge
from tests.polling import sample

pytestmark = pytest.mark.slow


def test_work_of_a_client_that_left_is_cancelled(reliable):
    headers = {"Authorization": f"Bearer {reliable.api_token}"}
    flood = {"prompt_token_ids": [[1, 2, 3]] * 64,  # 4096 sequences x 400 tokens: minutes
             "sampling": {"n": 64, "max_tokens": 400, "seed": 0}}

    async def post_then_leave() -> None:
        # The client leaves only once the engine holds its work: leaving after a fixed
        # timeout raced the server's own abort (the gauge could already read 0 again).
        async with httpx.AsyncClient(timeout=600) as client:
            post = asyncio.create_task(client.post(reliable.url + "/generate", json=flood,
                                                   headers=headers))
            deadline = time.monotonic() + 120
            unfinished = "rollout_sidecar_engine_unfinished_requests"
            while sample((await client.get(reliable.url + "/metrics")).text, unfinished) == 0:
                assert not post.done(), post.result().text
                assert time.monotonic() < deadline, "the flood never reached the engine"
                await asyncio.sleep(0.2)
            post.cancel()  # closes the connection: the client has left
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(post_then_leave())
    deadline = time.monotonic() + 60  # a bound far below the flood's own minutes
    while gauge(reliable, "rollout_sidecar_engine_unfinished_requests") > 0:
        assert time.monotonic() < deadline, "the flood kept running after its client left"
        time.sleep(0.2)
    assert gauge(reliable, "rollout_sidecar_requests_in_flight") == 0
    t0 = time.perf_counter()
    r = httpx.post(reliable.url + "/generate", headers=headers, timeout=60,
                   json={"prompts": ["x"], "sampling": {"max_tokens": 1}})
    print(f"STARVATION 1-token request after the cancelled flood: {time.perf_counter() - t0:.3f}s")
    assert r.status_code == 200


def test_a_10mb_prompt_is_refused_before_tokenising(reliable):
    r = httpx.post(reliable.url + "/generate", timeout=60,
                   headers={"Authorization": f"Bearer {reliable.api_token}"},
                   json={"prompts": ["a" * 10_000_000], "sampling": {"max_tokens": 1}})
    assert r.status_code == 400 and r.json()["field"] == "prompts[0]"
    assert httpx.get(reliable.url + "/health", timeout=30).status_code == 200
