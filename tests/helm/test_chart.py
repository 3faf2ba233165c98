"""The Helm chart, linted and rendered offline, and its manifests checked against the
Kubernetes API schemas: what `helm install` would create, without a cluster."""

from __future__ import annotations

import base64
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (the Helm v4 SDK) is needed to render the chart"
)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is needed to check rendered manifests"
)

from tests.helm.manifests import (  # noqa: E402
    KUBE_VERSIONS,
    SERVER,
    containers,
    env,
    is_custom,
    labels_match,
    objects,
    one,
    pod_specs,
    server_container,
    validate_custom,
)

pytestmark = pytest.mark.helm

SHM_VOLUME = "rollout-sidecar-shm"
TOKEN_ENV = ("ROLLOUT_SIDECAR_API_TOKEN", "ROLLOUT_SIDECAR_ADMIN_TOKEN")


# ---- lint, schema validation ---------------------------------------------------------------


def test_ci_values_lint_clean(ci_file: Path, chart_dir: Path, load_values) -> None:
    report = helm.lint(
        chart_dir, load_values(ci_file), strict=True, kube_version=f"v{KUBE_VERSIONS[0]}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_ci_manifests_valid_kubernetes_objects(
    ci_file: Path, kube_version: str, render, load_values
) -> None:
    manifests = render(load_values(ci_file))
    assert manifests
    for manifest in manifests:
        if manifest["kind"] == "ServiceMonitor":
            check_service_monitor(manifest, manifests)
        elif is_custom(manifest):
            validate_custom(manifest, kube_version)
        else:
            kubernetes_validate.validate(manifest, kube_version, strict=True)


# kubernetes-validate ships only the built-in API's schemas, not CRDs such as the Prometheus
# Operator's ServiceMonitor, so it is checked here: the fields the CRD requires, no field
# outside the subset of monitoring.coreos.com/v1 the chart uses (a typo would be silently
# dropped by the API server), and that it really scrapes /metrics of the server's Service.
SERVICE_MONITOR_SPEC = {"selector", "endpoints"}
SERVICE_MONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout"}


def check_service_monitor(monitor: dict, manifests: list[dict]) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    spec = monitor["spec"]
    assert set(spec) == SERVICE_MONITOR_SPEC
    selector = spec["selector"]
    assert set(selector) <= {"matchLabels", "matchExpressions"}
    (service,) = [
        s
        for s in objects(manifests, "Service")
        if labels_match(selector["matchLabels"], s["metadata"]["labels"])
        and all(
            e["operator"] == "DoesNotExist" and e["key"] not in s["metadata"]["labels"]
            for e in selector.get("matchExpressions", [])
        )
    ]
    assert service["spec"].get("clusterIP") != "None", "scrapes the headless Service"
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint["interval"])


def test_bad_values_rejected_naming_the_field(bad_file: Path, render, load_values) -> None:
    expected = re.search(r"^# expect: (.+)$", bad_file.read_text(), re.M)
    assert expected, f"{bad_file.name} lacks an '# expect: <text in the error>' line"
    with pytest.raises(helm.HelmError) as error:
        render(load_values(bad_file))
    for text in expected.group(1).split():
        assert text in str(error.value)


# ---- service mode --------------------------------------------------------------------------


def test_service_mode_objects(render) -> None:
    manifests = render()
    assert sorted(m["kind"] for m in manifests) == [
        "Deployment",
        "NetworkPolicy",
        "Service",
        "Service",
    ]
    deployment = one(manifests, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for service in objects(manifests, "Service"):
        assert labels_match(service["spec"]["selector"], pod_labels)
        assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "data-plane"}
    # Trainers must reach replicas that are not ready yet: /ready waits for committed weights.
    (headless,) = [s for s in objects(manifests, "Service") if s["spec"].get("clusterIP")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True


def test_replicas_found_through_the_headless_service(render, render_notes) -> None:
    manifests = render(replicaCount=3)
    validate_all(manifests)
    deployment = one(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (headless,) = [s for s in objects(manifests, "Service") if s["spec"].get("clusterIP")]
    (service,) = [s for s in objects(manifests, "Service") if s is not headless]
    name = headless["metadata"]["name"]
    assert name == f"{service['metadata']['name']}-headless" == "rs-rollout-sidecar-headless"
    assert headless["spec"]["clusterIP"] == "None"  # DNS answers with every pod address
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert labels_match(headless["spec"]["selector"], pod_labels)
    # A dns+ URL carries the pod's port: the headless port must be the container's.
    (http,) = [p for p in headless["spec"]["ports"] if p["name"] == "http"]
    container_ports = {p["name"]: p["containerPort"] for p in server_container(manifests)["ports"]}
    assert http["port"] == container_ports["http"] == 8000
    # What `helm install` prints tells trainers and rollout workers which URL to use.
    notes = render_notes(replicaCount=3)
    assert "3 replica(s)" in notes
    namespace = r"\.[a-z0-9-]+"  # the release's
    assert re.search(rf"ROLLOUT_SIDECAR_URL=dns\+http://{name}{namespace}:8000\n", notes)
    assert re.search(
        rf"ROLLOUT_SIDECAR_URL=http://{service['metadata']['name']}{namespace}:8000\n", notes
    )
    assert "32768-60999" in notes and 'value: "32768 60999"' in notes
    assert "nodes' own ephemeral range" in render_notes(dataPlane={"setSysctl": False})


def test_pod_disruption_budget(render) -> None:
    assert not objects(render(replicaCount=3), "PodDisruptionBudget")  # opt-in
    manifests = render(replicaCount=3, podDisruptionBudget={"enabled": True})
    validate_all(manifests)
    budget = one(manifests, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]
    pod_labels = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels_match(budget["spec"]["selector"]["matchLabels"], pod_labels)
    percent = render(podDisruptionBudget={"enabled": True, "maxUnavailable": "25%"})
    assert one(percent, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"
    # The sidecar Job's pod is not a replica of anything.
    assert not objects(
        render(SIDECAR, podDisruptionBudget={"enabled": True}), "PodDisruptionBudget"
    )


def test_probes_ports_and_startup_budget(render) -> None:
    server = server_container(render())
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": 8000, "data-plane": 29600}
    assert env(server)["ROLLOUT_SIDECAR_PORT"]["value"] == "8000"
    assert env(server)["ROLLOUT_SIDECAR_DATA_PLANE_PORT"]["value"] == "29600"
    assert env(server)["ROLLOUT_SIDECAR_HOST"]["value"] == "0.0.0.0"  # probes hit the pod IP
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health")):
        assert server[probe]["httpGet"] == {"path": path, "port": "http"}
    assert server["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60

    longer = server_container(render(server={"probes": {"startup": {"failureThreshold": 360}}}))
    assert longer["startupProbe"]["failureThreshold"] == 360


def test_security_context_and_graceful_stop(render) -> None:
    (pod,) = pod_specs(render())
    assert pod["terminationGracePeriodSeconds"] >= 60  # the server drains for up to 60 s
    assert pod["enableServiceLinks"] is False
    context = server_container(render())["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_gpu_off_by_default_and_requested_when_asked(render) -> None:
    default = server_container(render())["resources"]
    assert not any("gpu" in name for part in default.values() for name in part)
    gpu = server_container(render(server={"gpu": {"count": 2}}))["resources"]
    assert gpu["requests"]["nvidia.com/gpu"] == gpu["limits"]["nvidia.com/gpu"] == 2
    assert gpu["requests"]["memory"] == f"{(8 + 2) * 1024}Mi"  # the other defaults stay


@pytest.mark.parametrize(("memory", "shm", "total"), [
    ("16Gi", "2Gi", 18 * 1024), ("96Gi", "16Gi", 112 * 1024), ("1000M", "512Mi", 1466),
    (8589934592, "1G", 9146), ("16Gi", "256Mi", 16 * 1024 + 256)])
def test_the_shm_volume_is_added_to_the_memory_given(render, memory, shm, total) -> None:
    """A memory-backed /dev/shm is RAM charged to the server that stages a
    push there: the chart adds its size to the memory request and limit, so
    a staged copy that fits the volume never meets the OOM killer."""
    resources = server_container(render(server={"resources": {
        "requests": {"memory": memory}, "limits": {"memory": memory}}},
        shm={"sizeLimit": shm}))["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == f"{total}Mi"
    unset = server_container(render(server={"resources": {  # null removes a default
        "requests": {"cpu": "2", "memory": None}, "limits": None}},
        shm={"sizeLimit": shm}))["resources"]
    assert "memory" not in unset["requests"] and "limits" not in unset  # nothing to add to


def test_kv_cache_left_to_the_server_unless_set(render) -> None:
    """Unset, the server sizes its KV cache itself: no KV variable reaches it."""
    default = env(server_container(render()))
    assert not {"ROLLOUT_SIDECAR_KV_CACHE_GIB", "VLLM_CPU_KVCACHE_SPACE"} & set(default)
    given = env(server_container(render(server={"kvCacheGib": 2.5})))
    assert given["ROLLOUT_SIDECAR_KV_CACHE_GIB"]["value"] == "2.5"


@pytest.mark.parametrize(
    ("model", "expected_path", "claim"),
    [
        ({"source": "embedded"}, None, None),
        ({"source": "image", "path": "/opt/models/llama"}, "/opt/models/llama", None),
        (
            {"source": "pvc", "pvc": {"claimName": "ckpts", "subPath": "qwen/step-100"}},
            "/models/qwen/step-100",
            "ckpts",
        ),
        ({"source": "pvc", "pvc": {"claimName": "ckpts"}}, "/models", "ckpts"),
    ],
    ids=["embedded", "image", "pvc-subpath", "pvc-root"],
)
def test_model_source(render, model: dict, expected_path: str | None, claim: str | None) -> None:
    manifests = render(model=model)
    server = server_container(manifests)
    assert env(server).get("ROLLOUT_SIDECAR_MODEL", {}).get("value") == expected_path
    (pod,) = pod_specs(manifests)
    claims = {
        v["name"]: v["persistentVolumeClaim"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    if claim is None:
        assert not claims
        return
    (name,) = claims
    assert claims[name] == {"claimName": claim, "readOnly": True}
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == name]
    assert mount == {"name": name, "mountPath": "/models", "readOnly": True}
    # The embedded model is built into the cache dir; it must be writable in every case.
    assert env(server)["ROLLOUT_SIDECAR_CACHE_DIR"]["value"] == "/var/cache/rollout-sidecar"


def test_shm_is_memory_with_size_limit_and_shared(ci_file: Path, render, load_values) -> None:
    values = load_values(ci_file)
    size = values.get("shm", {}).get("sizeLimit", "2Gi")
    for pod in pod_specs(render(values)):
        (shm,) = [v for v in pod["volumes"] if v["name"] == SHM_VOLUME]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
        for container in containers(pod):  # server and, in sidecar mode, trainer
            assert {"name": SHM_VOLUME, "mountPath": "/dev/shm"} in container["volumeMounts"]


# ---- tokens --------------------------------------------------------------------------------


def test_no_literal_token_in_any_env(ci_file: Path, render, load_values) -> None:
    values = load_values(ci_file)
    secrets = [t for t in values.get("auth", {}).values() if isinstance(t, str) and len(t) > 8]
    for pod in pod_specs(render(values)):
        for container in containers(pod):
            for entry in container.get("env", []):
                if "TOKEN" in entry["name"]:
                    assert "value" not in entry and "secretKeyRef" in entry["valueFrom"]
                assert not any(s in str(entry.get("value", "")) for s in secrets), entry["name"]


def test_existing_secret_referenced_by_name_and_key(render) -> None:
    manifests = render(
        auth={"existingSecret": "my-tokens", "apiTokenKey": "api", "adminTokenKey": "admin"}
    )
    assert not objects(manifests, "Secret")
    refs = {n: env(server_container(manifests))[n]["valueFrom"]["secretKeyRef"] for n in TOKEN_ENV}
    assert refs["ROLLOUT_SIDECAR_API_TOKEN"] == {
        "name": "my-tokens",
        "key": "api",
        "optional": True,
    }
    assert refs["ROLLOUT_SIDECAR_ADMIN_TOKEN"] == {"name": "my-tokens", "key": "admin"}


def test_created_secret_holds_the_tokens_it_is_referenced_by(render) -> None:
    api, admin = "a" * 32, "b" * 32
    manifests = render(auth={"create": True, "apiToken": api, "adminToken": admin})
    secret = one(manifests, "Secret")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {"api-token": api, "admin-token": admin}
    server_env = env(server_container(manifests))
    for name in TOKEN_ENV:
        assert server_env[name]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


def test_no_secret_means_no_token_env(render) -> None:
    manifests = render()
    assert not objects(manifests, "Secret")
    assert not set(env(server_container(manifests))) & set(TOKEN_ENV)


# ---- NetworkPolicy -------------------------------------------------------------------------


def ingress_by_port(policy: dict) -> dict[str | int | tuple[int, int], list[dict]]:
    """Peers by port: a named or single port as is, a range (port..endPort) as a tuple."""
    rules: dict[str | int | tuple[int, int], list[dict]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("ports"), "a rule without ports would open every port"
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"  # gloo, NCCL, the TCPStore and HTTP all are
            key = (port["port"], port["endPort"]) if "endPort" in port else port["port"]
            rules.setdefault(key, []).extend(rule["from"])
    return rules


def port_range_sysctl(pod: dict) -> tuple[int, int] | None:
    """The pod's net.ipv4.ip_local_port_range as (first, last), None when it sets none."""
    sysctls = [
        s["value"]
        for s in pod.get("securityContext", {}).get("sysctls", [])
        if s["name"] == "net.ipv4.ip_local_port_range"
    ]
    if not sysctls:
        return None
    (value,) = sysctls
    first, last = (int(part) for part in value.split())
    return first, last


def validate_all(manifests: list[dict]) -> None:
    for manifest in manifests:
        for kube_version in KUBE_VERSIONS:
            kubernetes_validate.validate(manifest, kube_version, strict=True)


@pytest.mark.parametrize("ci_name", ["service-default", "service-gpu-pvc", "service-replicas"])
def test_network_policy_admits_trainers_and_peers_to_data_plane_only(
    ci_name: str, render, ci_values
) -> None:
    values = ci_values[ci_name]
    manifests = render(values)
    policy = one(manifests, "NetworkPolicy")
    pod = one(manifests, "Deployment")["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    assert labels_match(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    net = values.get("networkPolicy", {})
    # Configured trainer labels replace the default rather than being merged with it.
    trainer_labels = net.get("trainerPodLabels") or {"rollout-sidecar/role": "trainer"}
    trainer: dict[str, Any] = {"podSelector": {"matchLabels": trainer_labels}}
    if net.get("trainerNamespaceLabels"):
        trainer["namespaceSelector"] = {"matchLabels": net["trainerNamespaceLabels"]}
    span = values.get("dataPlane", {}).get("portRange", {})
    port_range = (span.get("start", 32768), span.get("end", 60999))
    rules = ingress_by_port(policy)
    assert set(rules) == {"http", "data-plane", port_range}
    # The other replicas are ranks of the same group: the store and the gloo/NCCL range admit
    # them, from this namespace only (no namespaceSelector), and they match the server pods.
    (peer,) = [p for p in rules["data-plane"] if p != trainer]
    assert set(peer) == {"podSelector"}
    assert labels_match(peer["podSelector"]["matchLabels"], pod_labels)
    assert not labels_match(peer["podSelector"]["matchLabels"], trainer_labels)
    assert rules["data-plane"] == rules[port_range] == [trainer, peer]
    # The range the policy admits is the range the kernel hands out in the server pods.
    assert port_range_sysctl(pod["spec"]) == port_range
    # HTTP: trainers, the configured clients, and the other replicas only to catch up from.
    catch_up = values.get("server", {}).get("catchUpFromPeers", True)
    assert rules["http"] == [trainer, *([peer] if catch_up else []),
                             *net.get("httpClients", [])]


def test_the_servers_require_a_secret_and_bucket_tags_unless_told_not_to(render) -> None:
    """Every trainer of the chart is a WeightPusher (a secret at each connect,
    buckets tagged for servers that require it): the servers refuse others."""
    from rollout_sidecar.server.config import ServerSettings

    for mode in ({}, {"mode": "sidecar", "job": {"trainer": {"command": ["python", "t.py"]}}}):
        env = {e["name"]: e.get("value") for e in server_container(render(**mode))["env"]}
        required = ServerSettings(
            require_data_plane_secret=env["ROLLOUT_SIDECAR_REQUIRE_DATA_PLANE_SECRET"],
            require_bucket_macs=env["ROLLOUT_SIDECAR_REQUIRE_BUCKET_MACS"])
        assert required.require_data_plane_secret and required.require_bucket_macs, env
    off = render(dataPlane={"requireSecret": False, "requireBucketMacs": False})
    env = {e["name"]: e.get("value") for e in server_container(off)["env"]}
    assert env["ROLLOUT_SIDECAR_REQUIRE_BUCKET_MACS"] == "false"


def test_a_starting_replica_catches_up_from_its_peers_in_service_mode_only(
        render, ci_values) -> None:
    env = {e["name"]: e.get("value") for e in server_container(render())["env"]}
    assert env["ROLLOUT_SIDECAR_PEERS"] == "dns+http://rs-rollout-sidecar-headless:8000"
    off = {e["name"] for e in server_container(render(server={"catchUpFromPeers": False}))["env"]}
    assert "ROLLOUT_SIDECAR_PEERS" not in off
    policy = one(render(server={"catchUpFromPeers": False}), "NetworkPolicy")
    assert len(ingress_by_port(policy)["http"]) == 1  # trainers alone


def test_quantization_reaches_the_server_only_when_set(render) -> None:
    plain = {e["name"] for e in server_container(render())["env"]}
    assert "ROLLOUT_SIDECAR_QUANTIZATION" not in plain
    env = {e["name"]: e.get("value") for e in server_container(render(
        server={"quantization": "fp8_per_block"}))["env"]}
    assert env["ROLLOUT_SIDECAR_QUANTIZATION"] == "fp8_per_block"


def test_speculative_config_reaches_the_server_as_json(render) -> None:
    plain = {e["name"] for e in server_container(render())["env"]}
    assert "ROLLOUT_SIDECAR_SPECULATIVE_CONFIG" not in plain
    spec = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}
    env = {e["name"]: e.get("value") for e in server_container(render(
        server={"speculativeConfig": spec}))["env"]}
    assert json.loads(env["ROLLOUT_SIDECAR_SPECULATIVE_CONFIG"]) == spec
    from rollout_sidecar.server.config import ServerSettings  # the server parses it so

    assert ServerSettings(speculative_config=env["ROLLOUT_SIDECAR_SPECULATIVE_CONFIG"]
                          ).speculative == spec


def test_port_range_follows_values(render) -> None:
    manifests = render(dataPlane={"portRange": {"start": 40000, "end": 40999}})
    validate_all(manifests)
    rules = ingress_by_port(one(manifests, "NetworkPolicy"))
    assert (40000, 40999) in rules and (32768, 60999) not in rules
    (pod,) = pod_specs(manifests)
    assert port_range_sysctl(pod) == (40000, 40999)


@pytest.mark.parametrize("mode", ["service", "sidecar"])
def test_port_range_sysctl_on_server_pods_switchable(mode: str, render) -> None:
    base = SIDECAR if mode == "sidecar" else {}
    manifests = render(base)
    (pod,) = pod_specs(manifests)  # the Deployment's server pod, or the sidecar Job's pod
    assert port_range_sysctl(pod) == (32768, 60999)
    # Set beside, not instead of, the pod security context.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == 1000

    # Where sysctls are refused, the range must be the nodes' own: no sysctl at all then.
    (pod,) = pod_specs(render(base, dataPlane={"setSysctl": False}))
    assert "sysctls" not in pod["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True

    # A user's own (other) sysctls are kept, the range added to them.
    keepalive = {"name": "net.ipv4.tcp_keepalive_time", "value": "600"}
    manifests = render(base, podSecurityContext={"sysctls": [keepalive]})
    validate_all(manifests)
    (pod,) = pod_specs(manifests)
    assert pod["securityContext"]["sysctls"][0] == keepalive
    assert port_range_sysctl(pod) == (32768, 60999)


def test_network_policy_off_when_disabled(render) -> None:
    assert not objects(render(networkPolicy={"enabled": False}), "NetworkPolicy")


# ---- sidecar mode --------------------------------------------------------------------------

SIDECAR = {"mode": "sidecar", "job": {"trainer": {"command": ["python", "train.py"]}}}


def test_sidecar_job_runs_server_as_native_sidecar(render, ci_values) -> None:
    values = ci_values["sidecar"]
    manifests = render(values)
    assert sorted(m["kind"] for m in manifests) == ["Job", "NetworkPolicy"]
    job = one(manifests, "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (sidecar,) = pod["initContainers"]
    assert sidecar["name"] == SERVER and sidecar["restartPolicy"] == "Always"
    # The kubelet starts the trainer only once this probe passes.
    assert sidecar["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    (trainer,) = pod["containers"]
    assert trainer["command"] == values["job"]["trainer"]["command"]
    trainer_env = env(trainer)
    assert trainer_env["ROLLOUT_SIDECAR_URL"] == {
        "name": "ROLLOUT_SIDECAR_URL",
        "value": "http://localhost:8000",
    }
    for name in TOKEN_ENV:
        assert trainer_env[name]["valueFrom"] == env(sidecar)[name]["valueFrom"]
        ref = trainer_env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == values["auth"]["existingSecret"]
    # From outside the pod, only trainer pods get in; the Job's own pod is one.
    policy = one(manifests, "NetworkPolicy")
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels_match(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert labels_match(peer["podSelector"]["matchLabels"], pod_labels)


def test_trainer_url_follows_server_port(render) -> None:
    manifests = render(SIDECAR, server={"port": 8100, "dataPlanePort": 29700})
    (trainer,) = one(manifests, "Job")["spec"]["template"]["spec"]["containers"]
    assert env(trainer)["ROLLOUT_SIDECAR_URL"]["value"] == "http://localhost:8100"


def test_one_container_definition_for_both_modes(render) -> None:
    overrides = {"model": {"source": "pvc", "pvc": {"claimName": "ckpts"}}}
    deployed = server_container(render(overrides))
    sidecar = dict(server_container(render(SIDECAR, **overrides)))
    assert sidecar.pop("restartPolicy") == "Always"
    # A sidecar has no peers to catch up from: one server per trainer pod.
    deployed["env"] = [e for e in deployed["env"] if e["name"] != "ROLLOUT_SIDECAR_PEERS"]
    # Nor Services to leave before it drains: it stops when its trainer does.
    assert deployed.pop("lifecycle")["preStop"]["exec"]["command"][:2] == [
        "rollout-sidecar", "drain"]
    assert sidecar == deployed


def test_named_templates_from_a_users_chart(tmp_path: Path, chart_dir: Path, render_chart):
    """helm/examples/trainer-job, the README's way to add the sidecar to your own pod spec."""
    user_chart = tmp_path / "trainer-job"
    example = chart_dir.parent / "examples" / "trainer-job"
    shutil.copytree(example, user_chart, ignore=shutil.ignore_patterns("charts"))
    # What `helm dependency build` does with the file:// dependency.
    shutil.copytree(chart_dir, user_chart / "charts" / "rollout-sidecar")
    manifests = render_chart(user_chart)
    job = one(manifests, "Job")  # the subchart adds no Job, Deployment or Service of its own
    assert [m["kind"] for m in manifests] == ["Job"]
    kubernetes_validate.validate(job, KUBE_VERSIONS[0], strict=True)
    pod = job["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert (
        sidecar["restartPolicy"] == "Always" and sidecar["image"] == "rollout-sidecar/server:0.1.0"
    )
    (trainer,) = pod["containers"]
    assert env(trainer)["ROLLOUT_SIDECAR_URL"]["value"] == "http://localhost:8000"
    admin = env(trainer)["ROLLOUT_SIDECAR_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert admin["name"] == "rollout-sidecar-tokens"
    assert {"name": SHM_VOLUME, "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    assert port_range_sysctl(pod) == (32768, 60999)
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_users_chart_trainer_finds_every_service_replica(
    tmp_path: Path, chart_dir: Path, render_chart
) -> None:
    """The same example with the subchart in service mode: the Job is the trainer alone and
    reaches every replica through the headless Service, inside the policy's port range."""
    user_chart = tmp_path / "trainer-job"
    example = chart_dir.parent / "examples" / "trainer-job"
    shutil.copytree(example, user_chart, ignore=shutil.ignore_patterns("charts"))
    shutil.copytree(chart_dir, user_chart / "charts" / "rollout-sidecar")
    span = {"start": 45000, "end": 45999}
    manifests = render_chart(
        user_chart,
        {
            "rollout-sidecar": {
                "mode": "service",
                "replicaCount": 3,
                "dataPlane": {"portRange": span},
            }
        },
    )
    validate_all(manifests)
    assert sorted(m["kind"] for m in manifests) == [
        "Deployment",
        "Job",
        "NetworkPolicy",
        "Service",
        "Service",
    ]
    assert one(manifests, "Deployment")["spec"]["replicas"] == 3
    job = one(manifests, "Job")
    pod = job["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "volumes" not in pod  # no server in this pod
    (trainer,) = pod["containers"]
    (headless,) = [s for s in objects(manifests, "Service") if s["spec"].get("clusterIP")]
    (http,) = [p for p in headless["spec"]["ports"] if p["name"] == "http"]
    url = f"dns+http://{headless['metadata']['name']}:{http['port']}"
    assert env(trainer)["ROLLOUT_SIDECAR_URL"]["value"] == url
    assert url == "dns+http://rs-rollout-sidecar-headless:8000"
    # Trainer rank 0 listens in the same range the server pods use and admit it on.
    assert port_range_sysctl(pod) == (45000, 45999)
    rules = ingress_by_port(one(manifests, "NetworkPolicy"))
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    assert any(
        labels_match(p["podSelector"]["matchLabels"], job_labels) for p in rules[(45000, 45999)]
    )
    # With the sysctl off, the trainer pod sets none either.
    off = render_chart(user_chart, {"rollout-sidecar": {"dataPlane": {"setSysctl": False}}})
    assert "sysctls" not in one(off, "Job")["spec"]["template"]["spec"]["securityContext"]


# ---- documentation -------------------------------------------------------------------------


def doc_install_commands(text: str) -> list[list[str]]:
    """Every `helm install` command of a markdown text, line continuations joined."""
    joined = text.replace("\\\n", " ")
    return [
        shlex.split(line.split("#")[0])
        for line in joined.splitlines()
        if line.lstrip().startswith("helm install ")
    ]


def doc_section(text: str, heading: str) -> str:
    """The markdown section under `heading` (a `## ` line), up to the next `## ` heading."""
    found = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"no {heading!r} section"
    return found.group(1)


def test_documented_install_commands_render(chart_dir: Path, render, load_values) -> None:
    """The docs' `helm install` commands for this chart pass the schema and render: the chart
    README's and those of the Kubernetes section of docs/deploy.md."""
    readme = (chart_dir / "README.md").read_text()
    deploy_doc = (chart_dir.parents[1] / "docs" / "deploy.md").read_text()
    section = doc_section(deploy_doc, "## Kubernetes")
    # `-f my-values.yaml` in the docs is the README's block starting with that comment.
    my_values = re.search(r"```yaml\n# my-values.yaml\n(.*?)```", readme, re.S)
    assert my_values
    files = {"my-values.yaml": helm.values_from_yaml(my_values.group(1))}
    commands = doc_install_commands(readme) + doc_install_commands(section)
    ours = [c for c in commands if c[3] == "./helm/rollout-sidecar"]
    assert len(ours) >= 4, commands
    for command in ours:
        layers = []
        options = iter(command[4:])
        for option in options:
            argument = next(options)
            if option == "-f":
                layers.append(files.get(argument) or load_values(chart_dir.parents[1] / argument))
            elif option == "--set":
                layers.append(helm.parse_set_string(argument))
            else:
                assert option == "--set-json", command
                layers.append(helm.parse_set_json(argument))
        manifests = render(*layers)
        if any(layer.get("mode") == "sidecar" for layer in layers):
            assert one(manifests, "Job")
        else:
            assert one(manifests, "Deployment")
