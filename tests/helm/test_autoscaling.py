"""The chart's autoscaler (`autoscaling.enabled`): a HorizontalPodAutoscaler (autoscaling/v2)
on a per-pod metric the server exports, with the PodDisruptionBudget and the preStop wait a
leaving replica needs. Rendered offline and validated against the Kubernetes API schemas."""

from __future__ import annotations

import pytest

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (the Helm v4 SDK) is needed to render the chart"
)
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from tests.helm.manifests import (  # noqa: E402
    KUBE_VERSIONS,
    containers,
    objects,
    one,
    pod_templates,
)

pytestmark = pytest.mark.helm

SCALED = {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
          "auth": {"existingSecret": "tokens"}}


def served_metrics() -> dict[str, str]:
    """What the server's /metrics exposes of its own, by name: type (a fresh registry)."""
    from rollout_sidecar.server.metrics.collectors import ServerMetrics

    return {family.name: family.type for family in ServerMetrics().registry.collect()}


def test_the_autoscaler_scales_the_deployment_on_a_gauge_the_server_serves(render) -> None:
    manifests = render(SCALED)
    hpa = one(manifests, "HorizontalPodAutoscaler")
    for kube_version in KUBE_VERSIONS:
        kubernetes_validate.validate(hpa, kube_version, strict=True)
    deployment = one(manifests, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    # A per-pod average needs a gauge: a counter's value only grows.
    assert served_metrics().get(name) == "gauge", (name, sorted(served_metrics()))
    # The HPA owns the replica count: a `replicas` in the Deployment would fight it at
    # every `helm upgrade`.
    assert "replicas" not in deployment["spec"]
    # One replica leaves at a time, under the budget.
    assert hpa["spec"]["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 60}]
    one(manifests, "PodDisruptionBudget")


def test_with_multi_host_the_autoscaler_scales_the_groups(render) -> None:
    manifests = render(SCALED, multiHost={"enabled": True, "nnodes": 2})
    hpa, lws = one(manifests, "HorizontalPodAutoscaler"), one(manifests, "LeaderWorkerSet")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": lws["apiVersion"], "kind": lws["kind"],
                                             "name": lws["metadata"]["name"]}
    assert "replicas" not in lws["spec"]


def test_a_leaving_server_waits_out_the_endpoint_update_then_drains(render) -> None:
    for manifests in (render(), render(SCALED), render(SCALED, multiHost={"enabled": True})):
        pods = pod_templates(manifests)
        for template in pods:
            grace = template["spec"]["terminationGracePeriodSeconds"]
            served = [c for c in containers(template["spec"]) if "ports" in c]
            for c in served:
                drain = drain_options(c["lifecycle"]["preStop"]["exec"]["command"])
                port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
                assert drain["url"] == f"http://127.0.0.1:{port}"
                assert drain["min_s"] == 5  # the endpoints' update
                assert drain["min_s"] < drain["timeout_s"] < grace  # SIGTERM's own drain after
        assert any("ports" in c for t in pods for c in containers(t["spec"]))
    # A headless worker and a sidecar have no Service to leave.
    workers = [c for t in pod_templates(render(multiHost={"enabled": True}))
               for c in containers(t["spec"]) if "ports" not in c]
    assert workers and not [c for c in workers if "lifecycle" in c]


def test_off_by_default(render) -> None:
    manifests = render()
    assert not objects(manifests, "HorizontalPodAutoscaler")
    assert one(manifests, "Deployment")["spec"]["replicas"] == 1


def drain_options(command: list[str]) -> dict:
    """The options `rollout-sidecar drain` parses from a rendered command (the CLI's own
    parser: a flag it does not take fails here)."""
    from typer.main import get_command

    from rollout_sidecar.server.cli import app

    assert command[:2] == ["rollout-sidecar", "drain"], command
    drain = get_command(app).commands["drain"]  # type: ignore[attr-defined]
    return drain.make_context("drain", list(command[2:])).params
