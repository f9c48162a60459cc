"""The Kubernetes manifests under deploy/: rendered with `kubectl kustomize`, every core object
validated against Kubernetes' own schemas (kubernetes-validate, strict), every KEDA,
prometheus-operator and KServe object against the CRDs published by those projects
(deploy/crds), and the properties the deployment relies on checked one by one: probes on the
right paths, a grace period that covers the drain, the router pointed at the headless Service,
one autoscaler per overlay, GPUs only where asked for.

Needs kubectl (for its built-in kustomize): skipped without it, failed without it under CI.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")
from kubernetes_validate.utils import latest_version  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRDS = DEPLOY / "crds"

KEDA_OVERLAYS = ("overlays/cpu", "overlays/gpu")
SERVER_OVERLAYS = (*KEDA_OVERLAYS, "overlays/hpa")
RENDERED = (*SERVER_OVERLAYS, "kserve")

# API groups whose objects are checked against deploy/crds rather than Kubernetes' schemas
CRD_GROUPS = ("keda.sh", "monitoring.coreos.com", "serving.kserve.io")

Obj = dict[str, Any]


# --- rendering -------------------------------------------------------------------------------


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed (needed to render deploy/ with kustomize)")
        pytest.skip("kubectl is not installed")
    return path


@cache
def _render(directory: str) -> tuple[Obj, ...]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(DEPLOY / directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return tuple(o for o in yaml.safe_load_all(result.stdout) if o is not None)


def render(directory: str) -> list[Obj]:
    """The objects of one kustomization, as `kubectl kustomize` prints them (fresh copies)."""
    return copy.deepcopy(list(_render(directory)))


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def group_of(obj: Obj) -> str:
    api_version: str = obj["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


# --- schema validation -----------------------------------------------------------------------


@cache
def _k8s_version() -> str:
    return str(latest_version())


def validate_core(obj: Obj) -> None:
    """Kubernetes' OpenAPI schema of the newest version kubernetes-validate ships, strict:
    a misspelt field is an error, as `kubectl apply --validate=strict` makes it."""
    kubernetes_validate.validate(obj, _k8s_version(), strict=True)


def _pruning(schema: Any) -> Any:
    """A CRD schema made to reject what the API server would silently prune: an object
    schema that lists its properties and neither allows others nor preserves unknown fields
    gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_pruning(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _pruning(value) for key, value in schema.items()}
    if (
        schema.get("type") == "object"
        and isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@cache
def _crd_schemas() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> the strict openAPIV3Schema of every served CRD version."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        with path.open() as f:
            crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        assert crd["kind"] == "CustomResourceDefinition", path
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served", True):
                schema = version["schema"]["openAPIV3Schema"]
                key = (spec["group"], version["name"], spec["names"]["kind"])
                schemas[key] = _pruning(schema)
    return schemas


def validate_custom(obj: Obj) -> None:
    group, _, version = obj["apiVersion"].partition("/")
    key = (group, version, obj["kind"])
    schemas = _crd_schemas()
    assert key in schemas, f"no CRD in deploy/crds for {obj['apiVersion']} {obj['kind']}"
    jsonschema.validate(obj, schemas[key], cls=jsonschema.Draft202012Validator)


def validate(obj: Obj) -> None:
    if group_of(obj) in CRD_GROUPS:
        validate_custom(obj)
    else:
        validate_core(obj)


@pytest.mark.parametrize("directory", RENDERED)
def test_every_object_is_valid_against_its_schema(directory: str) -> None:
    objects = render(directory)
    assert objects
    for obj in objects:
        try:
            validate(obj)
        except Exception as exc:  # the object's name in the failure, not only the schema path
            pytest.fail(f"{directory}: {obj['kind']} {obj['metadata'].get('name')}: {exc}")


def test_crds_are_the_published_ones_for_every_custom_kind_used() -> None:
    kinds = {(g, v, k) for g, v, k in _crd_schemas()}
    for group, version, kind in (
        ("keda.sh", "v1alpha1", "ScaledObject"),
        ("monitoring.coreos.com", "v1", "ServiceMonitor"),
        ("serving.kserve.io", "v1alpha1", "ClusterServingRuntime"),
        ("serving.kserve.io", "v1alpha1", "ServingRuntime"),
        ("serving.kserve.io", "v1beta1", "InferenceService"),
    ):
        assert (group, version, kind) in kinds


def test_the_validators_reject_a_misspelt_field() -> None:
    """The validation above is not vacuous: a typo fails it, in core and custom objects."""
    objects = render("overlays/cpu")
    deployment = one(objects, "Deployment", "lockgate")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = one(objects, "ScaledObject", "lockgate")
    scaled["spec"]["minReplicas"] = 2  # HPA's name for KEDA's minReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    monitor = one(objects, "ServiceMonitor", "lockgate")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"  # not a Prometheus duration
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    runtime = one(render("kserve"), "ClusterServingRuntime", "lockgate")
    runtime["spec"]["supportedModelFormats"][0]["priority"] = 0  # KServe's minimum is 1
    with pytest.raises(jsonschema.ValidationError):
        validate(runtime)


# --- the server and the router ---------------------------------------------------------------


def containers(deployment: Obj) -> list[Obj]:
    result: list[Obj] = deployment["spec"]["template"]["spec"]["containers"]
    return result


def pod_labels(deployment: Obj) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` (or `--name=VALUE`) in a container's args."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def port_number(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"container {container['name']} has no port named {port}"
    return int(named[0])


def prestop_sleep(container: Obj) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_deployments_probe_the_health_routes_and_outlast_the_drain(directory: str) -> None:
    objects = render(directory)
    deployments = of_kind(objects, "Deployment")
    assert {d["metadata"]["name"] for d in deployments} == {"lockgate", "lockgate-router"}
    server = next(d for d in deployments if d["metadata"]["name"] == "lockgate")
    assert flag(containers(server)[0]["args"], "--health-port") is not None  # probes apart
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        (container,) = containers(deployment)
        # probes go to --health-port when the server has one (its own thread), else to http
        health = flag(container["args"], "--health-port")
        probed = int(health) if health is not None else port_number(container, "http")
        expected = {
            "startupProbe": "/v2/health/live",
            "readinessProbe": "/v2/health/ready",
            "livenessProbe": "/v2/health/live",
        }
        for probe_name, path in expected.items():
            probe = container.get(probe_name)
            assert probe is not None, f"{name}: no {probe_name}"
            assert probe["httpGet"]["path"] == path, f"{name}: {probe_name}"
            assert port_number(container, probe["httpGet"]["port"]) == probed, f"{name}"
        liveness = container["livenessProbe"]
        assert liveness.get("timeoutSeconds", 1) >= 1
        assert liveness.get("failureThreshold", 3) == 3
        startup = container["startupProbe"]
        assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 60, (
            f"{name}: the startup probe should allow a minute or more"
        )

        sleep = prestop_sleep(container)
        args = container["args"]
        drain = float(flag(args, "--drain-timeout") or 30.0)  # the router drains as long
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > 30
        assert 3 <= sleep <= 10
        assert grace > sleep + drain, f"{name}: SIGKILL would cut the drain short"


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_server_serves_the_mounted_repository_on_its_declared_ports(directory: str) -> None:
    objects = render(directory)
    deployment = one(objects, "Deployment", "lockgate")
    (container,) = containers(deployment)
    args = container["args"]
    assert args[:2] == ["serve", "/models"]
    assert flag(args, "--host") == "0.0.0.0"
    assert int(flag(args, "--port") or 0) == port_number(container, "http") == 8000
    assert int(flag(args, "--grpc-port") or 0) == port_number(container, "grpc") == 8001
    assert "--strict-readiness" in args  # ready only when every model is
    env = {e["name"]: e for e in container["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # the autoscaler owns the replica count: a replicas field would reset it on each apply
    assert "replicas" not in deployment["spec"]
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_router_discovers_the_ready_server_pods_through_the_headless_service(
    directory: str,
) -> None:
    objects = render(directory)
    server = one(objects, "Deployment", "lockgate")
    router = one(objects, "Deployment", "lockgate-router")
    headless = one(objects, "Service", "lockgate-replicas")

    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"].get("publishNotReadyAddresses", False) is False
    assert headless["spec"]["selector"].items() <= pod_labels(server).items()
    (http_port,) = [p for p in headless["spec"]["ports"] if p["name"] == "http"]
    (server_container,) = containers(server)
    assert port_number(server_container, http_port["targetPort"]) == http_port["port"]

    (container,) = containers(router)
    args = container["args"]
    assert args[0] == "route"
    assert flag(args, "--host") == "0.0.0.0"
    assert int(flag(args, "--port") or 0) == port_number(container, "http")
    expected = f"lockgate-replicas.$(NAMESPACE).svc.cluster.local:{http_port['port']}"
    assert flag(args, "--discover") == expected
    # $(NAMESPACE) expands only from an env var of the same container
    env = {e["name"]: e for e in container["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert router["spec"]["replicas"] >= 2


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_router_keeps_its_model_control_state_on_a_pod_volume(directory: str) -> None:
    """`--control-state` names a file on an emptyDir mounted in the router's container (its
    root filesystem is read-only), so a restart of the container reads the state back."""
    router = one(render(directory), "Deployment", "lockgate-router")
    (container,) = containers(router)
    state = flag(container["args"], "--control-state")
    assert state is not None and state != "off", container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = [
        m
        for m in container["volumeMounts"]
        if Path(state).parent.is_relative_to(m["mountPath"]) and not m.get("readOnly", False)
    ]
    assert mounts, f"{state} is on no writable mount of the router"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the innermost
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mount["name"]], volumes[mount["name"]]
    assert volumes[mount["name"]]["emptyDir"].get("medium") != "Memory"


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_services_and_budgets_select_the_pods_they_are_for(directory: str) -> None:
    objects = render(directory)
    server = one(objects, "Deployment", "lockgate")
    router = one(objects, "Deployment", "lockgate-router")
    expected = {"lockgate": server, "lockgate-replicas": server, "lockgate-router": router}
    services = of_kind(objects, "Service")
    assert {s["metadata"]["name"] for s in services} == set(expected)
    for service in services:
        name = service["metadata"]["name"]
        target = expected[name]
        assert service["spec"]["selector"].items() <= pod_labels(target).items(), name
        other = router if target is server else server
        assert not service["spec"]["selector"].items() <= pod_labels(other).items(), name
        (container,) = containers(target)
        for port in service["spec"]["ports"]:
            port_number(container, port["targetPort"])  # a port the container declares
    main = one(objects, "Service", "lockgate")
    assert main["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {p["port"] for p in main["spec"]["ports"]} == {8000, 8001}

    budgets = {p["metadata"]["name"]: p for p in of_kind(objects, "PodDisruptionBudget")}
    budget = budgets["lockgate"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels(server).items()
    assert budget["spec"].get("maxUnavailable") == 1 or budget["spec"].get("minAvailable") == 1


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_service_monitor_scrapes_server_and_router_metrics_once(directory: str) -> None:
    objects = render(directory)
    (monitor,) = of_kind(objects, "ServiceMonitor")
    selector = monitor["spec"]["selector"]

    def selected(service: Obj) -> bool:
        labels = service["metadata"].get("labels", {})
        if not selector.get("matchLabels", {}).items() <= labels.items():
            return False
        for expression in selector.get("matchExpressions", []):
            assert expression["operator"] == "In"
            if labels.get(expression["key"]) not in expression["values"]:
                return False
        return True

    scraped = {s["metadata"]["name"] for s in of_kind(objects, "Service") if selected(s)}
    assert scraped == {"lockgate", "lockgate-router"}  # not lockgate-replicas: same pods
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    for name in scraped:
        ports = one(objects, "Service", name)["spec"]["ports"]
        assert "http" in {p["name"] for p in ports}


@pytest.mark.parametrize("directory", SERVER_OVERLAYS)
def test_example_model_config_is_mounted_and_reads_as_a_lockgate_model(
    directory: str, tmp_path: Path
) -> None:
    from lockgate.core.repository import scan_model

    objects = render(directory)
    deployment = one(objects, "Deployment", "lockgate")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}

    config_mount = mounts["/models/digits/config.yaml"]
    volume = volumes[config_mount["name"]]["configMap"]
    (item,) = [i for i in volume["items"] if i["path"] == config_mount["subPath"]]
    config_map = one(objects, "ConfigMap", volume["name"])
    assert config_map["metadata"]["name"].startswith("lockgate-models")
    weights = mounts["/models/digits/1"]
    claim = volumes[weights["name"]]["persistentVolumeClaim"]["claimName"]
    one(objects, "PersistentVolumeClaim", claim)
    assert weights.get("readOnly") is True

    model = tmp_path / "digits"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text(config_map["data"][item["key"]])
    entry = scan_model(tmp_path.resolve(), model)
    assert entry.ok, entry.error
    assert entry.versions == [1]


# --- autoscaling -----------------------------------------------------------------------------


def _defined_metrics() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "lockgate").rglob("*.py"):
        names.update(re.findall(r"[\"'](lockgate_[a-z0-9_]+)[\"']", path.read_text()))
    return names


@pytest.mark.parametrize("directory", KEDA_OVERLAYS)
def test_keda_overlays_scale_the_server_on_queued_work(directory: str) -> None:
    objects = render(directory)
    assert of_kind(objects, "HorizontalPodAutoscaler") == []
    (scaled,) = of_kind(objects, "ScaledObject")
    deployment = one(objects, "Deployment", "lockgate")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target["name"] == "lockgate"
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]

    namespace = deployment["metadata"]["namespace"]
    defined = _defined_metrics()
    queries = []
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
        assert float(metadata["threshold"]) > 0
        query = metadata["query"]
        queries.append(query)
        assert f'namespace="{namespace}"' in query, query  # written in by the overlay
        for metric in re.findall(r"lockgate_[a-z0-9_]+", query):
            assert metric in defined, f"{metric} is not a metric lockgate exports"
    assert any(q.startswith("sum(max_over_time(lockgate_queue_depth") for q in queries)


def test_thresholds_are_set_per_overlay() -> None:
    def threshold(directory: str) -> float:
        (scaled,) = of_kind(render(directory), "ScaledObject")
        return float(scaled["spec"]["triggers"][0]["metadata"]["threshold"])

    assert threshold("overlays/gpu") > threshold("overlays/cpu")


def test_hpa_overlay_has_an_hpa_on_cpu_and_no_scaled_object() -> None:
    objects = render("overlays/hpa")
    assert of_kind(objects, "ScaledObject") == []
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "lockgate",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    # utilization is of the CPU request: every container needs one
    (container,) = containers(one(objects, "Deployment", "lockgate"))
    assert "cpu" in container["resources"]["requests"]


def test_the_base_alone_has_keda_and_no_hpa() -> None:
    objects = render("overlays/cpu")
    assert len(of_kind(objects, "ScaledObject")) == 1
    assert of_kind(objects, "HorizontalPodAutoscaler") == []


# --- CPU and GPU -----------------------------------------------------------------------------


def server_resources(directory: str) -> dict[str, dict[str, Any]]:
    (container,) = containers(one(render(directory), "Deployment", "lockgate"))
    resources: dict[str, dict[str, Any]] = container["resources"]
    return resources


def test_gpu_overlay_requests_a_gpu_on_gpu_nodes() -> None:
    objects = render("overlays/gpu")
    pod = one(objects, "Deployment", "lockgate")["spec"]["template"]["spec"]
    assert str(server_resources("overlays/gpu")["limits"]["nvidia.com/gpu"]) == "1"
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert any(
        t["key"] == "nvidia.com/gpu" and t.get("effect", "NoSchedule") == "NoSchedule"
        for t in pod["tolerations"]
    )
    router = one(objects, "Deployment", "lockgate-router")
    (router_container,) = containers(router)
    assert "nvidia.com/gpu" not in router_container["resources"].get("limits", {})


@pytest.mark.parametrize("directory", ("overlays/cpu", "overlays/hpa"))
def test_cpu_deployments_ask_for_no_gpu(directory: str) -> None:
    for deployment in of_kind(render(directory), "Deployment"):
        (container,) = containers(deployment)
        assert not any("nvidia.com" in k for k in container["resources"].get("limits", {}))
        assert "nodeSelector" not in deployment["spec"]["template"]["spec"]


def test_cpu_overlay_gives_the_server_whole_guaranteed_cores() -> None:
    resources = server_resources("overlays/cpu")
    assert resources["requests"] == resources["limits"]
    assert float(resources["limits"]["cpu"]).is_integer()


# --- KServe ----------------------------------------------------------------------------------


def test_kserve_runtime_serves_v2_on_kserve_ports() -> None:
    objects = render("kserve")
    runtime = one(objects, "ClusterServingRuntime", "lockgate")
    spec = runtime["spec"]
    assert set(spec["protocolVersions"]) >= {"v1", "v2", "grpc-v2"}
    formats = {f["name"] for f in spec["supportedModelFormats"]}
    assert formats >= {"onnx", "sklearn", "pytorch", "triton"}
    # never auto-selected: KServe's lowest priority is Triton's already (see the manifest)
    assert not any(f.get("autoSelect") for f in spec["supportedModelFormats"])
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    args = container["args"]
    assert args[:2] == ["serve", "/mnt/models"]
    assert flag(args, "--model-name") == "{{.Name}}"  # a bare model file: the isvc's name
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == "8080" and flag(args, "--grpc-port") == "9000"
    assert [p["containerPort"] for p in container["ports"]] == [8080]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    # its probes share the serving port: accepted on a thread, answered at once under load
    assert int(flag(args, "--accepts-per-turn") or 0) > 0


def test_kserve_inference_service_uses_the_lockgate_runtime() -> None:
    objects = render("kserve")
    runtime = one(objects, "ClusterServingRuntime", "lockgate")
    isvc = one(objects, "InferenceService", "digits")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == "lockgate"
    assert model["modelFormat"]["name"] == "onnx"
    supported = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in supported
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert model["storageUri"] == "gs://example-bucket/digits/model.onnx"


def test_kserve_runtime_args_are_lockgate_serve_options() -> None:
    """The runtime's args, as KServe substitutes them, parse as `lockgate serve`'s own."""
    from lockgate import cli

    runtime = one(render("kserve"), "ClusterServingRuntime", "lockgate")
    (container,) = runtime["spec"]["containers"]
    args = [arg.replace("{{.Name}}", "digits") for arg in container["args"]]
    parser = argparse.ArgumentParser()
    cli._add_serve(parser.add_subparsers())
    parsed = parser.parse_args(args)
    assert (parsed.repository, parsed.model_name) == (Path("/mnt/models"), "digits")


# --- the image -------------------------------------------------------------------------------


def _dockerfile_instructions() -> Iterator[tuple[str, str]]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            yield instruction.upper(), rest.strip()


def test_dockerfile_runs_lockgate_as_a_non_root_user() -> None:
    instructions = list(_dockerfile_instructions())
    final_stage = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    final = instructions[final_stage:]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0].isdigit()  # numeric, for runAsNonRoot
    assert ("EXPOSE", "8000 8001 8002") in final  # HTTP, gRPC, health probes
    assert ("ENTRYPOINT", '["lockgate"]') in final
    assert ("CMD", '["serve", "/models", "--host", "0.0.0.0"]') in final
    copies = [rest for op, rest in instructions if op == "COPY"]
    assert ". /src" in copies
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    assert "/src[all]" in runs and "download.pytorch.org/whl/cpu" in (
        " ".join(rest for op, rest in instructions if op == "ARG")
    )
