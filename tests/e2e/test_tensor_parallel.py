"""Pushes into a tensor-parallel server: vLLM-CPU with TP=2 (two worker
processes, one core each), served in fp32, in both staging layouts: shared
(the default where /dev/shm has room: the first worker receives into /dev/shm
and both load their shards from it, one staged copy per host) and per worker
(every worker joins the data-plane group and keeps its own copy). The
per-worker server runs as a container with a small /dev/shm does: a private
tmpfs of 256 MiB holds vLLM's message queues (sparse, 664 MiB claimed) but no
staged copy, so the server chose, at start, to stage per worker, and says so;
with sharing required it refuses to start. The oracle is a transformers fp32
forward of the pushed weights, against the served prompt logprobs read with
plain httpx.

The fault table: a fault on one worker rank is what put vLLM's worker replies
out of step (server/weights/ops.py), so each fault below is followed by a
healthy push that must serve exactly what it pushed; a fault must never
publish anything: the old weights keep serving, or, once one rank changed
its shard and another did not, /generate answers 503 until a push succeeds.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import ServerSpec, serves, stop_server
from tests.e2e.test_push import run_worker
from tests.server_plan import SPAWN

pytestmark = pytest.mark.slow
PUSHES = 20  # in test_staging_memory_stays_flat_over_20_delta_pushes
TOKENS = [3, 17, 101, 55, 200, 9, 42, 77, 128, 250, 31, 64, 5, 190, 222, 13]
EXACT = 1e-4  # served vs trained, fp32 (measured ~3e-7)
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: each rank holds half


SMALL_SHM = "256m"  # holds vLLM's TP=2 queues (its largest check: 240 MiB free)


def tp2_env(share: str | None = None) -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    # vLLM-CPU binds each worker's OpenMP threads to a NUMA node unless told
    # which cores to use; a one-node machine needs them named.
    env = {"ROLLOUT_SIDECAR_TENSOR_PARALLEL_SIZE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cpus)), **SPAWN}
    return env if share is None else {**env, "ROLLOUT_SIDECAR_SHARE_HOST_STAGING": share}


def tp2_spec(staging: str) -> ServerSpec:
    # Both with the default setting: shared where it fits, which the size of
    # /dev/shm decides.
    return ServerSpec.of(f"tp2-{staging}", dtype="float32", failpoints=True, env=tp2_env(),
                         shm_size=SMALL_SHM if staging == "per-worker" else None)


def private_shm_works() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


@pytest.fixture(scope="module", params=["shared", "per-worker"])
@serves(tp2_spec)
def tp2(server_plan, request):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 on vLLM-CPU needs two cores")
    if request.param == "per-worker" and not private_shm_works():
        pytest.skip("a private /dev/shm needs root and unshare")
    s = server_plan.take(tp2_spec(request.param))
    s.shared = request.param == "shared"
    with s.client() as c:
        staging = Path("/dev/shm") / f"rollout-sidecar-{c.info().boot_id}"
    # A host-shared staging area (host_share.py) exists only when shared (the
    # per-worker server's /dev/shm is its own: nothing of it shows here).
    assert staging.exists() == s.shared, staging
    said = status(s)["staging_layout"]
    if s.shared:
        assert "share one copy in /dev/shm" in said, said
    else:  # decided at start, with a warning naming the size and the settings
        assert said.startswith("per worker"), said
        log = s.log.read_text(errors="replace")
        assert "they stage a copy each in ordinary memory instead" in log
        assert "SHM_SIZE" in log and "shm.sizeLimit" in log
    # The rank that checks CRCs: the leader alone when shared, else rank 1 as well.
    s.checking_rank = 0 if s.shared else 1
    yield s
    stop_server(s)  # waited for: the shared staging goes with the server
    assert not staging.exists(), staging


@pytest.fixture(scope="module")
def model(tp2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tp2.model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pusher(tp2):
    from rollout_sidecar.trainer import WeightPusher

    p = WeightPusher(tp2.url, admin_token=tp2.admin_token, bucket_mb=2)
    yield p
    p.close()


def layout(server) -> str:
    return "shared" if server.shared else "per-worker"


def status(server) -> dict:
    return httpx.get(server.url + "/weights/status", headers={
        "Authorization": f"Bearer {server.admin_token}"}, timeout=30).json()


def prompt_logprobs(server) -> tuple[int, torch.Tensor | None]:
    """(HTTP status, served prompt logprobs) with plain httpx."""
    r = httpx.post(server.url + "/generate", headers={
        "Authorization": f"Bearer {server.api_token}"}, json={
        "prompt_token_ids": [TOKENS],
        "sampling": {"max_tokens": 1, "prompt_logprobs": True}}, timeout=60)
    if r.status_code != 200:
        return r.status_code, None
    return 200, torch.tensor(r.json()["results"][0]["prompt_logprobs"][1:], dtype=torch.float64)


def reference_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


def step(model, seed: int, density: float = 1.0) -> None:
    """A "training step": `density` of every tensor's elements move, sharded ones included."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            moved = torch.randn(p.shape, generator=g) * 0.02
            if density < 1.0:
                moved *= torch.rand(p.shape, generator=g) < density
            p.add_(moved)


def push_and_check(tp2, pusher, model, seed: int) -> tuple[float, float]:
    """Step, push; the served logprobs must be the trained ones. (gap, moved)."""
    before = prompt_logprobs(tp2)[1]
    v = status(tp2)["weight_version"]
    step(model, seed)
    result = pusher.push(model, version=v + 1)
    assert result.version == v + 1 and result.probe.passed
    code, served = prompt_logprobs(tp2)
    assert code == 200
    trained = reference_logprobs(model)
    gap = (served - trained).abs().mean().item()
    moved = (before - trained).abs().mean().item() if before is not None else float("nan")
    assert gap < EXACT and not moved < 1e-2, (gap, moved)
    return gap, moved


def test_push_into_a_tp2_server_serves_the_pushed_weights(tp2, pusher, model):
    # Shared: the leader alone receives; per worker: both TP workers do.
    assert status(tp2)["data_plane_ranks"] == (1 if tp2.shared else 2)
    # A push of own rows lands in place (worker/placed_tensors.py): TP 2 takes one.
    assert "chunks:interleaved" in status(tp2)["capabilities"]
    gap, moved = push_and_check(tp2, pusher, model, seed=0)
    staged = status(tp2)["staged_bytes"]
    print(f"TP2 {layout(tp2)}: served vs trained fp32 mean "
          f"|dlogp| {gap:.2e}; the step moved {moved:.3f}; staged bytes on the host {staged}")


def test_a_push_of_own_rows_into_a_tp2_server_is_exact(tp2, tmp_path):
    """Two FSDP2 ranks send their own rows, nothing gathered, in 0.1 MiB
    buckets: every tensor arrives as chunks from both ranks, interleaved, and
    lands in place in the staged copy both workers load their shards from
    (shared) or in each worker's own. The oracle: the trainer's own fp32
    forward of the same weights, against what the server samples."""
    v = status(tp2)["weight_version"]
    _, report = run_worker(tp2, "split", v + 1, tmp_path)
    assert report["error"] is None and report["own_rows"] and report["senders"] == 2, report
    assert report["version_after"] == v + 1, report
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(report["split"]), report
    assert report["max_abs_dlogp_fp32"] < EXACT, report  # served = trained, fp32
    assert report["mean_abs_dlogp_pre"] > 10 * report["mean_abs_dlogp_fp32"], report
    print(f"TP2 {layout(tp2)} own rows: served vs trained fp32 mean |dlogp| "
          f"{report['mean_abs_dlogp_fp32']:.2e} (max {report['max_abs_dlogp_fp32']:.2e}); "
          f"before the step {report['mean_abs_dlogp_pre']:.3f}")


def test_an_http_push_into_a_tp2_server_serves_the_pushed_weights(tp2, pusher, model):
    """The HTTP transport stages through the leader alone when shared."""
    from rollout_sidecar.trainer import WeightPusher

    http = WeightPusher(tp2.url, admin_token=tp2.admin_token, bucket_mb=2, transport="http")
    try:
        push_and_check(tp2, http, model, seed=99)
    finally:
        http.close()


def _nan_after_begin(model) -> None:
    # Rank 0 finds it while packing, after every replica began: the push aborts.
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")


# fault -> (how it is made, whether the failed push leaves the gate broken)
FAULTS = {
    "abort (NaN found mid-push)": ("nan", False),
    "CRC refused at check on one rank": ("check.corrupt@{checking_rank}", False),
    "load refused on rank 1 only": (f"load.drop:{O_PROJ}@1", True),
    "load refused on rank 0 only": (f"load.drop:{O_PROJ}@0", True),
    "load refused on both ranks": (f"load.drop:{O_PROJ}", False),
    "crash after load on rank 1": ("load.crash@1", True),
    "trainer killed mid-transfer": ("kill", False),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_on_one_rank_publishes_nothing_and_the_next_push_is_exact(
        tp2, pusher, model, fault, tmp_path):
    from rollout_sidecar.trainer.errors import WeightPushError

    how, breaks = FAULTS[fault]
    how = how.format(checking_rank=tp2.checking_rank)
    v = status(tp2)["weight_version"]
    _, served_before = prompt_logprobs(tp2)
    if how == "kill":  # rank 0 of a 2-rank FSDP2 trainer dies mid-push
        proc, _ = run_worker(tp2, "kill", v + 1, tmp_path, check=False)
        assert proc.returncode != 0
    else:
        failing = [p.detach().clone() for p in model.parameters()]
        if how == "nan":
            _nan_after_begin(model)
        else:
            # Something to send and load: a push of unchanged weights moves no
            # bucket and loads nothing, so no check or load could fail.
            step(model, seed=500 + list(FAULTS).index(fault), density=0.05)
            tp2.failpoints.write_text(how)
        try:
            with pytest.raises(WeightPushError):
                pusher.push(model, version=v + 1)
        finally:
            tp2.failpoints.write_text("")
            with torch.no_grad():  # the trainer's weights as they were
                for p, saved in zip(model.parameters(), failing, strict=True):
                    p.copy_(saved)
    s = status(tp2)
    assert s["weight_version"] == v and s["push_in_progress"] is False, s
    code, served = prompt_logprobs(tp2)
    if breaks:  # shards of two versions: nothing may serve them
        assert s["broken"] and code == 503, (s, code)
    else:  # the old weights, bit for bit
        assert not s["broken"] and code == 200
        assert (served - served_before).abs().max().item() == 0.0
    gap, moved = push_and_check(tp2, pusher, model, seed=1 + list(FAULTS).index(fault))
    assert status(tp2)["broken"] is None
    outcome = "503 (broken)" if breaks else "old weights served"
    print(f"TP2 {layout(tp2)} fault {fault!r}: {outcome}; next push served vs trained "
          f"{gap:.2e} (moved {moved:.3f})")


def _rss_mib(pid: int) -> float:
    """The server's whole process tree (API process, engine core, workers)."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def test_staging_memory_stays_flat_over_20_delta_pushes(tp2, pusher, model):
    """Patch buckets change size every push; the staging keeps one push's.
    Every push is held to that bound, so a staging that kept earlier pushes'
    patches fails within a few; bench/staging_memory.py runs 50 and reads RSS."""
    index = httpx.get(tp2.url + "/weights/index", headers={
        "Authorization": f"Bearer {tp2.admin_token}"}, timeout=30).json()["tensors"]
    # A dense push's buckets: every tensor in fp32, padded to 64 bytes (buckets.py).
    dense_bytes = sum(-(-math.prod(t["shape"]) * 4 // 64) * 64 for t in index.values())
    v = status(tp2)["weight_version"]
    workers = status(tp2)["data_plane_ranks"]
    rss, held = [], []
    for i in range(PUSHES):
        step(model, seed=1000 + i, density=0.05 + 0.15 * (i % 4) / 3)  # 5-20% changed
        r = pusher.push(model, version=v + 1 + i, probe=False)
        assert i == 0 or r.encoding == "delta", r.delta_reason  # the first: dense on a fresh server
        s = status(tp2)
        held.append(s["staged_bytes"])
        # Exactly the staged copy and this push's patches, on every receiving worker.
        assert s["staged_bytes"] <= workers * (dense_bytes + r.nbytes), (
            i, s["staged_bytes"], dense_bytes, r.nbytes)
        if i in (0, 9, PUSHES - 1):
            rss.append(_rss_mib(tp2.proc.pid))
    code, served = prompt_logprobs(tp2)
    assert code == 200 and (served - reference_logprobs(model)).abs().mean().item() < EXACT
    print(f"TP2 {layout(tp2)} {PUSHES} delta pushes: staged bytes first/last/max "
          f"{held[0]}/{held[-1]}/{max(held)} "
          f"(dense copy {workers} x {dense_bytes}); server RSS MiB after push 1/10/{PUSHES}: "
          f"{' / '.join(f'{x:.0f}' for x in rss)}")


# Started by the plan beside the tests before it (a TP=2 start that fails is as
# long as one that succeeds), taken by the test below.
REFUSED = ServerSpec.of("tp2-refused", dtype="float32", env=tp2_env(share="true"),
                        shm_size=SMALL_SHM)
CAN_REFUSE = len(os.sched_getaffinity(0)) >= 2 and private_shm_works()


@pytest.fixture
@serves(*([REFUSED] if CAN_REFUSE else []))  # the plan starts nothing this machine skips
def refused(server_plan):
    from rollout_sidecar.server.launcher import ServerStartError

    if not CAN_REFUSE:
        pytest.skip("needs two cores, root and unshare")
    with pytest.raises(ServerStartError) as e:
        server_plan.take(REFUSED)
    return e.value, server_plan.folder(REFUSED) / f"{REFUSED.name}.log"


def test_a_tp2_server_that_must_share_refuses_to_start_where_shm_cannot_hold_the_copy(refused):
    """share_host_staging=true under a /dev/shm with room for vLLM's queues
    but not a staged copy: the server refuses at start, naming the size and
    the settings, before any trainer runs a step."""
    error, log = refused
    # Not a timeout: it ended by itself, with uvicorn's code for a failed startup.
    assert "server exited 3 " in str(error), error
    said = log.read_text(errors="replace")
    for part in ("/dev/shm on ", "share_host_staging=true requires one shared staged copy",
                 "give /dev/shm at least", "SHM_SIZE", "shm.sizeLimit"):
        assert part in said, (part, said)
