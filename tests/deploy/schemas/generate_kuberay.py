"""Regenerate the vendored KubeRay JSON schemas from KubeRay's CRD files.

    git clone --depth 1 --branch v1.7.0 https://github.com/ray-project/kuberay /tmp/kuberay
    .venv/bin/python tests/deploy/schemas/generate_kuberay.py \
        /tmp/kuberay/ray-operator/config/crd/bases v1.7.0

What it does to the `v1` openAPIV3Schema of `ray.io_rayclusters.yaml` and `ray.io_rayjobs.yaml`
(see README.md beside this file for why):

- drops `description`s, `status` and the `x-kubernetes-*` annotations (size);
- adds `additionalProperties: false` to every object that lists its `properties` and says
  nothing of other keys: the API server rejects unknown fields of a structural CRD under
  kubectl's default strict field validation, so a typo must fail here too (an object marked
  `x-kubernetes-preserve-unknown-fields` would stay open; KubeRay v1.7.0 has none);
- drops from `required` the fields that have a `default` (the API server defaults them
  before it validates);
- turns `nullable: true` into a "null" type and the CRD's CEL rules into JSON Schema where
  they are plain set/presence rules; `self == oldSelf` (update-only) is dropped; any other
  rule stops the script, so nothing is dropped silently;
- replaces each pod template's `spec` by a `$ref` to Kubernetes' own strict PodSpec (the
  schema kubernetes-validate bundles for KUBE_VERSION, the k8s.io/api version KubeRay v1.7.0
  builds against), after checking that both list exactly the same fields; the CRD keeps its
  own (smaller) template `metadata`;
- makes RayJob's `rayClusterSpec` a `$ref` to the RayCluster schema's `spec` after checking
  they are identical; pins `apiVersion` and `kind`; requires `metadata` and `spec`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
KUBE_VERSION = "1.36"  # k8s.io/api v0.36.0 in KubeRay v1.7.0's go.mod
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"  # $id of kubernetes-validate's defs
DIALECT = "https://json-schema.org/draft/2020-12/schema"
KINDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}

# CEL rules with a JSON Schema equivalent (by rule text); `self in [...]` is handled apart.
CEL_AS_SCHEMA: dict[str, dict[str, Any]] = {
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": {
        "not": {"required": ["deletionRules"],
                "anyOf": [{"required": ["onSuccess"]}, {"required": ["onFailure"]}]}},
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": {
        "anyOf": [{"required": ["onSuccess", "onFailure"]}, {"required": ["deletionRules"]}]},
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": {
        "not": {"required": ["jobStatus", "jobDeploymentStatus"]}},
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": {
        "anyOf": [{"required": ["jobStatus"]}, {"required": ["jobDeploymentStatus"]}]},
}
CEL_UPDATE_ONLY = {"self == oldSelf"}
SELF_IN = re.compile(r"^self in \[(.*)\]$")


def schema_id(kind: str, version: str) -> str:
    return f"urn:tally:kuberay:{version}:{kind.lower()}"


def kube_defs() -> dict[str, Any]:
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = root / f"v{KUBE_VERSION}.0-local-strict" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]


def cel(rule: str, where: str) -> dict[str, Any] | None:
    """JSON Schema for one CEL rule; None for update-only rules; stops on anything else."""
    if rule in CEL_UPDATE_ONLY:
        return None
    if rule in CEL_AS_SCHEMA:
        return CEL_AS_SCHEMA[rule]
    match = SELF_IN.match(rule)
    if match:
        return {"enum": re.findall(r"'([^']*)'", match.group(1))}
    raise SystemExit(f"{where}: no JSON Schema translation for CEL rule {rule!r}; "
                     "add one to CEL_AS_SCHEMA or CEL_UPDATE_ONLY")


def is_pod_template(node: dict[str, Any]) -> bool:
    spec = node.get("properties", {}).get("spec", {})
    return set(node.get("properties", {})) == {"metadata", "spec"} and {
        "containers", "restartPolicy", "volumes"} <= set(spec.get("properties", {}))


def convert(node: Any, where: str, pod_spec_fields: set[str]) -> Any:
    if not isinstance(node, dict):
        return node
    if is_pod_template(node):
        crd_fields = set(node["properties"]["spec"]["properties"])
        if crd_fields != pod_spec_fields:
            raise SystemExit(f"{where}.spec: the CRD's pod spec differs from Kubernetes "
                             f"{KUBE_VERSION}'s PodSpec: {sorted(crd_fields ^ pod_spec_fields)}")
        node = {**node, "properties": {
            "metadata": node["properties"]["metadata"],
            "spec": {"$ref": f"{K8S_DEFS}#/$defs/io.k8s.api.core.v1.PodSpec"}}}
    out: dict[str, Any] = {}
    extra: list[dict[str, Any]] = []
    for key, value in node.items():
        if key == "description" or key.startswith("x-kubernetes-"):
            continue
        if key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: (value[name] if "$ref" in value[name]
                               else convert(value[name], f"{where}.{name}", pod_spec_fields))
                        for name in value}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = convert(value, f"{where}[]", pod_spec_fields)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [convert(v, where, pod_spec_fields) for v in value]
        elif key == "required":  # the API server fills defaults in before it validates
            defaulted = {k for k, v in node.get("properties", {}).items() if "default" in v}
            if [name for name in value if name not in defaulted]:
                out[key] = [name for name in value if name not in defaulted]
        else:
            out[key] = value
    for rule in node.get("x-kubernetes-validations", []):
        schema = cel(rule["rule"], where)
        if schema is not None:
            extra.append(schema)
    if extra:
        out["allOf"] = [*out.get("allOf", []), *extra]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def build(kind: str, crd: dict[str, Any], release: str, pod_spec_fields: set[str],
          cluster_spec: dict[str, Any] | None) -> dict[str, Any]:
    spec = crd["properties"]["spec"]
    if cluster_spec is not None:
        if convert(spec["properties"]["rayClusterSpec"], "", pod_spec_fields) != cluster_spec:
            raise SystemExit("RayJob.spec.rayClusterSpec differs from RayCluster.spec")
        spec = {**spec, "properties": {**spec["properties"], "rayClusterSpec": {
            "$ref": f"{schema_id('RayCluster', release)}#/properties/spec"}}}
    return {
        "$schema": DIALECT,
        "$id": schema_id(kind, release),
        "$comment": (f"Generated by generate_kuberay.py from KubeRay {release} "
                     f"({KINDS[kind]}, v1); Apache-2.0, see README.md. Do not edit."),
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "ray.io/v1"},
            "kind": {"const": kind},
            "metadata": {"$ref": f"{K8S_DEFS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1."
                                 "ObjectMeta"},
            "spec": convert(spec, f"{kind}.spec", pod_spec_fields),
        },
    }


def main(crd_dir: str, release: str) -> None:
    pod_spec_fields = set(kube_defs()["io.k8s.api.core.v1.PodSpec"]["properties"])
    cluster = build("RayCluster", crd_schema(Path(crd_dir) / KINDS["RayCluster"]), release,
                    pod_spec_fields, None)
    job = build("RayJob", crd_schema(Path(crd_dir) / KINDS["RayJob"]), release,
                pod_spec_fields, cluster["properties"]["spec"])
    for kind, schema in (("RayCluster", cluster), ("RayJob", job)):
        out = HERE / f"{kind.lower()}-ray-v1.json"
        out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"{out.name}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
