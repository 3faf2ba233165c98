"""Where the served checkpoint comes from: a local directory, a Hugging Face hub
id (resolved as vLLM resolves it), or the embedded default model.

The server needs the files on disk, not just an id: the weight index is read
from the safetensors headers, and pushes are checked against it. So a hub id is
resolved to its snapshot directory once, up front, honouring `HF_HOME`,
`HF_HUB_OFFLINE` and `HF_TOKEN` exactly as `vllm serve` does, and vLLM is then
given that directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollout_sidecar.server.config import ServerSettings

# What serving needs: config, tokenizer, chat template, safetensors weights.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


class ModelSourceError(ValueError):
    """The model cannot be found or served as configured; `option` names the flag."""

    def __init__(self, message: str, option: str = "--model") -> None:
        super().__init__(message)
        self.option = option


def resolve_model(settings: ServerSettings) -> Path:
    """The checkpoint directory to serve."""
    if not settings.model:
        from rollout_sidecar.server.model.default_model import ensure_default_model

        return ensure_default_model(settings.cache_dir)
    local = Path(settings.model).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelSourceError(f"{local} is a directory without config.json; give an HF "
                                   "checkpoint directory or a hub id")
        return local
    if settings.model.startswith(("/", ".", "~")) or settings.model.count("/") > 1:
        raise ModelSourceError(f"{settings.model}: no such directory")
    return _hub_snapshot(settings.model)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    offline = constants.HF_HUB_OFFLINE
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=SNAPSHOT_PATTERNS,
                                      local_files_only=offline))
    except HFValidationError as e:
        raise ModelSourceError(f"{repo_id!r} is neither a local directory nor a valid hub "
                               f"id: {e}") from e
    except Exception as e:  # no network and not cached, gated, not found...
        where = os.environ.get("HF_HOME") or constants.HF_HOME
        how = ("HF_HUB_OFFLINE is set, so only the cache was searched"
               if offline else "the hub could not be reached or refused it")
        raise ModelSourceError(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and {how} "
            f"({type(e).__name__}). Pre-download it where the hub is reachable with "
            f"`hf download {repo_id}` (same HF_HOME), then serve with HF_HUB_OFFLINE=1; "
            "or pass a local checkpoint directory") from e
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"{repo_id} ({path}) has no safetensors weights; rollout-sidecar "
                               "serves safetensors checkpoints")
    return path


def check_max_model_len(path: Path, settings: ServerSettings) -> int:
    """The model's own context length; an explicit `max_model_len` above it is
    an error naming the limit (vLLM would fail later with a pydantic traceback)."""
    from vllm.engine.arg_utils import EngineArgs

    own = EngineArgs(model=str(path), max_model_len=None).create_model_config().max_model_len
    if settings.max_model_len is not None and settings.max_model_len > own:
        raise ModelSourceError(
            f"--max-model-len {settings.max_model_len} is larger than the model's limit of "
            f"{own} tokens ({path}/config.json); leave it unset to use {own}",
            option="--max-model-len")
    return own
