"""The Kubernetes files (``scripts/deploy/k8s/``): schemas offline, their references to each other, a real server.

Every manifest is validated strictly (unknown fields are errors, as ``kubectl apply
--validate=strict``) against the Kubernetes schemas of ``kubernetes-validate``; KServe's
resources against the CRD schemas of KServe v0.20.0 kept in ``tests/fixtures/kserve``.
The prometheus-adapter rules are parsed as PromQL and the metrics they read are checked
against a real server's metrics page; Redis's start command runs against a real
redis-server; minilm's config as the ConfigMap carries it loads and serves.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import redis
import tritonclient.grpc as grpcclient
import yaml

from coalesce_tools.launcher import ServerOptions, free_port
from tests.conftest import REPOSITORY
from tests.integration.test_adaptive import text_input
from tests.integration.test_dashboards import exercise_adaptive_model, missing_samples

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "scripts" / "deploy"
K8S = DEPLOY / "k8s"
GUIDE = DEPLOY / "README.md"
KSERVE_SCHEMAS = ROOT / "tests" / "fixtures" / "kserve"
#: The oldest Kubernetes these files are meant for, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
#: The files ``kubectl apply -k`` applies; the rest (the adapter's Helm values, KServe) are applied apart.
KUSTOMIZED = ("coalesce.yaml", "redis.yaml", "hpa.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of one file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every Kubernetes object of the kustomized files, by (kind, name)."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for name in KUSTOMIZED for doc in documents(K8S / name)}


def strict(schema: Any) -> Any:
    """A CRD schema with unknown fields refused wherever it lists properties and keeps no unknown fields."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def validate_kserve(doc: dict[str, Any]) -> None:
    """Validate one KServe object against its CRD's schema.

    Raises:
        jsonschema.ValidationError: Naming the field that is wrong.
    """
    version = doc["apiVersion"].rsplit("/", 1)[1]
    path = KSERVE_SCHEMAS / f"{doc['kind']}.{version}.json.gz"
    crd = json.loads(gzip.decompress(path.read_bytes()))
    assert crd["apiVersion"] == doc["apiVersion"], (crd["apiVersion"], doc["apiVersion"])
    jsonschema.Draft7Validator(strict(crd["openAPIV3Schema"])).validate(doc)


def adapter_rules() -> list[dict[str, Any]]:
    """The custom-metric rules of the prometheus-adapter Helm values."""
    return yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]


def adapter_query(rule: dict[str, Any]) -> str:
    """A rule's metrics query as the adapter sends it for the pods of one namespace."""
    return (rule["metricsQuery"].replace("<<.LabelMatchers>>", 'namespace="default",pod=~"coalesce-.*"')
            .replace("<<.GroupBy>>", "pod"))


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The one container of a Deployment."""
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


# --- schemas ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZED)
def test_every_manifest_is_valid_kubernetes(name, version):
    docs = documents(K8S / name)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} is not valid Kubernetes {version}: "
                        f"{str(exc).splitlines()[0]} at {list(exc.path)}")


def test_the_validation_refuses_an_unknown_field():
    deployment = copy.deepcopy(manifests()[("Deployment", "coalesce")])
    container(deployment)["readinesProbe"] = container(deployment)["readinessProbe"]
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", ("servingruntime.yaml", "inferenceservice.yaml"))
def test_the_kserve_examples_match_kserves_schemas(name):
    [doc] = documents(K8S / "kserve" / name)
    validate_kserve(doc)
    broken = copy.deepcopy(doc)
    broken["spec"]["sepc"] = {}
    with pytest.raises(jsonschema.ValidationError, match="sepc"):
        validate_kserve(broken)


def test_kustomize_applies_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert tuple(kustomization["resources"]) == KUSTOMIZED
    applied_apart = {"prometheus-adapter-values.yaml", "kustomization.yaml"}
    assert {p.name for p in K8S.glob("*.yaml")} == set(KUSTOMIZED) | applied_apart


# --- the files agree with each other and with the repository -------------------------------------------------------


def test_the_configmap_carries_minilm_as_shipped_plus_the_shared_tier():
    config = manifests()[("ConfigMap", "coalesce-models")]["data"]["minilm.config.pbtxt"]
    shipped = (REPOSITORY / "minilm" / "config.pbtxt").read_text()
    added = re.search(r',\n((?:  #.*\n)*)  \{ key: "redis_url", value: \{ string_value: "([^"]+)" \} \}\n', config)
    assert added, "the ConfigMap's minilm config sets no redis_url"
    assert config.replace(added.group(0), "\n") == shipped, "the ConfigMap's minilm config drifted from the shipped one"
    service = manifests()[("Service", "coalesce-redis")]
    assert added.group(2) == f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"


def test_the_deployment_probes_the_supervisor_and_mounts_its_secrets():
    objects = manifests()
    deployment = objects[("Deployment", "coalesce")]
    main = container(deployment)
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    defaults = ServerOptions(model_repository=Path("."))
    assert ports == {"http": defaults.http_port, "grpc": defaults.grpc_port, "metrics": defaults.metrics_port,
                     "health": defaults.supervisor.health_port or 8003}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/ready", "port": "health"}, probe
    command = main["command"]
    assert command[:2] == ["coalesce", "serve"]
    loaded = [command[i + 1] for i, arg in enumerate(command) if arg == "--load-model"]
    assert loaded and all((REPOSITORY / name / "config.pbtxt").is_file() for name in loaded), loaded
    # Each *_FILE variable names a file of the mounted Secret.
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    secret = volumes["secrets"]["secret"]
    secret_files = {f"{mounts['secrets']}/{item['path']}": item["key"] for item in secret["items"]}
    files = {env["name"]: env["value"] for env in main["env"] if env["name"].endswith("_FILE")}
    assert set(files) == {"COALESCE_ADMIN_KEY_FILE", "COALESCE_REDIS_PASSWORD_FILE", "COALESCE_CACHE_KEY_FILE"}
    assert set(files.values()) == set(secret_files)
    # The guide's command creates every key the Deployment and Redis read.
    create = re.search(r"kubectl create secret generic (\S+)((?: \\\n|.)*?)\n(?!\s)", GUIDE.read_text())
    assert create, "the guide shows no `kubectl create secret generic` command"
    created = set(re.findall(r"--from-literal=([a-z-]+)=", create.group(2)))
    redis_env = container(objects[("Deployment", "coalesce-redis")])["env"]
    redis_keys = {env["valueFrom"]["secretKeyRef"]["key"] for env in redis_env}
    assert create.group(1) == secret["secretName"]
    assert set(secret_files.values()) | redis_keys == created


def test_services_select_the_pods_and_the_hpa_scales_on_the_adapters_metrics():
    objects = manifests()
    pods = objects[("Deployment", "coalesce")]["spec"]["template"]["metadata"]["labels"]
    port_names = {port["name"] for port in container(objects[("Deployment", "coalesce")])["ports"]}
    for name in ("coalesce", "coalesce-headless", "coalesce-metrics"):
        service = objects[("Service", name)]
        assert service["spec"]["selector"].items() <= pods.items(), name
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names, name
    hpa = objects[("HorizontalPodAutoscaler", "coalesce")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "coalesce"
    assert hpa["spec"]["minReplicas"] <= objects[("Deployment", "coalesce")]["spec"]["replicas"]
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]} == served
    # The adapter maps these labels to pods; the Kubernetes scrape job puts them on every series.
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-kubernetes.yml").read_text())
    labels = {step.get("target_label") for job in scrape["scrape_configs"] for step in job["relabel_configs"]}
    for rule in adapter_rules():
        assert set(rule["resources"]["overrides"]) <= labels, rule["name"]["as"]
    annotations = objects[("Deployment", "coalesce")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ServerOptions(model_repository=Path(".")).metrics_port)


def test_the_adapter_rules_are_valid_promql():
    for rule in adapter_rules():
        series = promql_parser.parse(rule["seriesQuery"])
        assert re.search(rule["name"]["matches"], series.name), rule["name"]
        promql_parser.parse(adapter_query(rule))  # raises ValueError naming what is wrong


# --- against real servers ------------------------------------------------------------------------------------------


def test_the_adapter_rules_read_metrics_a_server_exports(server, scratch_model, http_client):
    # An adaptive model, so that the backend's queue histogram exists (it is created when first used).
    exercise_adaptive_model(server, scratch_model, http_client, "k8s_adaptive")
    wanted: set[str] = set()
    for rule in adapter_rules():
        wanted |= set(re.findall(r"\b((?:nv|coalesce)_[a-z0-9_]+)\b", rule["seriesQuery"] + rule["metricsQuery"]))
    assert {"nv_inference_queue_duration_us", "nv_inference_request_success",
            "coalesce_queue_wait_seconds_sum", "coalesce_queue_wait_seconds_count"} <= wanted
    missing = missing_samples(server.metrics_url, wanted)
    assert not missing, f"the adapter rules read metrics the server does not export: {sorted(missing)}"


def test_the_configmaps_minilm_config_loads_and_serves(server, scratch_model, http_client, tmp_path):
    # The shared tier the ConfigMap names does not resolve here: the model must load and serve without it.
    config = manifests()[("ConfigMap", "coalesce-models")]["data"]["minilm.config.pbtxt"]
    target = scratch_model("k8s_minilm", source="minilm")
    (target / "config.pbtxt").write_text(config.replace('name: "minilm"', 'name: "k8s_minilm"'))
    http_client.load_model("k8s_minilm")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    vectors = client.infer("k8s_minilm", [text_input(["served from the Kubernetes config"])]).as_numpy("EMBEDDING")
    assert vectors.shape == (1, 384)
    loaded = client.get_model_config("k8s_minilm", as_json=True)["config"]["parameters"]
    assert loaded["redis_url"]["string_value"].startswith("redis://coalesce-redis:")


def test_redis_starts_with_the_password_from_its_secret_file(tmp_path):
    doc = manifests()[("Deployment", "coalesce-redis")]
    redis_container = container(doc)
    assert redis_container["command"] == ["sh", "-c"]
    [script] = redis_container["args"]
    mounts = {m["name"]: m["mountPath"] for m in redis_container["volumeMounts"]}
    secret_dir, run_dir = tmp_path / "secret", tmp_path / "run"
    secret_dir.mkdir()
    run_dir.mkdir()
    password = "0123456789abcdef" * 4  # the guide makes it with openssl rand -hex 32
    (secret_dir / "redis-password").write_text(password)
    port = free_port()
    script = (script.replace(mounts["secret"], str(secret_dir)).replace(mounts["run"], str(run_dir))
              .replace("--port 6379", f"--port {port}"))
    process = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                assert redis.Redis(port=port, password=password).ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis(port=port, password=password)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""}
        assert password not in shlex.join(Path(f"/proc/{process.pid}/cmdline").read_text().split("\0"))
        # The probes' command, as the container runs it: redis-cli reads the password from REDISCLI_AUTH.
        probe = redis_container["readinessProbe"]["exec"]["command"]
        env_names = {env["name"] for env in redis_container["env"]}
        assert "REDISCLI_AUTH" in env_names
        answered = subprocess.run([probe[0], "-p", str(port), *probe[1:]], capture_output=True, text=True,
                                  env={"REDISCLI_AUTH": password, "PATH": "/usr/bin:/bin"}, timeout=10)
        assert answered.stdout.strip() == "PONG", answered
    finally:
        process.terminate()
        process.wait(timeout=10)
