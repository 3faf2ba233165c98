"""A load of rollouts during pushes: 32 clients sending /generate over plain
httpx while a trainer thread pushes a new version every ~0.1 s."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.reliability.oracle import Sample, VersionedWeights


@dataclass
class SoakResult:
    policy: str
    requests: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)  # non-2xx
    latencies: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    gate_holds: list[float] = field(default_factory=list)
    commit_modes: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    push_errors: list[str] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _body(rng: random.Random, vocab: int) -> dict:
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 10))]
               for _ in range(rng.randint(1, 4))]
    return {"prompt_token_ids": prompts, "sampling": {
        "n": rng.randint(1, 2), "max_tokens": rng.randint(6, 16), "temperature": 1.0,
        "seed": rng.randrange(1 << 30)}}


async def _client(url: str, token: str, seed: int, vocab: int, stop: threading.Event,
                  out: SoakResult) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"Authorization": f"Bearer {token}"}) as c:
        while not stop.is_set():
            body = _body(rng, vocab)
            t0 = time.perf_counter()
            r = await c.post("/generate", json=body)
            out.latencies.append(time.perf_counter() - t0)
            out.requests += 1
            if r.status_code != 200:
                out.failures.append((r.status_code, r.text[:300]))
                continue
            resp = r.json()
            for prompt, res in zip(body["prompt_token_ids"], resp["results"], strict=True):
                for s in res["samples"]:
                    out.samples.append(Sample(prompt, s["token_ids"], s["logprobs"],
                                              resp["versions_used"], out.requests))


def run_soak(server, pusher, weights: VersionedWeights, policy: str, first_version: int,
             pushes: int = 20, clients: int = 32, vocab: int = 256) -> SoakResult:
    """Pushes versions first_version .. first_version + pushes - 1 under load."""
    out = SoakResult(policy)
    stop = threading.Event()
    pusher.commit_policy = policy

    def trainer() -> None:
        try:
            time.sleep(0.5)  # let the load build up first
            for v in range(first_version, first_version + pushes):
                res = pusher.push(weights.load(v), version=v, probe=False)
                out.versions.append(res.version)
                out.gate_holds.append(res.timings["server_gate_hold_s"])
                out.commit_modes.append(res.commit_policy)
                time.sleep(0.1)
            time.sleep(0.5)
        except Exception as e:  # reported, and the load stops
            out.push_errors.append(f"{type(e).__name__}: {e}")
        finally:
            stop.set()

    async def load() -> None:
        await asyncio.gather(*[_client(server.url, server.api_token, 1000 * first_version + i,
                                       vocab, stop, out) for i in range(clients)])

    t = threading.Thread(target=trainer)
    t.start()
    asyncio.run(load())
    t.join()
    return out
