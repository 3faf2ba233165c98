"""Our vLLM `WeightTransferEngine`: receive into staging, verify, load on commit.

Runs inside the vLLM worker process. The API process drives it through
AsyncLLM's own weight-update calls; `update_info["op"]` selects the step:

- ``receive``: start a background thread that receives every bucket of the
  manifest over the torch.distributed group (gloo or NCCL). It returns at once,
  so the engine keeps serving the old weights while bytes arrive.
- ``stage``: one bucket's bytes that came over HTTP instead.
- ``poll``: raise if the receive thread has failed (trainer gone, timeout).
- ``wait``: join the receive thread, then verify every bucket's CRC.
- ``load``: the commit: load the verified buckets into the model, all of it or
  none of it (`reload.load_all_or_nothing`). The only place the model changes.
- ``abort``: drop the staged push.

Any op that raises ends vLLM's update session (vLLM's worker clears it when
`update_weights` raises, but not when `finish_weight_update` does, which is why
the load is an op and `finish_weight_update` only releases the staging).
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollout_sidecar.server.weights.fault_injection import apply_test_faults
from rollout_sidecar.server.weights.reload import load_all_or_nothing
from rollout_sidecar.server.weights.staging import Staging, crc32

log = logging.getLogger(__name__)

TRAINER_RANK, WORKER_RANK = 0, 1


@dataclass
class StagedInitInfo(WeightTransferInitInfo):
    store_host: str
    store_port: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    op: str
    manifest: list[dict] | None = None
    checksums: list[int] | None = None
    bucket: int | None = None
    data: bytes | None = None
    timeout_s: float = 300.0


class StagedWeightTransferEngine(WeightTransferEngine[StagedInitInfo, StagedUpdateInfo]):
    init_info_cls = StagedInitInfo
    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self.staging = Staging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.backend = "gloo"

    # ----------------------------------------------------------- connection

    def init_transfer_engine(self, init_info: StagedInitInfo) -> None:
        self.shutdown()
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = torch.distributed.TCPStore(
            init_info.store_host, init_info.store_port, is_master=False, timeout=timeout
        )
        prefixed = torch.distributed.PrefixStore(init_info.group_name, store)
        if init_info.backend == "nccl":
            self.group = torch.distributed.ProcessGroupNCCL(prefixed, WORKER_RANK, 2)
        else:
            self.group = torch.distributed.ProcessGroupGloo(prefixed, WORKER_RANK, 2, timeout)
        self.backend = init_info.backend
        log.info("weight data plane connected (%s, group %s)", init_info.backend,
                 init_info.group_name)

    def shutdown(self) -> None:
        self._join(timeout=1.0)
        self.group = None

    # --------------------------------------------------------------- session

    def start_weight_update(self) -> None:
        self._error = None
        self.staging.release()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Overrides the base, which calls torch.accelerator.synchronize(): that
        # raises on CPU, and our receive is synchronous per bucket anyway.
        info = self.parse_update_info(update_info)
        try:
            self.receive_weights(info)
        except BaseException:
            self._discard()
            raise

    def receive_weights(self, info: StagedUpdateInfo) -> None:
        if info.op == "prepare":  # HTTP transport: buckets come as "stage" ops
            self.staging.prepare(info.manifest or [], torch.device("cpu"))
        elif info.op == "receive":
            if self.group is None:
                raise RuntimeError("data plane not connected; call /weights/connect first")
            self.staging.prepare(info.manifest or [], self._staging_device())
            self._thread = threading.Thread(target=self._receive_all, daemon=True,
                                            name="rollout-sidecar-recv")
            self._thread.start()
        elif info.op == "stage":
            self._stage_http(info)
        elif info.op == "poll":
            if self._error is not None:
                raise RuntimeError(f"receive failed: {self._error}")
        elif info.op == "wait":
            if not self._join(timeout=info.timeout_s):
                raise TimeoutError(f"buckets still arriving after {info.timeout_s:.0f}s")
            if self._error is not None:
                raise RuntimeError(f"receive failed: {self._error}")
            self.staging.verify(info.checksums or [])
        elif info.op == "load":
            if not self.staging.buckets or not all(b.received for b in self.staging.buckets):
                raise RuntimeError("load called before every bucket arrived and was verified")
            weights = apply_test_faults(self.staging.tensors(), self.model_config.model)
            load_all_or_nothing(self.model, self.model_config, weights)
            self.staging.release()
        elif info.op == "abort":
            raise RuntimeError("push aborted")
        else:
            raise ValueError(f"unknown op {info.op!r}")

    def finish_weight_update(self) -> None:
        # The model was loaded by the "load" op; this only ends the session.
        self.staging.release()

    # ------------------------------------------------------------- internals

    def _staging_device(self) -> torch.device:
        # gloo moves host memory; NCCL needs device buffers.
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _receive_all(self) -> None:
        try:
            pending = None
            for b in self.staging.buckets:
                work = self.group.recv([b.buffer], TRAINER_RANK, b.index)
                # Checksum the previous bucket while this one arrives.
                if pending is not None:
                    pending.checksum = crc32(pending.buffer) if pending.buffer.is_cpu else None
                work.wait()
                b.received = True
                pending = b
            if pending is not None and pending.buffer.is_cpu:
                pending.checksum = crc32(pending.buffer)
        except BaseException as e:  # reported by the next poll/wait
            self._error = e
            log.warning("weight receive failed: %s", e)

    def _stage_http(self, info: StagedUpdateInfo) -> None:
        if info.bucket is None or info.data is None:
            raise ValueError("stage needs bucket and data")
        if not 0 <= info.bucket < len(self.staging.buckets):
            raise ValueError(f"bucket {info.bucket} is not in the manifest")
        b = self.staging.buckets[info.bucket]
        if len(info.data) != b.nbytes:
            raise ValueError(f"bucket {info.bucket}: {len(info.data)} bytes, expected {b.nbytes}")
        b.buffer.copy_(torch.frombuffer(bytearray(info.data), dtype=torch.uint8))
        b.received = True
        b.checksum = None  # recomputed at verify: a re-sent bucket replaces the old bytes

    def _discard(self) -> None:
        """Drop the staged push. A receive thread still blocked in recv may yet
        write into its buffers, so those are not pooled, and the group (now out
        of step with the trainer) is dropped: the trainer reconnects."""
        if self._join(timeout=0.0):
            self.staging.release()
        else:
            self.staging.drop_pool()
            self.group = None

    def _join(self, timeout: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._thread = None
        return True
