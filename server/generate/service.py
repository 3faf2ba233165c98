"""/generate's work on the engine: check, admit, submit, await, shape.

One request's prompts enter the engine together (so vLLM batches them) under
one `Lease` of the version gate, which is what makes the response's version
tag honest: no commit can slip between admission and submission, and a commit
that publishes while the prompts run is named in `versions_used` (and in each
sample's per-token `weight_versions` spans).
`score` is the same path with prompt logprobs, for the weight probe.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from rollout_sidecar.protocol.schema import GenerateRequest, GenerateResponse, SamplingConfig
from rollout_sidecar.server.engine.engine_api import Engine
from rollout_sidecar.server.engine.request_tracking import Track, abort_quietly
from rollout_sidecar.server.errors import BadRequest
from rollout_sidecar.server.generate import request_checks
from rollout_sidecar.server.generate.response import build_response

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from rollout_sidecar.server.engine.vllm_surface import Collector


class GenerateService:
    """/generate and the probe's scoring (a `Scorer`), on the engine; app.py
    builds it and keeps it as its `Services.generator`."""

    def __init__(self, engine: Engine) -> None:
        # The engine, not its parts: llm, tokenizer and info exist only once
        # it started, and a restart replaces them.
        self.engine = engine

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """Run one request's prompts; its tag is the version that produced its
        tokens (see engine/version_gate.py for how commits are ordered against it)."""
        e = self.engine
        assert e.info is not None
        settings, tracker = e.settings, e.tracker
        request_checks.check_request(req, settings, e.info.max_model_len, e.info.vocab_size)
        prompt_ids = await request_checks.prompt_token_ids(
            req, e.tokenizer, e.info.max_model_len, e.info.vocab_size,
            settings.max_prompt_bytes or 32 * e.info.max_model_len)
        params = [request_checks.sampling_params(req, i) for i in range(len(prompt_ids))]
        lease = await e.gate.admit(req.min_weight_version, settings.min_version_wait_s)
        tracks: list[Track] = []
        try:
            try:  # all prompts enter the engine at once, so it batches them
                request_id = uuid.uuid4().hex
                for i, ids in enumerate(prompt_ids):
                    tracks.append(Track(await self._submit(ids, params[i], f"{request_id}-{i}",
                                                           lease.version),
                                        max_lag=req.max_version_lag, since=lease.version))
            finally:
                lease.submitted()
            tracker.watch_all(tracks)
            outputs = await asyncio.gather(*[
                self._final(t, ids, params[i], f"{request_id}-{i}")
                for i, (t, ids) in enumerate(zip(tracks, prompt_ids, strict=True))])
        except BaseException:  # cancelled (client gone) or failed: free the engine
            # The collectors hold vLLM's internal ids (it suffixes ours).
            await abort_quietly(e.running().abort(
                [t.collector.request_id for t in tracks if t.finish_version is None],
                internal=True))
            raise
        finally:
            tracker.unwatch_all(tracks)
            lease.finished()
        return build_response(req, lease.version, prompt_ids, outputs, tracks, e.gate,
                              e.metrics, e.boot_id)

    async def _final(self, track: Track, ids: list[int], params: SamplingParams,
                     request_id: str) -> RequestOutput:
        """The prompt's last output. A run that a commit stopped for the
        request's `max_version_lag` is dropped whole and submitted again, on
        the weights served now (engine/request_tracking.py)."""
        while True:
            out = await self.engine.tracker.final(track)
            if not track.restart:
                return out
            track.restarts += 1
            track.restart, track.finish_version = False, None
            track.since = self.engine.gate.version
            track.collector = await self._submit(ids, params, f"{request_id}-r{track.restarts}",
                                                 track.since)

    async def _submit(self, ids: list[int], params: SamplingParams, request_id: str,
                      version: int) -> Collector:
        from vllm.exceptions import VLLMError
        from vllm.inputs import TokensPrompt

        llm = self.engine.running()
        try:  # with the LoRA adapter of the version it was admitted under, if any
            return await llm.add_request(
                request_id, TokensPrompt(prompt_token_ids=ids), params,
                lora_request=self.engine.adapters.request_for(version))
        except BaseException as e:
            # vLLM may hold it already (it failed on the way in): never leave it there.
            await abort_quietly(llm.abort(request_id))
            if isinstance(e, VLLMError):
                raise request_checks.as_bad_request(e) from e
            raise

    async def score(self, token_ids: list[int], version: int) -> list[float]:
        """logprob of token i given tokens < i (i >= 1) under `version`, which
        must still be the served one when the prefill ran."""
        r = await self.generate(GenerateRequest(
            prompt_token_ids=[token_ids], min_weight_version=version,
            sampling=SamplingConfig(max_tokens=1, logprobs=False, prompt_logprobs=True)))
        if r.versions_used != [version]:
            raise BadRequest(f"version {version} is no longer served (now "
                             f"{r.versions_used})", "version")
        lps = r.results[0].prompt_logprobs or []
        return [float("nan") if lp is None else lp for lp in lps[1:]]
