"""vLLM's own OpenAI serving layer on our AsyncLLM, behind our version gate.

vLLM's serving objects (`OpenAIServingChat`, `OpenAIServingCompletion`,
`OpenAIServingModels`, built by vLLM's `init_app_state` from `vllm serve`'s
own argument defaults) do the chat templating, tool and reasoning parsing,
the sampling-parameter mapping, `return_token_ids`, logprobs and the response
shapes. They reach the engine only through `engine_client.generate(...)`, so
we hand them `GatedEngineClient`: our AsyncLLM with that one method replaced.

Honest tags, with the lease protocol of /generate (see engine/version_gate.py):

1. The route (openai_api/router.py) admits a `Lease` *before* vLLM renders the
   request: a `min_weight_version` that never comes is a 409 before any byte
   of a stream, and no commit can slip between admission and submission.
2. The route puts a `RequestTag` in a context variable. `generate()` is a
   plain function that reads it when vLLM's serving code *creates* the
   generator (still inside the route's call) and counts it as pending. vLLM
   creates every generator of a request before it iterates any (a completion
   with a prompt list merges them afterwards), so the count cannot reach zero
   early.
3. Each generator submits with `AsyncLLM.add_request` itself, the code of
   `AsyncLLM.generate`, because that method offers no point between "the
   engine accepted it" and "first output". When every generator of the
   request was accepted, the lease's submit side is released; the in-flight
   side when every one finished, and in any case when the response ends.
4. Each generator's finish version is tracked like /generate's (registered
   with the engine, so a commit's `freeze_finished` sees it) and a response
   reports `gate.versions_between(admission, last version it read)`.
5. Each finished choice gets its per-token `weight_versions` spans
   (engine/version_spans.py): in the body, and in a stream in the choice's
   last chunk (the one with its finish_reason), unless the request says
   `return_weight_versions: false`.

A `generate()` after the submit side was released would run under a version
the tag does not name (vLLM's beam search submits once per step): refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import shlex
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

from starlette.datastructures import State

from rollout_sidecar.protocol.schema import VersionSpan
from rollout_sidecar.server.engine.lifecycle import GenerationEngine
from rollout_sidecar.server.engine.request_tracking import abort_quietly
from rollout_sidecar.server.engine.version_gate import Lease
from rollout_sidecar.server.engine.version_spans import sample_spans

_CURRENT: contextvars.ContextVar[RequestTag | None] = contextvars.ContextVar(
    "rollout_sidecar_openai_tag", default=None)


class LateSubmit(RuntimeError):
    """A request tried to reach the engine after its submit hold ended."""


class RequestTag:
    """One /v1 request's lease and the versions its generators read under."""

    def __init__(self, engine: GenerationEngine, lease: Lease, n: int = 1,
                 spans: bool = True) -> None:
        self.engine = engine
        self.lease = lease
        self.last = lease.version  # highest version any output was read under
        self.n = n  # choices per prompt: choice index = prompt index * n + output index
        self.want_spans = spans  # the request's return_weight_versions
        # choice index -> its per-token spans, once that choice finished
        self.spans: dict[int, list[VersionSpan] | None] = {}
        self._pending = 0  # generators created whose request the engine has not accepted
        self._running = 0  # generators created and not finished
        self._submit_open = True
        self._gens: list[AsyncGenerator[Any, None]] = []

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def fields(self) -> dict[str, Any]:
        """What every /v1 response carries, as of now."""
        gate = self.engine.gate
        versions = gate.versions_between(self.lease.version, self.last)
        return {"weight_version": self.lease.version, "versions_used": versions,
                "weight_suspect": any(v in gate.suspect for v in versions)}

    def finished_choice(self, prompt_index: int, output: Any) -> None:
        """Record a finished choice's spans (engine/version_spans.py)."""
        self.spans[prompt_index * self.n + output.index] = sample_spans(
            output, self.lease.version, self.engine.gate)

    def add_spans(self, choices: list[dict[str, Any]]) -> None:
        """Each finished choice's `weight_versions` spans, in place, as vLLM's
        and SGLang's OpenAI routes give them (only if the request wants them)."""
        if not self.want_spans:
            return
        for choice in choices:
            if choice.get("finish_reason") is not None and "index" in choice:
                spans = self.spans.get(choice["index"])
                choice["weight_versions"] = (None if spans is None
                                             else [s.model_dump() for s in spans])

    def _created(self, gen: AsyncGenerator[Any, None]) -> None:
        if not self._submit_open:
            raise LateSubmit("a request may reach the engine only while it is admitted: "
                             "multi-step requests (beam search) are not served on /v1")
        self._pending += 1
        self._running += 1
        self._gens.append(gen)

    def _accepted(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._submit_open = False
            self.lease.submitted()

    def _ended(self) -> None:
        self._running -= 1
        if self._running == 0 and not self._submit_open:
            self.lease.finished()

    async def release(self) -> None:
        """The response is over: close what vLLM left open (its generators
        abort their engine requests) and free the lease. Idempotent."""
        self._submit_open = False
        gens, self._gens = self._gens, []
        try:
            for gen in gens:
                with contextlib.suppress(Exception):
                    await asyncio.shield(gen.aclose())
        finally:  # even if cancelled meanwhile: a leaked lease would stall every commit
            self.lease.finished()


class GatedEngineClient:
    """Our AsyncLLM as vLLM's serving layer sees it: every attribute is the
    engine's own, except `generate`, which runs under the caller's lease."""

    def __init__(self, engine: GenerationEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        # AttributeError, never another, while unstarted: vLLM's serving layer uses hasattr.
        return getattr(self._engine.llm, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                 **kwargs: Any) -> AsyncGenerator[Any, None]:
        tag = _CURRENT.get()
        if tag is None:  # ungated generation would carry no honest version
            raise LateSubmit("generate() outside an admitted /v1 request")
        gen = self._run(tag, len(tag._gens), prompt, sampling_params, request_id, kwargs)
        tag._created(gen)
        return gen

    async def _run(self, tag: RequestTag, index: int, prompt: Any, params: Any,
                   request_id: str, kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        from vllm.outputs import STREAM_FINISHED
        from vllm.sampling_params import RequestOutputKind

        engine, gate = self._engine, self._engine.gate
        # Streams get deltas; otherwise the last output holds every token.
        deltas = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
        q, track, accepted, finished, sampled = None, None, False, False, 0
        # The admitted version's LoRA adapter (the /v1 model name selects none).
        kwargs["lora_request"] = engine.adapters.request_for(tag.lease.version)
        try:
            q = await engine.running().add_request(request_id, prompt, params, **kwargs)
            track = engine.watch(q)
            accepted = True
            tag._accepted()
            while not finished:
                # Drain without awaiting when possible, as AsyncLLM.generate does.
                out = q.get_nowait() or await q.get()
                finished = out.finished
                if finished and track.finish_version is None:
                    track.finish_version = gate.version
                # A commit may have frozen the finish version before we read it.
                v = track.finish_version if finished else None
                tag.last = max(tag.last, gate.version if v is None else v)
                if out is STREAM_FINISHED:
                    continue
                for c in out.outputs:
                    if c.finish_reason is not None:
                        tag.finished_choice(index, c)
                n = sum(len(c.token_ids) for c in out.outputs)
                sampled = sampled + n if deltas else n
                if finished:
                    engine.metrics.prompt_tokens.inc(len(out.prompt_token_ids or ()))
                    engine.metrics.generated_tokens.inc(sampled)
                yield out
        except BaseException:  # cancelled, closed or failed: free the engine
            if q is not None and not finished:
                await abort_quietly(engine.running().abort(q.request_id, internal=True))
            raise
        finally:
            if not accepted:
                tag._accepted()
            tag._ended()
            if track is not None:
                engine.unwatch(track)
            if q is not None:
                q.close()


def tagged_chunks(chunks: AsyncIterator[str], tag: RequestTag) -> AsyncIterator[str]:
    """vLLM's SSE stream with our fields spliced into every JSON chunk: each
    chunk names the versions that produced the tokens streamed so far."""

    async def gen() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                if chunk.startswith("data: {") and not chunk.startswith('data: {"error"'):
                    if '"finish_reason":"' in chunk and tag.want_spans:
                        # A choice's last chunk: its spans go in (parsed only here).
                        body = json.loads(chunk[len("data: "):])
                        tag.add_spans(body.get("choices") or [])
                        body = {**tag.fields(), **body}
                        chunk = "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"
                    else:
                        fields = json.dumps(tag.fields(), separators=(",", ":"))
                        chunk = "data: " + fields[:-1] + "," + chunk[len("data: {"):]
                yield chunk
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    return gen()


async def build_state(engine: GenerationEngine, extra_args: str = "") -> State:
    """vLLM's serving objects for our engine, configured by `vllm serve`'s own
    parser: its defaults, plus frontend flags from `extra_args`."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.33 moved it (vllm/entrypoints/common/cli_args.py)
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    # The engine was started with model=str(model_path): the served name matches.
    argv = ["--model", str(engine.model_path), *shlex.split(extra_args)]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    state = State()
    await init_app_state(GatedEngineClient(engine), state, args,
                         supported_tasks=("generate",))
    return state
