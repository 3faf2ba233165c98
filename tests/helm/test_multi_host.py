"""The chart's multi-host mode (`multiHost.enabled`): each replica one vLLM engine over
`multiHost.nnodes` pods, a LeaderWorkerSet group, rendered offline and checked against
LeaderWorkerSet's own CRD schema (tests/helm/crds). That the commands it renders serve a push
exactly across two hosts is tests/e2e/test_multinode.py's: it renders them and runs them."""

from __future__ import annotations

import pytest

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (the Helm v4 SDK) is needed to render the chart"
)
pytest.importorskip("kubernetes_validate", reason="kubernetes-validate checks the pod templates")
from tests.helm.manifests import (  # noqa: E402
    KUBE_VERSIONS,
    SERVER,
    containers,
    env,
    labels_match,
    objects,
    one,
    pod_process,
    validate_custom,
)

pytestmark = pytest.mark.helm

MULTI = {"multiHost": {"enabled": True, "nnodes": 3}, "auth": {"existingSecret": "tokens"}}
LWS_ENV = {"LWS_LEADER_ADDRESS": "rs-rollout-sidecar-0.rs-rollout-sidecar.ml",
           "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "2"}
SECRETS = {"api-token": "a" * 32, "admin-token": "b" * 32}


def hosts(manifests: list[dict]) -> dict[str, dict]:
    """The leader's and the worker's template, by role."""
    template = one(manifests, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def server(template: dict) -> dict:
    (c,) = [c for c in containers(template["spec"]) if c["name"] == SERVER]
    return c


def test_each_replica_is_a_leader_worker_set_group_valid_against_its_crd(render) -> None:
    manifests = render(MULTI, replicaCount=2)
    assert sorted(m["kind"] for m in manifests) == [
        "LeaderWorkerSet", "NetworkPolicy", "Service", "Service"]
    lws = one(manifests, "LeaderWorkerSet")
    for kube_version in KUBE_VERSIONS:
        validate_custom(lws, kube_version)
    assert lws["spec"]["replicas"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 3
    # A lost host ends its engine: the group restarts whole.
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_a_schema_error_is_found_by_the_crd_check(render) -> None:
    """The check can fail: a misspelt field the API server would drop is refused."""
    lws = one(render(MULTI), "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 3
    with pytest.raises(AssertionError, match="sizee"):
        validate_custom(lws, KUBE_VERSIONS[0])


def test_the_leader_serves_as_node_0_and_each_worker_runs_headless_as_its_index(render) -> None:
    by_role = {role: pod_process(server(t), {**LWS_ENV, "LWS_WORKER_INDEX": str(index)},
                                 f"10.0.0.{index + 1}", SECRETS)
               for role, t, index in ((r, t, 0 if r == "leader" else 2)
                                      for r, t in hosts(render(MULTI)).items())}
    (leader, leader_env), (worker, worker_env) = by_role["leader"], by_role["worker"]
    node = ["--nnodes", "3", "--master-addr", LWS_ENV["LWS_LEADER_ADDRESS"],
            "--master-port", "29501"]
    assert leader == ["rollout-sidecar", "serve", "--node-rank", "0", *node]
    assert worker == ["rollout-sidecar", "serve", "--headless", "--node-rank", "2",
                      "--head-gone-s", "60", *node]
    # Each names itself by its pod IP for vLLM's queues and gloo.
    assert (leader_env["VLLM_HOST_IP"], worker_env["VLLM_HOST_IP"]) == ("10.0.0.1", "10.0.0.3")
    assert leader_env["GLOO_SOCKET_IFNAME"] == worker_env["GLOO_SOCKET_IFNAME"] == "eth0"
    # The same settings on every host; the leader alone holds tokens and catches up.
    leader_only = {"ROLLOUT_SIDECAR_API_TOKEN", "ROLLOUT_SIDECAR_ADMIN_TOKEN",
                   "ROLLOUT_SIDECAR_PEERS"}
    own = leader_only | {"VLLM_HOST_IP", "LWS_WORKER_INDEX"}
    assert set(leader_env) - set(worker_env) == leader_only
    assert {k: v for k, v in leader_env.items() if k not in own} == \
        {k: v for k, v in worker_env.items() if k not in own}


def test_a_worker_pod_has_no_http_probes_or_tokens(render) -> None:
    roles = hosts(render(MULTI))
    leader, worker = server(roles["leader"]), server(roles["worker"])
    assert {p["name"] for p in leader["ports"]} == {"http", "data-plane"}
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(leader)
    assert "ports" not in worker
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(worker)
    assert not [n for n in env(worker) if "TOKEN" in n]


def test_services_select_the_leaders_and_the_policy_every_pod_of_a_group(render) -> None:
    manifests = render(MULTI)
    roles = hosts(manifests)
    leader, worker = (roles[r]["metadata"]["labels"] for r in ("leader", "worker"))
    for service in objects(manifests, "Service"):
        assert labels_match(service["spec"]["selector"], leader), service["metadata"]["name"]
        assert not labels_match(service["spec"]["selector"], worker), service["metadata"]["name"]
    policy = one(manifests, "NetworkPolicy")
    for labels in (leader, worker):  # both are ranks of the data plane
        assert labels_match(policy["spec"]["podSelector"]["matchLabels"], labels)
    (master,) = [rule for rule in policy["spec"]["ingress"]
                 if rule["ports"] == [{"port": 29501, "protocol": "TCP"}]]
    (peer,) = master["from"]
    assert labels_match(peer["podSelector"]["matchLabels"], worker)


def test_every_pod_of_a_group_is_sized_as_a_one_host_server(render) -> None:
    """/dev/shm and memory per pod, as the Deployment's pod gets them."""
    values = {"server": {"gpu": {"count": 8}}, "shm": {"sizeLimit": "18Gi"}}
    (single,) = [m["spec"]["template"] for m in render(values) if m["kind"] == "Deployment"]
    for template in hosts(render(values, **MULTI)).values():
        assert server(template)["resources"] == server(single)["resources"]
        assert template["spec"]["volumes"] == single["spec"]["volumes"]
        assert template["spec"]["securityContext"] == single["spec"]["securityContext"]
