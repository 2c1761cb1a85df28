"""The compose file, the Kubernetes and KServe manifests and the Dockerfiles agree with the
server: its default ports, its real probe and metrics routes, its settings' names. Every
Kubernetes manifest is one the API server accepts: built-in kinds against the API's schemas
(kubernetes-validate), custom resources against their CRDs' (tests/docker/crds/). The
autoscalers' own checks are in test_autoscaling.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from serving import ServerProcess

from scriptserve.server.settings import ServerSettings, parse_address

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DEFAULTS = ServerSettings()
PORT = {
    name: parse_address(getattr(DEFAULTS, f"{name}_address"))[1]
    for name in ("inference", "management", "metrics", "grpc_inference", "grpc_management")
}
LIVE, READY, METRICS = "/v2/health/live", "/v2/health/ready", "/metrics"
SECRET, KEY_FILES = "scriptserve-keys", {"management-key", "inference-key"}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


K8S = {p.name: load_all(p) for p in sorted((DOCKER / "k8s").glob("*.yaml"))}
ALL_K8S = [doc for docs in K8S.values() for doc in docs]
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
IMAGE_CONFIG = yaml.safe_load((DOCKER / "config.yaml").read_text())
MAKE_IMAGE = re.search(r"^IMAGE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
# The oldest and the newest Kubernetes release the manifests are checked against.
KUBERNETES_VERSIONS = ("1.30", "1.37")
CRDS = Path(__file__).resolve().parent / "crds"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real server with an empty store: the routes the probes and Prometheus call."""
    store = tmp_path_factory.mktemp("manifests") / "store"
    store.mkdir()
    proc = ServerProcess(store).start()
    yield proc
    proc.stop()


def test_every_file_parses_and_names_known_kinds() -> None:
    kinds = sorted(d["kind"] for d in ALL_K8S)
    assert kinds == sorted(
        [
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            *["HorizontalPodAutoscaler"] * 2,
            "ScaledObject",
            "ConfigMap",
            *["ClusterServingRuntime"] * 2,
            *["InferenceService"] * 4,
        ]
    )
    assert load_all(DOCKER / "prometheus.yml")
    assert set(COMPOSE["services"]) == {"scriptserve", "prometheus", "grafana"}


def test_probe_and_metrics_paths_are_the_servers_routes(server: ServerProcess) -> None:
    assert httpx.get(server.url + LIVE).status_code == 200
    assert httpx.get(server.url + READY).status_code == 200
    assert httpx.get(server.metrics_url + METRICS).status_code == 200
    deployment = one(K8S["deployment.yaml"], "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    runtime = one(K8S["kserve.yaml"], "ClusterServingRuntime")
    (kserve,) = runtime["spec"]["containers"]
    for spec in (container, kserve):
        assert spec["livenessProbe"]["httpGet"]["path"] == LIVE
        assert spec["readinessProbe"]["httpGet"]["path"] == READY
    assert container["startupProbe"]["httpGet"]["path"] == LIVE
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == METRICS
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/path"] == METRICS
    (job,) = load_all(DOCKER / "prometheus.yml")[0]["scrape_configs"]
    assert job["metrics_path"] == METRICS


def test_ports_are_the_servers_defaults() -> None:
    five = sorted(PORT.values())
    assert sorted(parse_address(IMAGE_CONFIG[f"{n}_address"])[1] for n in PORT) == five
    for name in ("Dockerfile", "Dockerfile.gpu"):
        (expose,) = re.findall(r"^EXPOSE (.+)$", (DOCKER / name).read_text(), re.M)
        assert sorted(int(p) for p in expose.split()) == five, name

    deployment = one(K8S["deployment.yaml"], "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {
        "http": PORT["inference"],
        "management": PORT["management"],
        "metrics": PORT["metrics"],
        "grpc": PORT["grpc_inference"],
        "grpc-management": PORT["grpc_management"],
    }
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert named[container[probe]["httpGet"]["port"]] == PORT["inference"]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
        PORT["metrics"]
    )
    service = one(K8S["service.yaml"], "Service")
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == named
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]

    published = COMPOSE["services"]["scriptserve"]["ports"]
    assert sorted(published) == sorted(f"127.0.0.1:{p}:{p}" for p in five)  # loopback only
    (job,) = load_all(DOCKER / "prometheus.yml")[0]["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"scriptserve:{PORT['metrics']}"]


def test_kserve_runtime_speaks_v1_and_v2_over_rest_and_v2_over_grpc() -> None:
    docs = K8S["kserve.yaml"]
    runtime = one(docs, "ClusterServingRuntime")
    assert set(runtime["spec"]["protocolVersions"]) == {"v1", "v2", "grpc-v2"}
    (container,) = runtime["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [PORT["inference"]]
    assert container["args"][container["args"].index("--model-store") + 1] == "/mnt/models"
    services = {
        d["spec"]["predictor"]["model"]["protocolVersion"]: d
        for d in docs
        if d["kind"] == "InferenceService"
    }
    assert set(services) == {"v1", "v2", "grpc-v2"}
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    for isvc in services.values():
        model = isvc["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in formats
    (grpc_port,) = services["grpc-v2"]["spec"]["predictor"]["model"]["ports"]
    assert (grpc_port["name"], grpc_port["containerPort"]) == ("h2c", PORT["grpc_inference"])


def test_keys_come_from_the_secret() -> None:
    spec = one(K8S["deployment.yaml"], "Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (keys,) = [n for n, v in volumes.items() if "secret" in v]
    assert volumes[keys]["secret"]["secretName"] == SECRET
    files = {env[f"SCRIPTSERVE_{api}_KEY_FILE"]["value"] for api in ("MANAGEMENT", "INFERENCE")}
    assert {str(Path(f).parent) for f in files} == {mounts[keys]}
    assert {Path(f).name for f in files} == KEY_FILES
    assert not any("value" in e for n, e in env.items() if n.endswith("_KEY"))

    (kserve,) = one(K8S["kserve.yaml"], "ClusterServingRuntime")["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in kserve["env"] if "valueFrom" in e}
    assert {r["name"] for r in refs.values()} == {SECRET}
    assert {refs[f"SCRIPTSERVE_{a}_KEY"]["key"] for a in ("MANAGEMENT", "INFERENCE")} == KEY_FILES

    service = COMPOSE["services"]["scriptserve"]
    for api in ("MANAGEMENT", "INFERENCE"):
        path = Path(service["environment"][f"SCRIPTSERVE_{api}_KEY_FILE"])
        assert path.parent == Path("/run/secrets") and path.name in service["secrets"]
        assert path.name in COMPOSE["secrets"]


def test_every_scriptserve_variable_is_a_setting() -> None:
    names: set[str] = set()
    containers = [
        *one(K8S["deployment.yaml"], "Deployment")["spec"]["template"]["spec"]["containers"],
        *one(K8S["kserve.yaml"], "ClusterServingRuntime")["spec"]["containers"],
    ]
    names |= {e["name"] for c in containers for e in c["env"]}
    names |= set(COMPOSE["services"]["scriptserve"]["environment"])
    for name in ("Dockerfile", "Dockerfile.gpu", "entrypoint.sh"):
        names |= set(re.findall(r"SCRIPTSERVE_[A-Z_]+[A-Z]", (DOCKER / name).read_text()))
    names.discard("SCRIPTSERVE_CONFIG_FILE")  # read by load_settings itself
    fields = set(ServerSettings.model_fields)
    unknown = {n for n in names if n.removeprefix("SCRIPTSERVE_").lower() not in fields}
    assert not unknown, f"not settings of the server: {sorted(unknown)}"
    assert set(IMAGE_CONFIG) <= fields


def test_image_user_store_and_tag_agree() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    (uid,) = re.findall(r"^ARG UID=(\d+)$", dockerfile, re.M)
    (volume,) = re.findall(r'^VOLUME \["(.+)"\]$', dockerfile, re.M)
    assert volume == IMAGE_CONFIG["model_store"]
    assert MAKE_IMAGE is not None, "Makefile defines no IMAGE"
    spec = one(K8S["deployment.yaml"], "Deployment")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == int(uid)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["terminationGracePeriodSeconds"] > DEFAULTS.drain_timeout_s
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {volume, "/tmp"}
    assert "cpu" in container["resources"]["requests"]
    assert "memory" in container["resources"]["requests"]
    (kserve,) = one(K8S["kserve.yaml"], "ClusterServingRuntime")["spec"]["containers"]
    images = {container["image"], kserve["image"], COMPOSE["services"]["scriptserve"]["image"]}
    assert images == {MAKE_IMAGE.group(1)}


# --- schemas: what the API server would accept ------------------------------------------------


def rejecting_unknown_fields(schema: Any) -> Any:
    """A CRD's schema as `kubectl apply` enforces it: its field validation is strict by default
    (since Kubernetes 1.27), so a field the schema does not declare is an error, except where
    the schema keeps unknown fields. JSON Schema allows undeclared properties unless told."""
    if isinstance(schema, list):
        return [rejecting_unknown_fields(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: {name: rejecting_unknown_fields(sub) for name, sub in value.items()}
        if key in ("properties", "$defs")
        else rejecting_unknown_fields(value)
        for key, value in schema.items()
    }
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in schema and "additionalProperties" not in schema and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of the vendored CRD's schema of that version. The
    CRDs' CEL rules (x-kubernetes-validations) are not checked."""
    found: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version, schema in crd["versions"].items():
            strict = rejecting_unknown_fields(schema)
            jsonschema.Draft202012Validator.check_schema(strict)
            found[(f"{crd['group']}/{version}", crd["kind"])] = jsonschema.Draft202012Validator(
                strict
            )
    return found


CRD_VALIDATORS = crd_validators()


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Why the API server would refuse `doc`: a custom resource against its CRD, a built-in kind
    against each of KUBERNETES_VERSIONS (SchemaNotFoundError for a kind with neither)."""
    validator = CRD_VALIDATORS.get((doc["apiVersion"], doc["kind"]))
    if validator is not None:
        return [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)
        ]
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")
    return errors


@pytest.mark.parametrize(
    "doc",
    [pytest.param(d, id=f"{name}:{d['kind']}/{d['metadata']['name']}")
     for name, docs in K8S.items() for d in docs],
)  # fmt: skip
def test_every_manifest_matches_its_schema(doc: dict[str, Any]) -> None:
    assert schema_errors(doc) == []


def has_api_schema(doc: dict[str, Any]) -> bool:
    """Whether kubernetes-validate knows `doc`'s kind (built-in kinds do, custom ones not)."""
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1])
    except kubernetes_validate.SchemaNotFoundError:
        return False
    return True


def test_the_vendored_crds_are_those_of_the_custom_kinds() -> None:
    custom = {(d["apiVersion"], d["kind"]) for d in ALL_K8S if not has_api_schema(d)}
    assert custom == {
        ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
        ("serving.kserve.io/v1beta1", "InferenceService"),
        ("keda.sh/v1alpha1", "ScaledObject"),
    }
    assert set(CRD_VALIDATORS) == custom
    for path in CRDS.glob("*.yaml"):
        header = path.read_text().split("\ngroup:", 1)[0]
        source = r"^# Source: https://github\.com/[\w.-]+/[\w.-]+, \S+\.yaml,$"
        assert re.search(source, header, re.M), path.name
        assert re.search(r"^# commit [0-9a-f]{40} ", header, re.M), path.name
        assert "Apache License, Version 2.0" in header, path.name


@dataclass(frozen=True)
class Rename:
    """A field's new name, for `edited`."""

    to: str


def edited(path: str, doc: dict[str, Any], value: Any) -> dict[str, Any]:
    """A copy of `doc` with the dotted `path` (list indexes as numbers) set to `value`, or
    renamed when `value` is a `Rename`."""
    doc = yaml.safe_load(yaml.safe_dump(doc))
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = doc
    for key in parents:
        node = node[key]
    if isinstance(value, Rename):
        node[value.to] = node.pop(last)
    else:
        node[last] = value
    return doc


# Each validation path refuses a wrong type and a misspelt field: a checker that accepts
# anything would pass the test above.
@pytest.mark.parametrize(
    ("file", "kind", "path", "value", "error"),
    [
        ("deployment.yaml", "Deployment", "spec.replicas", "2", "is not of type 'integer'"),
        ("deployment.yaml", "Deployment", "spec.template.spec.containers.0.readinessProbe",
         Rename("readynessProbe"), "'readynessProbe' was unexpected"),
        ("hpa-queue-depth.yaml", "HorizontalPodAutoscaler", "spec.metrics.0.type", 7,
         "is not of type 'string'"),
        ("keda-scaledobject.yaml", "ScaledObject", "spec.minReplicaCount", "2",
         "is not of type 'integer'"),
        ("keda-scaledobject.yaml", "ScaledObject", "spec.triggers.0.metadata.threshold", 64,
         "is not of type 'string'"),
        ("keda-scaledobject.yaml", "ScaledObject", "spec.scaleTargetRef.name",
         Rename("deployment"), "'name' is a required property"),
        ("keda-scaledobject.yaml", "ScaledObject", "spec.pollingInterval",
         Rename("pollInterval"), "'pollInterval' was unexpected"),
        ("kserve.yaml", "ClusterServingRuntime", "spec.containers.0.ports.0.containerPort", "80",
         "is not of type 'integer'"),
        ("kserve.yaml", "InferenceService", "spec.predictor.model.storageUri",
         Rename("storageURI"), "'storageURI' was unexpected"),
    ],
)  # fmt: skip
def test_the_schemas_refuse_a_broken_manifest(
    file: str, kind: str, path: str, value: Any, error: str
) -> None:
    doc = next(d for d in K8S[file] if d["kind"] == kind)
    assert schema_errors(doc) == []
    errors = schema_errors(edited(path, doc, value))
    assert any(error in e for e in errors), errors
