"""Custom resources' schemas, as their own projects publish them, for the chart tests.

kubernetes-validate ships the built-in API only. For a custom resource the chart renders, the
API server checks it against the openAPIV3Schema of the CRD its project installs; the tests
check it the same way, with that schema kept here (`crds/`): the CRD's own, descriptions
stripped (they are most of its bytes and no check reads them). Kept, not fetched: the tests
run offline.

  leaderworkerset.x-k8s.io/v1 LeaderWorkerSet: kubernetes-sigs/lws (Apache-2.0), commit
  060ab4da17eea1f0865fcbd3236bb1075e2cea32 (2026-08-21),
  config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml
  ray.io/v1 RayCluster: ray-project/kuberay (Apache-2.0), commit
  feeaf72facab4881ba2b179248bb67315634e229 (2026-08-19),
  ray-operator/config/crd/bases/ray.io_rayclusters.yaml

A newer CRD: `python -m tests.helm.crd_schemas CRD.yaml VERSION` writes that version's schema
here, and the lines above say which commit it came from.

`strict` adds what `kubectl apply --validate=strict` does: a field the schema does not name is
an error, not silently pruned (a misspelt key would otherwise vanish on the server).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CRDS = Path(__file__).with_name("crds")


def schema_file(resource: str, version: str) -> Path:
    """`resource`: the CRD's name, plural.group (`leaderworkersets.leaderworkerset.x-k8s.io`)."""
    return CRDS / f"{resource}_{version}.schema.json"


def load(resource: str, version: str) -> dict[str, Any]:
    return json.loads(schema_file(resource, version).read_text())


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the API server would prune them."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _without_descriptions(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _without_descriptions(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_without_descriptions(s) for s in schema]
    return schema


def write_from_crd(crd_path: Path, wanted: str) -> Path:
    """The schema of version `wanted` of the CRD at `crd_path`, into `crds/`."""
    import yaml

    crd = yaml.safe_load(crd_path.read_text())
    for version in crd["spec"]["versions"]:
        if version["name"] != wanted:
            continue
        path = schema_file(crd["metadata"]["name"], version["name"])
        schema = _without_descriptions(version["schema"]["openAPIV3Schema"])
        path.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
        return path
    raise SystemExit(f"{crd_path} has no version {wanted}")


if __name__ == "__main__":
    print(write_from_crd(Path(sys.argv[1]), sys.argv[2]))
