"""Pinned staging on a GPU host, torch only (no vLLM). Marked gpu.

The staged copy is pinned (its buffers go to the GPU at every load), and
PyTorch's caching host allocator rounds every pinned block up to a power of
two and keeps freed blocks cached. Over pushes whose layouts change (a
delta's patch buckets change size at every push; a dense layout changes when
the model or the bucket size does), the pinned memory held must stay one
layout's worth: the staging frees what a new layout does not use, from that
cache too, and never pins a delta's patches (applied on the host).
The oracle is the allocator's own count (`torch.cuda.host_memory_stats`)
against one layout's blocks rounded as the allocator rounds them.
"""

from __future__ import annotations

import pytest
import torch

from rollout_sidecar.protocol.schema import BucketManifest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MIB = 2**20


def _layout(sizes: list[int]) -> list[BucketManifest]:
    return [BucketManifest(index=i, nbytes=n, params=[]) for i, n in enumerate(sizes)]


def _rounded(sizes: list[int]) -> int:
    """One layout's pinned bytes as the allocator holds them: each block a power of two."""
    return sum(1 << (n - 1).bit_length() for n in sizes)


def _pinned_bytes() -> int:
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current"):
        if key in stats:
            return stats[key]
    raise AssertionError(f"no pinned-bytes count in host_memory_stats: {sorted(stats)}")


def test_pinned_staging_holds_one_layout_over_changing_pushes():
    """In a process of its own: pinned blocks other tests left cached would
    count in the allocator's totals."""
    from tests.processes import in_spawned_process

    result = in_spawned_process(_pushes, timeout_s=120)
    assert result == "ok", result


def _pushes(out) -> None:  # noqa: ANN001
    try:
        _twenty_pushes()
        out.put("ok")
    except BaseException as e:  # noqa: BLE001
        import traceback

        out.put(f"{e!r}\n{traceback.format_exc()}")


def _twenty_pushes() -> None:
    from rollout_sidecar.server.weights.worker.staging import Staging

    torch.cuda.init()
    host = torch.device("cpu")
    staging, delta = Staging(pinned=True), Staging()
    base = _pinned_bytes()
    held, layouts = [], []
    g = torch.Generator().manual_seed(0)
    for push in range(20):
        # The dense layout changes every 5 pushes (a new bucket size: other blocks).
        sizes = [(40 + 8 * (push // 5)) * MIB, 24 * MIB, (3 + push // 5) * MIB]
        staging.allocate(_layout(sizes), host)
        assert all(b.buffer.is_pinned() for b in staging.buckets)
        staging.buckets[0].buffer[:4096].fill_(push)  # touched, as a receive would
        # A delta's patches: another size every push, never pinned.
        patches = [int(n) * 4096 for n in torch.randint(100, 3000, (3,), generator=g)]
        delta.allocate(_layout(patches), host)
        assert not any(b.buffer.is_pinned() for b in delta.buckets)
        staging.release()  # the push ended: its buffers are the next one's pool
        delta.release()
        held.append(_pinned_bytes() - base)
        layouts.append(_rounded(sizes))
    print(f"pinned bytes held after each push: {held}; one layout rounded: {layouts}; "
          f"stats: {torch.cuda.host_memory_stats()}", flush=True)
    # Never more than the layout in use, whatever came before.
    assert all(h <= r for h, r in zip(held, layouts, strict=True)), (held, layouts)
    # And flat while the layout stays.
    for start in range(0, 20, 5):
        assert len(set(held[start: start + 5])) == 1, held
    staging.drop_pool()
    assert _pinned_bytes() - base == 0
