"""A fleet that changes under load (issue 57; docs/replicas.md, "A fleet that
changes"): replicas join and leave behind one `dns+` name while a trainer
pushes every few seconds and clients sample, and every sample's claimed
version is checked against an fp32 transformers forward of that version.

Each replica is a real fp32 server on its own loopback address (127.0.0.N,
the same ports on each, as pods have); the name `fleet` lists them in a
hosts file bind-mounted over /etc/hosts in a private mount namespace (the
bench re-runs itself under `unshare -m`; needs root), rewritten as the fleet
changes, the way a headless Service with `publishNotReadyAddresses` lists its
pods: a joiner from its start (it answers nothing until its engine is up,
then refuses generation while it catches up from a peer), a leaver until its
process has exited (it drains first: `rollout-sidecar drain`, the chart's
preStop; then SIGTERM). The trainer (`WeightPusher` on the dns+ name, the
probe on) and the clients (`GenerationClient` threads) never hear of a
change but through the name.

Prints, as one JSON line and a table: requests failed, pushes failed and the
absent replicas each push went on without, each joiner's seconds from its
start to ready and to serving the fleet's version, responses a joiner gave
before it served the fleet's version, and the oracle's verdict on every
sample.

    sudo .venv/bin/python bench/elastic_fleet.py [--clients 16] [--step-s 3]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NAME, PORT, DATA_PLANE_PORT = "fleet", 8000, 29650
URL = f"dns+http://{NAME}:{PORT}"
INNER = "ROLLOUT_SIDECAR_ELASTIC_INNER"
DEADLINE_S = 1800.0  # the whole run; stacks are dumped before it


@dataclass
class Member:
    addr: str
    server: object  # ServerProcess
    started: float
    ready_s: float | None = None
    fleet_s: float | None = None  # start -> serving the fleet's version
    caught_up: int | None = None  # the version it first served
    catch_up: dict | None = None  # its /weights/status timeline once ready
    left: float | None = None


@dataclass
class Run:
    t0: float = field(default_factory=time.monotonic)
    committed: int = 0  # the fleet's version: the last push that committed
    pushes: list[dict] = field(default_factory=list)
    responses: list[tuple[float, str, list[int]]] = field(default_factory=list)
    samples: list = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:7.1f}s {what}")
        print(self.events[-1], flush=True)


class HostsFile:
    """/etc/hosts of this mount namespace: a file of ours bound over it,
    rewritten in place (a bind mount follows the inode, not the name)."""

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="hosts-")
        os.close(fd)
        self.path = Path(path)
        self.base = Path("/etc/hosts").read_text().rstrip("\n").splitlines()
        self.listed: list[str] = []
        self._write()
        subprocess.run(["mount", "--bind", str(self.path), "/etc/hosts"], check=True)

    def _write(self) -> None:
        lines = self.base + [f"{a} {NAME}" for a in self.listed]
        with open(self.path, "r+" if self.path.stat().st_size else "w") as f:
            f.seek(0)
            f.write("\n".join(lines) + "\n")
            f.truncate()

    def list(self, addr: str) -> None:
        self.listed.append(addr)
        self._write()

    def unlist(self, addr: str) -> None:
        self.listed.remove(addr)
        self._write()


class Fleet:
    def __init__(self, run: Run, hosts: HostsFile, tmp: Path, tokens: dict[str, str]) -> None:
        self.run, self.hosts, self.tmp, self.tokens = run, hosts, tmp, tokens
        self.members: dict[str, Member] = {}
        self.gone: list[Member] = []

    def join(self, addr: str) -> Member:
        from rollout_sidecar.server.launcher import launch_server
        from tests.server_plan import TEST_ENV

        self.hosts.list(addr)  # listed from its start, not answering yet
        server = launch_server(
            log=self.tmp / f"{addr}-{len(self.gone)}.log", dtype="float32", max_model_len=512,
            port=PORT, data_plane_port=DATA_PLANE_PORT, wait=False,
            api_token=self.tokens["api"], admin_token=self.tokens["admin"],
            env={**TEST_ENV, "ROLLOUT_SIDECAR_HOST": addr, "ROLLOUT_SIDECAR_PEERS": URL,
                 "ROLLOUT_SIDECAR_CACHE_DIR": str(self.tmp / "cache")})
        server.url = f"http://{addr}:{PORT}"
        m = self.members[addr] = Member(addr, server, time.monotonic())
        self.run.note(f"join {addr}")
        return m

    def wait_serving(self, m: Member, timeout_s: float = 600) -> None:
        """Until `m` is ready and serves the fleet's version (the trainer's
        last committed push)."""
        url = f"http://{m.addr}:{PORT}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m.server.check_alive()  # type: ignore[attr-defined]
            try:
                ready = httpx.get(url + "/ready", timeout=5).status_code == 200
                version = httpx.get(url + "/info", timeout=5, headers={
                    "Authorization": f"Bearer {self.tokens['api']}"}).json()["weight_version"] \
                    if ready else None
            except httpx.HTTPError:
                ready, version = False, None
            now = time.monotonic() - m.started
            if ready and m.ready_s is None:
                m.ready_s, m.caught_up = now, version
                m.catch_up = httpx.get(url + "/weights/status", timeout=5, headers={
                    "Authorization": f"Bearer {self.tokens['admin']}"}).json()["catch_up"]
            if ready and version is not None and version >= self.run.committed:
                m.fleet_s = now
                self.run.note(f"{m.addr} ready at {m.ready_s:.1f}s (v{m.caught_up}), "
                              f"serving the fleet's v{version} at {now:.1f}s")
                return
            time.sleep(0.25)
        raise TimeoutError(f"{m.addr} not serving the fleet's version in {timeout_s}s")

    def leave(self, addr: str) -> None:
        """The chart's leave: drain (preStop), SIGTERM, unlisted once gone."""
        from rollout_sidecar.server.drain.command import drain_replica

        m = self.members.pop(addr)
        answer = drain_replica(f"http://{addr}:{PORT}", timeout_s=60, min_s=2)
        self.run.note(f"leave {addr}: drained {answer.model_dump() if answer else None}")
        code = m.server.stop(timeout_s=60)  # type: ignore[attr-defined]
        self.hosts.unlist(addr)
        m.left = time.monotonic()
        self.gone.append(m)
        self.run.note(f"{addr} exited {code}, unlisted")

    def stop(self) -> None:
        for m in self.members.values():
            m.server.stop(timeout_s=60)  # type: ignore[attr-defined]


def trainer(run: Run, model_path: str, token: str, step_s: float) -> None:
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher
    from tests.reliability.oracle import VersionedWeights

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").eval()
    weights = VersionedWeights(model)
    version = 0
    with WeightPusher(URL, admin_token=token, bucket_mb=1) as pusher:
        while not run.stop.is_set():
            version += 1
            t = time.monotonic()
            try:
                r = pusher.push(weights.load(version), version=version)
                run.committed = version
                run.pushes.append(dict(v=version, ok=True, at=round(t - run.t0, 1),
                                       s=round(time.monotonic() - t, 2),
                                       urls=sorted(o.url for o in r.replicas), absent=r.absent,
                                       encoding=r.encoding, gap=r.probe_gap))
                if r.absent:
                    run.note(f"push v{version} without {r.absent}")
            except Exception as e:  # a failed push: counted, and the next one goes on
                run.pushes.append(dict(v=version, ok=False, at=round(t - run.t0, 1),
                                       s=round(time.monotonic() - t, 2),
                                       error=str(e)[:300]))
                run.note(f"push v{version} FAILED: {str(e)[:300]}")
            run.stop.wait(step_s)


def client(run: Run, i: int, token: str) -> None:
    from rollout_sidecar.client import GenerationClient
    from tests.reliability.oracle import Sample

    rng = random.Random(i)
    with GenerationClient(URL, api_token=token, refresh_s=1.0) as c:
        while not run.stop.is_set():
            prompt = [rng.randrange(256) for _ in range(rng.randint(3, 8))]
            try:
                r = c.generate(prompt_token_ids=[prompt], sampling=dict(
                    max_tokens=rng.randint(4, 10), temperature=1.0, seed=rng.randrange(1 << 30)))
            except Exception as e:  # what would reach the rollout loop
                run.failures.append(f"{type(e).__name__}: {e}"[:300])
                continue
            run.responses.append((time.monotonic(), r.replica, list(r.versions_used)))
            for s in r.results[0].samples:
                run.samples.append(Sample(prompt, s.token_ids, s.logprobs, r.versions_used,
                                          len(run.responses)))
            run.stop.wait(rng.uniform(0.2, 0.8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--step-s", type=float, default=3.0)
    args = ap.parse_args()
    if os.environ.get(INNER) != "1":  # a mount namespace of our own for /etc/hosts
        os.execvpe("unshare", ["unshare", "-m", "--propagation", "private", sys.executable,
                               *sys.argv], {**os.environ, INNER: "1"})
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    tokens = {"api": secrets.token_hex(8), "admin": secrets.token_hex(8)}
    os.environ["ROLLOUT_SIDECAR_ADMIN_TOKEN"] = tokens["admin"]  # the drain's, as in a pod
    run, hosts = Run(), HostsFile()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-"))
    fleet = Fleet(run, hosts, tmp, tokens)
    threads: list[threading.Thread] = []
    try:
        a, b = fleet.join("127.0.0.2"), fleet.join("127.0.0.3")
        for m in (a, b):
            m.server.wait_ready(600)  # type: ignore[attr-defined]
        model_path = a.server.info()["model"]  # type: ignore[attr-defined]
        threads = [threading.Thread(target=trainer, args=(run, model_path, tokens["admin"],
                                                          args.step_s))]
        threads += [threading.Thread(target=client, args=(run, i, tokens["api"]))
                    for i in range(args.clients)]
        for t in threads:
            t.start()
        while run.committed < 3:
            time.sleep(0.5)
        joins = 0
        for step in (("join", "127.0.0.4"), ("join", "127.0.0.5"), ("leave", "127.0.0.2"),
                     ("leave", "127.0.0.4"), ("join", "127.0.0.2"), ("leave", "127.0.0.5")):
            if step[0] == "join":
                fleet.wait_serving(fleet.join(step[1]))
                joins += 1
            else:
                fleet.leave(step[1])
            time.sleep(2 * args.step_s)  # a few pushes on the new fleet
    finally:
        run.stop.set()
        for t in threads:
            t.join(300)
        fleet.stop()
    report(run, fleet, model_path)


def report(run: Run, fleet: Fleet, model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from tests.reliability.oracle import VersionedWeights, classify

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").eval()
    verdicts = classify(run.samples, VersionedWeights(model), range(0, run.committed + 2))
    members = fleet.gone + list(fleet.members.values())
    joiners = [m for m in members if m.fleet_s is not None and m.ready_s is not None]
    # A response a joiner gave, after its start, under a version older than the
    # one it first served once ready: generation it should have refused.
    early = sum(1 for t, url, used in run.responses for m in joiners
                if url == f"http://{m.addr}:{PORT}" and t >= m.started
                and m.caught_up is not None and min(used) < m.caught_up)
    served = {m.addr: sum(1 for t, url, _ in run.responses
                          if url == f"http://{m.addr}:{PORT}" and t >= m.started)
              for m in joiners}
    absent = [p["s"] for p in run.pushes if p.get("absent")]
    whole = [p["s"] for p in run.pushes if p["ok"] and not p.get("absent")]
    ok = [p for p in run.pushes if p["ok"]]
    # The first push on other replicas than the push before: a new data-plane group.
    changed = [p["s"] for prev, p in zip(ok, ok[1:], strict=False) if p["urls"] != prev["urls"]]
    failed = [p for p in run.pushes if not p["ok"]]
    row = dict(requests=len(run.responses), failed_requests=len(run.failures),
               pushes=len(run.pushes), failed_pushes=len(failed),
               pushes_without_a_replica=sum(bool(p.get("absent")) for p in run.pushes),
               push_s_median_whole_fleet=median(whole),
               push_s_median_without_a_replica=median(absent),
               push_s_max=max(p["s"] for p in run.pushes),
               push_s_on_a_new_group=changed,
               slowest=sorted(run.pushes, key=lambda p: -p["s"])[:3],
               joins=len(joiners), leaves=len(fleet.gone),
               joiner_ready_s=[round(m.ready_s or 0, 1) for m in joiners],
               joiner_fleet_version_s=[round(m.fleet_s or 0, 1) for m in joiners],
               joiner_catch_up=[{k: (m.catch_up or {}).get(k) for k in
                                 ("version", "fleet_version", "committed_s", "outcome")}
                                for m in joiners],
               joiner_responses=served, early_joiner_responses=early, samples=len(run.samples),
               verdicts=dict(verdicts.counts), examples=verdicts.examples,
               failures=run.failures[:5], failed=[p["error"] for p in failed][:5])
    print("ELASTIC " + json.dumps(row))
    print("\n".join(run.events))
    for p in run.pushes:
        print("push", json.dumps(p))


def median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


if __name__ == "__main__":
    main()
