"""The /v1 lease bookkeeping (server/openai_api/compat.py) against a fake engine: when the
submit and in-flight sides of the lease are released, and what versions a
response reports. The real path is tested in tests/e2e/test_openai.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from rollout_sidecar.server.engine.adapter_table import AdapterTable
from rollout_sidecar.server.engine.lifecycle import GenerationEngine
from rollout_sidecar.server.engine.request_tracking import RequestTracker
from rollout_sidecar.server.engine.version_gate import VersionGate
from rollout_sidecar.server.openai_api.compat import GatedEngineClient, LateSubmit, RequestTag


@dataclass
class Out:
    finished: bool
    outputs: tuple = ()
    prompt_token_ids: tuple = ()


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


class Collector:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.output = None
        self.queue: asyncio.Queue = asyncio.Queue()

    def get_nowait(self):
        return None

    async def get(self):
        return await self.queue.get()

    def close(self) -> None:
        pass


class FakeLLM:
    def __init__(self) -> None:
        self.collectors: dict[str, Collector] = {}
        self.aborted: list[str] = []

    async def add_request(self, request_id, prompt, params, **kw):
        self.collectors[request_id] = Collector(request_id)
        return self.collectors[request_id]

    async def abort(self, request_id, internal=False):
        self.aborted.append(request_id)


class FakeEngine:
    watch = GenerationEngine.watch
    running = GenerationEngine.running
    unwatch = GenerationEngine.unwatch

    def __init__(self) -> None:
        self.gate = VersionGate(0)
        self.llm = FakeLLM()
        self.metrics = SimpleNamespace(prompt_tokens=Counter(), generated_tokens=Counter())
        self.tracker = RequestTracker(self.gate)
        self.adapters = AdapterTable(SimpleNamespace(enable_lora=False, max_lora_rank=8,
                                                     lora_keep=1))


def counts(gate: VersionGate) -> tuple[int, int]:
    return gate._counts["submitting"], gate._counts["in_flight"]


def test_submit_side_waits_for_every_generator_then_in_flight_for_every_finish():
    async def main():
        engine = FakeEngine()
        client = GatedEngineClient(engine)
        tag = RequestTag(engine, await engine.gate.admit(None, 1))
        with tag.current():
            gens = [client.generate("p", None, f"r{i}") for i in range(2)]
        first = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert counts(engine.gate) == (0, 1)  # both accepted: commits may proceed
        assert len(engine.tracker.tracks) == 2
        for i in range(2):
            engine.llm.collectors[f"r{i}"].queue.put_nowait(Out(finished=True))
        await asyncio.gather(*first)
        for g in gens:
            with pytest.raises(StopAsyncIteration):
                await g.__anext__()
        assert counts(engine.gate) == (0, 0) and not engine.tracker.tracks
        assert tag.fields() == {"weight_version": 0, "versions_used": [0],
                                "weight_suspect": False}
        with tag.current(), pytest.raises(LateSubmit):
            client.generate("p", None, "late")
        await tag.release()
        assert counts(engine.gate) == (0, 0)

    asyncio.run(main())


def test_an_unstarted_generator_is_freed_by_release_and_a_closed_one_aborts():
    async def main():
        engine = FakeEngine()
        client = GatedEngineClient(engine)
        tag = RequestTag(engine, await engine.gate.admit(None, 1))
        with tag.current():
            started = client.generate("p", None, "a")
            client.generate("p", None, "never")
        task = asyncio.ensure_future(started.__anext__())
        await asyncio.sleep(0)
        assert counts(engine.gate) == (1, 1)  # "never" still holds the submit side
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert engine.llm.aborted == ["a"]
        await tag.release()
        assert counts(engine.gate) == (0, 0)

    asyncio.run(main())


def test_a_keep_commit_mid_request_is_reported():
    async def main():
        engine = FakeEngine()
        client = GatedEngineClient(engine)
        tag = RequestTag(engine, await engine.gate.admit(None, 1))
        with tag.current():
            gen = client.generate("p", None, "a")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        engine.llm.collectors["a"].queue.put_nowait(Out(finished=False))
        await task
        async with engine.gate.commit_window("keep", 1):
            await engine.gate.publish(1, "keep")
        engine.llm.collectors["a"].queue.put_nowait(Out(finished=True))
        await gen.__anext__()
        assert tag.fields()["versions_used"] == [0, 1]
        await tag.release()

    asyncio.run(main())
