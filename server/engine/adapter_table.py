"""Which LoRA adapter each weight version serves with (API process side).

A full push makes its version serve the model's own weights; an adapter push
makes its version serve `base + adapter`, where base is the last full
version (`base_version`, 0: the checkpoint). Requests name no adapter: a
request admitted under version v runs with v's adapter (or none), so the
version tags mean what they mean for full pushes.

Every adapter load gets a new vLLM LoRA id and a new name, never reused
within a server's life. vLLM keys its prefix cache on the name and path
(`_gen_lora_extra_hash_keys`), so each version gets a cache namespace of its
own: a block computed under another version's adapter can never be hit
(vLLM 42125 is that bug for an adapter reloaded in place under its old name).

The last `lora_keep` adapter versions stay loaded, and any older one that a
request admitted under it still uses: the worker drops an adapter only when
both let it go (`keep_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_sidecar.protocol.schema import LoraStatus
from rollout_sidecar.server.config import ServerSettings

SCHEME = "rollout-sidecar://"  # the path our worker recognises (worker/adapter_loading.py)


def lora_engine_args(settings: ServerSettings) -> dict[str, Any]:
    """vLLM engine arguments for `--enable-lora` (none without it)."""
    if not settings.enable_lora:
        return {}
    # Slots for every kept version in one batch, plus headroom in the CPU cache
    # for versions still finishing requests past the window.
    return {"enable_lora": True, "max_lora_rank": settings.max_lora_rank,
            "max_loras": settings.lora_keep, "max_cpu_loras": settings.lora_keep + 4}


@dataclass(frozen=True)
class LoadedAdapter:
    version: int
    lora_id: int
    name: str

    def request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, SCHEME + self.name)


class AdapterTable:
    def __init__(self, settings: ServerSettings, boot_id: str = "") -> None:
        self.enabled = bool(settings.enable_lora)
        self.max_rank = settings.max_lora_rank
        self.keep = settings.lora_keep
        self.boot = boot_id[:8] or "boot"
        self.base_version = 0
        self.loaded: dict[int, LoadedAdapter] = {}  # version -> its adapter
        self.serving: LoadedAdapter | None = None  # the served version's, if any
        self._next_id = 1

    def new(self, version: int) -> LoadedAdapter:
        """A fresh id and name for `version`'s adapter (not yet published)."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return LoadedAdapter(version, lora_id, f"rollout-sidecar-{self.boot}-v{version}-{lora_id}")

    def request_for(self, version: int) -> Any:
        """The LoRARequest a request admitted under `version` runs with."""
        a = self.loaded.get(version)
        return a.request() if a is not None else None

    def keep_ids(self, new: LoadedAdapter, leased: set[int]) -> list[int]:
        """LoRA ids the worker keeps once `new` is loaded: the newest `keep`
        versions (new included) and every version a request still holds."""
        newest = sorted(self.loaded)[-(self.keep - 1):] if self.keep > 1 else []
        return [new.lora_id] + [a.lora_id for v, a in self.loaded.items()
                                if v in newest or v in leased]

    def published_adapter(self, new: LoadedAdapter, kept_ids: list[int], with_base: bool
                          ) -> None:
        if with_base:
            self.base_version = new.version
        self.loaded = {v: a for v, a in self.loaded.items() if a.lora_id in kept_ids}
        self.loaded[new.version] = new
        self.serving = new

    def published_full(self, version: int) -> None:
        """A full push: the model holds `version`'s weights and serves them
        alone. Loaded adapters stay until pruned (requests may finish on them)."""
        self.base_version = version
        self.serving = None

    def status(self) -> LoraStatus | None:
        if not self.enabled:
            return None
        return LoraStatus(max_rank=self.max_rank, keep=self.keep, base_version=self.base_version,
                          adapters=sorted(self.loaded), serving_adapter=self.serving is not None)
