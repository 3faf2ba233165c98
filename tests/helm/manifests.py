"""Lookups in rendered manifests, and the checks of the custom resources the chart renders
(kubernetes-validate knows the built-in API only): shared by the chart's test modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helm.crd_schemas import load, strict


def _newest_kube() -> str:
    """The newest Kubernetes API kubernetes-validate ships ("" without it: the chart tests
    that need it skip themselves)."""
    try:
        from kubernetes_validate.utils import latest_version
    except ImportError:
        return ""
    return latest_version()


SERVER = "rollout-sidecar"
# The oldest API the chart supports (Chart.yaml kubeVersion) and the newest the validator
# ships: fields added later, or APIs removed since, both fail.
KUBE_VERSIONS = ("1.30.0", _newest_kube())
# The custom resources the chart renders, by apiVersion and kind: their CRD's schema
# (tests/helm/crds). ServiceMonitor is checked by fields instead (test_chart.py).
LWS = "leaderworkersets.leaderworkerset.x-k8s.io"
CUSTOM = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): (LWS, "v1"),
    ("ray.io/v1", "RayCluster"): ("rayclusters.ray.io", "v1"),
}
LWS_TEMPLATES = ("leaderTemplate", "workerTemplate")


def objects(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[dict], kind: str) -> dict:
    found = objects(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, got {[m['metadata']['name'] for m in found]}"
    return found[0]


def pod_templates(manifests: list[dict]) -> list[dict]:
    """Every pod template: a Deployment's or Job's, a LeaderWorkerSet's leader's and worker's,
    a RayCluster's head's and each worker group's."""
    found = [m["spec"]["template"] for m in manifests if m["kind"] in ("Deployment", "Job")]
    for lws in objects(manifests, "LeaderWorkerSet"):
        found += [lws["spec"]["leaderWorkerTemplate"][t] for t in LWS_TEMPLATES]
    for ray in objects(manifests, "RayCluster"):
        found.append(ray["spec"]["headGroupSpec"]["template"])
        found += [group["template"] for group in ray["spec"].get("workerGroupSpecs", [])]
    return found


def pod_specs(manifests: list[dict]) -> list[dict]:
    return [t["spec"] for t in pod_templates(manifests)]


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def server_container(manifests: list[dict]) -> dict:
    (pod,) = pod_specs(manifests)
    (server,) = [c for c in containers(pod) if c["name"] == SERVER]
    return server


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def is_custom(manifest: dict) -> bool:
    return (manifest["apiVersion"], manifest["kind"]) in CUSTOM


def validate_custom(manifest: dict, kube_version: str) -> None:
    """A custom resource against its CRD's schema, strictly (no field the schema does not
    name); its pod templates also as Pods of `kube_version`'s built-in API, which the CRD's
    copy of PodTemplateSpec may lag."""
    import jsonschema
    import kubernetes_validate

    schema = strict(load(*CUSTOM[(manifest["apiVersion"], manifest["kind"])]))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(manifest), key=str)
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    for template in pod_templates([manifest]):
        pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                               "metadata": {"name": "p", **template.get("metadata", {})},
                               "spec": template["spec"]}
        kubernetes_validate.validate(pod, kube_version, strict=True)


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in a container's command, args and env values: a
    variable it knows is replaced, `$$` is a literal `$`, anything else stays as written."""
    import re

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else variables.get(m.group(1), m.group(0)),
                  text)


def pod_process(container: dict, injected: dict[str, str], pod_ip: str,
                secrets: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment the kubelet would start `container` with: `injected` first
    (what a controller adds, e.g. LeaderWorkerSet's LWS_* variables), then the container's
    env in order, each value expanded from what came before it; `status.podIP` is `pod_ip`,
    a secretKeyRef is `secrets[key]` (an optional one that is absent stays unset)."""
    variables = dict(injected)
    for entry in container.get("env", []):
        if "value" in entry:
            variables[entry["name"]] = expand(entry["value"], variables)
            continue
        source = entry["valueFrom"]
        if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            variables[entry["name"]] = pod_ip
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if ref["key"] in secrets:
                variables[entry["name"]] = secrets[ref["key"]]
            else:
                assert ref.get("optional"), f"{entry['name']}: no secret key {ref['key']!r}"
        else:
            raise AssertionError(f"{entry['name']}: a source this helper does not model: {source}")
    argv = [expand(a, variables) for a in container["command"] + container.get("args", [])]
    return argv, variables


def parse_manifests(rendered: dict[str, str]) -> list[dict]:
    """Every Kubernetes object in Helm's {template path: text} output; NOTES.txt is not one."""
    import yaml

    return [doc for path, text in sorted(rendered.items()) if path.endswith((".yaml", ".yml"))
            for doc in yaml.safe_load_all(text) if doc]


def render(values: dict[str, Any], release: str = "rs", namespace: str = "ml") -> list[dict]:
    """The chart's objects for `values`, as `helm template` renders them (offline; for tests
    outside tests/helm, whose fixtures render through the same `parse_manifests`)."""
    import helm_python

    chart = Path(__file__).resolve().parents[2] / "helm" / "rollout-sidecar"
    with helm_python.Chart.load(chart) as loaded:
        return parse_manifests(loaded.render(values, name=release, namespace=namespace))
