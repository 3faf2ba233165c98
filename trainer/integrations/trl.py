"""TRL's `GRPOTrainer` generating through rollout-sidecar (TRL 1.16).

Two added lines in a GRPO script::

    from rollout_sidecar.trainer.integrations.trl import sidecar_rollout_func
    trainer = GRPOTrainer(model, reward_funcs, args=config, train_dataset=dataset,
                          rollout_func=sidecar_rollout_func())

The URL and tokens come from $ROLLOUT_SIDECAR_URL, $ROLLOUT_SIDECAR_API_TOKEN
and $ROLLOUT_SIDECAR_ADMIN_TOKEN (or the arguments). Then, on every rank:

* **Push at TRL's sync point.** TRL calls `rollout_func` in `_generate` on
  every process, once per generation batch. When `trainer.state.global_step`
  changed since the last push (and before the first generation), every rank
  calls `WeightPusher.push` (a collective) with the model TRL trains: DDP's
  inner module, or the FSDP2/FSDP1 model itself. Only weights that a
  generation will read are pushed: with `steps_per_generation` or
  `num_iterations` > 1 a `on_step_end` callback would push after steps whose
  weights nobody samples.
* **Versions.** Each push is the served version + 1; every request carries
  `min_weight_version` = the version just pushed, and every completion comes
  back with the `weight_version` that produced it, as the extra field
  `weight_version` (reward functions receive it as a keyword argument) and as
  the metric `sidecar/weight_version` in TRL's logs, next to
  `sidecar/push_s`, `sidecar/push_mb` and `sidecar/probe_gap`.
  `SidecarRollout.pushes` and `.generations` keep the records.
* **Logprobs for TRL's importance-sampling correction.** TRL applies it (and
  logs `sampling/sampling_logp_difference/*`) only when `use_vllm` is set,
  which for a server means its NCCL weight sync. So with
  `importance_sampling` on (default: `args.vllm_importance_sampling_correction`)
  this module sets `trainer.use_vllm = True` and becomes the trainer's
  `vllm_generation` (TRL then calls our `sync_weights()` at its own sync
  point). TRL compares against logprobs of the temperature-scaled
  distribution; the server returns those only when started with
  `--logprobs-mode processed_logprobs` (`GET /info` says which), so the first
  call checks the mode against the trainer's sampling settings and raises (or,
  with the correction off, warns) with the fix.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_sidecar.client import GenerationClient
from rollout_sidecar.trainer.integrations.trl_trainer import (
    changed_sampling,
    close_at_train_end,
    enable_importance_sampling,
    fsdp_fallback,
    push_target,
    unsupported_sampling,
)
from rollout_sidecar.trainer.push_result import PushResult
from rollout_sidecar.trainer.pusher import WeightPusher

log = logging.getLogger(__name__)

__all__ = ["GenerationRecord", "PushRecord", "SidecarRollout", "sidecar_rollout_func"]

PROCESSED = "processed_logprobs"
LOGPROBS_FIX = ("start the server with `--logprobs-mode processed_logprobs` (env "
                "ROLLOUT_SIDECAR_LOGPROBS_MODE=processed_logprobs)")


@dataclass
class PushRecord:
    """One push, as every rank saw it."""

    step: int  # trainer.state.global_step the weights are from
    version: int
    nbytes: int
    seconds: float
    probe_gap: float | None
    probe_passed: bool | None


@dataclass
class GenerationRecord:
    """One call of the rollout function on this rank."""

    step: int
    min_weight_version: int  # what every request of the call required
    completion_versions: list[int] = field(default_factory=list)  # one per completion


def sidecar_rollout_func(url: str | Sequence[str] | None = None, *,
                         api_token: str | None = None, admin_token: str | None = None,
                         importance_sampling: bool | None = None,
                         **push_options: Any) -> SidecarRollout:
    """A `rollout_func` for `GRPOTrainer`: generate through the sidecar, push
    after each optimizer step. `push_options` go to `WeightPusher` (e.g.
    `transport="http"`, `bucket_mb=64`, `probe=False`)."""
    return SidecarRollout(url, api_token=api_token, admin_token=admin_token,
                          importance_sampling=importance_sampling, **push_options)


class SidecarRollout:
    """The rollout function object; see the module docstring. The client and
    the pusher are made at the first call, inside the trainer's process group."""

    def __init__(self, url: str | Sequence[str] | None = None, *,
                 api_token: str | None = None, admin_token: str | None = None,
                 importance_sampling: bool | None = None, **push_options: Any) -> None:
        self.url = url
        self.api_token = api_token
        self.admin_token = admin_token
        self.importance_sampling = importance_sampling
        self.push_options = push_options
        self.client: GenerationClient | None = None
        self.pusher: WeightPusher | None = None
        self.version = 0  # the version every request requires: the last one pushed
        self.logprobs_mode: str | None = None  # what the server reported
        self.pushes: list[PushRecord] = []
        self.generations: list[GenerationRecord] = []
        self._trainer: Any = None
        self._pushed_step: int | None = None

    # ------------------------------------------------------------ the hooks

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's `rollout_func(prompts, trainer)`: one completion per entry of
        `prompts` (TRL repeats each prompt `num_generations` times)."""
        self.prepare(trainer)
        prompt_ids = self.tokenize(prompts, trainer)
        completions, versions = self._generate(prompt_ids, trainer)
        self.record_generation(trainer, versions)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [s.token_ids for s in completions],
            "logprobs": [list(s.logprobs or []) for s in completions],
            "weight_version": versions,
        }

    def prepare(self, trainer: Any) -> int:
        """Everything before generating, on every rank: check the settings and
        hook into TRL (first call), connect, push if the step changed. Returns
        the version requests must require. For rollout functions of your own
        (another client, multi-turn): call it first, then `record_generation`."""
        if self._trainer is not trainer:
            self._attach(trainer)
        self._connect()
        self.sync_weights()
        return self.version

    def record_generation(self, trainer: Any, versions: list[int]) -> None:
        """Keep the versions a generation came back with, and log them."""
        self.generations.append(GenerationRecord(trainer.state.global_step, self.version,
                                                 list(versions)))
        mode = "train" if trainer.model.training else "eval"
        trainer._metrics[mode]["sidecar/weight_version"].append(float(min(versions)))

    def sync_weights(self) -> PushResult | None:
        """Push the trainer's weights if its optimizer stepped since the last
        push (or nothing was pushed yet); every rank calls it at the same point.
        Also what TRL's own sync point calls (as `vllm_generation`)."""
        trainer = self._trainer
        step = trainer.state.global_step
        if step == self._pushed_step:
            return None
        assert self.pusher is not None
        t0 = time.perf_counter()
        result = self.pusher.push(push_target(trainer), version=self.version + 1)
        seconds = time.perf_counter() - t0
        self.version, self._pushed_step = result.version, step
        trainer._last_loaded_step = step  # TRL's tag: these weights are loaded
        probe = result.probe
        self.pushes.append(PushRecord(step, result.version, result.nbytes, seconds,
                                      probe.mean_abs_dlogp if probe else None,
                                      probe.passed if probe else None))
        metrics = trainer._metrics["train"]
        metrics["sidecar/push_s"].append(seconds)
        metrics["sidecar/push_mb"].append(result.nbytes / 2**20)
        if probe is not None:
            metrics["sidecar/probe_gap"].append(probe.mean_abs_dlogp)
        return result

    def close(self) -> None:
        """Release the server connection (also done at the end of training)."""
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def records(self) -> dict[str, list[dict]]:
        """Pushes and generations as plain dicts (JSON-ready)."""
        return {"pushes": [asdict(p) for p in self.pushes],
                "generations": [asdict(g) for g in self.generations]}

    # ------------------------------------------------------------ the parts

    def tokenize(self, prompts: list, trainer: Any) -> list[list[int]]:
        """Prompt token ids as TRL would make them: chat messages through the
        chat template (with the trainer's tools and template arguments), plain
        strings through the tokenizer."""
        from trl.data_utils import is_conversational

        proc = trainer.processing_class
        if is_conversational({"prompt": prompts[0]}):
            out = proc.apply_chat_template(
                conversation=prompts, tools=trainer.tools or None,
                chat_template=trainer.chat_template, add_generation_prompt=True,
                tokenize=True, return_dict=True, **trainer.chat_template_kwargs)
            return [list(ids) for ids in out["input_ids"]]
        return [list(ids) for ids in proc(text=prompts)["input_ids"]]

    def _generate(self, prompt_ids: list[list[int]], trainer: Any) -> tuple[list, list[int]]:
        """One completion per entry. Equal neighbours (a prompt's repeats) go
        as one prompt with `n` = their count, one request per distinct count."""
        runs = repeats(prompt_ids)
        samples: list[Any] = [None] * len(prompt_ids)
        versions = [0] * len(prompt_ids)
        assert self.client is not None
        for n in sorted({count for _, count in runs}):
            group = [first for first, count in runs if count == n]
            out = self.client.generate(
                prompt_token_ids=[prompt_ids[first] for first in group],
                sampling=self._sampling(trainer, n), min_weight_version=self.version)
            for first, result in zip(group, out.results, strict=True):
                for j, sample in enumerate(result.samples):
                    samples[first + j] = sample
                    versions[first + j] = out.weight_version
        return samples, versions

    @staticmethod
    def _sampling(trainer: Any, n: int) -> dict[str, Any]:
        extra = dict(trainer.args.generation_kwargs or {})
        return dict(n=n, max_tokens=trainer.max_completion_length,
                    temperature=trainer.temperature, top_p=trainer.top_p,
                    top_k=trainer.top_k or 0, logprobs=True,
                    **({"stop": extra["stop"]} if "stop" in extra else {}))

    def _attach(self, trainer: Any) -> None:
        """First call: check the settings, connect, and hook into TRL."""
        unsupported = unsupported_sampling(trainer)
        if unsupported:
            raise ValueError(f"rollout-sidecar's /generate cannot apply {', '.join(unsupported)}; "
                             "leave them at their defaults")
        self._trainer = trainer
        self._connect()
        assert self.client is not None
        info = self.client.info()
        self.version = info.weight_version
        self.logprobs_mode = info.logprobs_mode  # older servers leave it out: raw
        correct = self.importance_sampling
        if correct is None:
            correct = bool(trainer.args.vllm_importance_sampling_correction)
        self._check_logprobs(trainer, correct)
        fallback = fsdp_fallback(trainer)
        if fallback and trainer.accelerator.is_main_process:
            warnings.warn(f"rollout-sidecar: {fallback}", stacklevel=3)
        if correct:
            enable_importance_sampling(trainer, self)
        trainer.add_callback(close_at_train_end(self))

    def _connect(self) -> None:
        if self.client is None:
            self.client = GenerationClient(self.url, api_token=self.api_token)
        if self.pusher is None:
            self.pusher = WeightPusher(self.url, self.admin_token, **self.push_options)

    def _check_logprobs(self, trainer: Any, correct: bool) -> None:
        changed = changed_sampling(trainer)
        if self.logprobs_mode == PROCESSED or not changed:
            log.info("rollout-sidecar: logprobs_mode %s fits the trainer's sampling (%s)",
                     self.logprobs_mode, ", ".join(changed) or "unmodified")
            return
        msg = (f"the server returns {self.logprobs_mode} (before temperature/top-k/top-p), but "
               f"the trainer samples with {', '.join(changed)}, and TRL compares sampling "
               f"logprobs with its own temperature-scaled ones: {LOGPROBS_FIX}")
        if correct:
            raise ValueError(f"rollout-sidecar: {msg}; or pass importance_sampling=False "
                             "(TRL then applies no importance-sampling correction)")
        if trainer.accelerator.is_main_process:
            warnings.warn(f"rollout-sidecar: {msg}", stacklevel=3)


def repeats(prompt_ids: list[list[int]]) -> list[tuple[int, int]]:
    """(first entry, count) of each run of equal neighbours."""
    runs: list[tuple[int, int]] = []
    for i, ids in enumerate(prompt_ids):
        if runs and prompt_ids[runs[-1][0]] == ids:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
