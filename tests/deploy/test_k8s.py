"""deploy/k8s: every manifest validates against the Kubernetes OpenAPI schemas (kubernetes-validate, from PyPI, ships
them, so this runs offline) in strict mode (a misspelled field fails), and the pieces fit together: the selector a
stateless Deployment behind a Service, the executors GPU pods with gRPC health probes behind a headless Service
whose ports and labels match, and a LoadModelRequest in the ConfigMap that parses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_local import REPO_ROOT
from google.protobuf import json_format

from specdec.v1 import executor_pb2

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

K8S = REPO_ROOT / "deploy" / "k8s"
# The oldest Kubernetes we claim (gRPC probes are GA since 1.27) and the newest schemas the package ships.
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


def documents() -> list[tuple[Path, dict[str, Any]]]:
    found = [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    return [(path, doc) for path, doc in found if doc]


def resource(kind: str, name: str) -> dict[str, Any]:
    matches = [doc for _, doc in documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env(workload: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(workload)["env"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version):
    docs = documents()
    assert {doc["kind"] for _, doc in docs} >= {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"}
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {err.message}")


def test_the_validator_catches_a_misspelled_field_and_a_wrong_type():
    executor = resource("Deployment", "specdec-executor")
    typo = copy.deepcopy(executor)
    container(typo)["readinesProbe"] = container(typo).pop("readinessProbe")
    wrong_type = copy.deepcopy(executor)
    container(wrong_type)["ports"][0]["containerPort"] = "grpc"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def test_the_selector_is_a_stateless_deployment_behind_a_service():
    selector = resource("Deployment", "specdec-selector")
    assert selector["spec"]["replicas"] >= 2
    pod = container(selector)
    assert pod["securityContext"]["readOnlyRootFilesystem"] is True
    assert "volumeMounts" not in pod
    assert pod["readinessProbe"]["grpc"] == {"port": 50051, "service": "specdec.v1.BackendSelector"}
    assert env(selector)["SPECDEC_PORT"] == "50051"
    service = resource("Service", "specdec-selector")
    assert service["spec"]["selector"].items() <= selector["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 50051


def test_executors_have_a_gpu_health_probes_and_a_headless_service():
    executor = resource("Deployment", "specdec-executor")
    pod = container(executor)
    assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["readinessProbe"]["grpc"] == {"port": 50052, "service": "specdec.v1.Executor"}
    assert pod["livenessProbe"]["exec"]["command"] == ["python", "/opt/specdec/healthcheck.py"]
    settings = env(executor)
    assert settings["SPECDEC_PORT"] == "50052" and settings["SPECDEC_HEALTHCHECK_ALLOW_NOT_SERVING"] == "1"
    # The drain must end before Kubernetes sends SIGKILL.
    assert (
        float(settings["SPECDEC_GRACE_SECONDS"]) < executor["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )
    assert "specdec-selector:50051" in pod["args"]
    service = resource("Service", "specdec-executor")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS gives every ready pod, gRPC round_robin spreads
    assert service["spec"]["selector"].items() <= executor["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 50052


def test_the_load_config_map_holds_a_load_model_request_the_executor_reads():
    executor = resource("Deployment", "specdec-executor")
    load_path = Path(env(executor)["SPECDEC_LOAD"])
    mount = next(m for m in container(executor)["volumeMounts"] if m["mountPath"] == str(load_path.parent))
    volume = next(v for v in executor["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config = resource("ConfigMap", volume["configMap"]["name"])
    request = json_format.ParseDict(yaml.safe_load(config["data"][load_path.name]), executor_pb2.LoadModelRequest())
    assert request.target.path and request.draft.num_speculative_tokens > 0


def test_the_gateway_is_a_stateless_deployment_reaching_the_executors_headless_service():
    gateway = resource("Deployment", "specdec-gateway")
    assert gateway["spec"]["replicas"] >= 2
    pod = container(gateway)
    assert pod["securityContext"]["readOnlyRootFilesystem"] is True and "volumeMounts" not in pod
    assert pod["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # ready while an executor serves
    assert pod["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}  # alive while it answers
    settings = env(gateway)
    executor_service = resource("Service", "specdec-executor")
    port = executor_service["spec"]["ports"][0]["port"]
    assert settings["SPECDEC_EXECUTOR"] == f"dns:///{executor_service['metadata']['name']}:{port}"
    assert (
        float(settings["SPECDEC_GRACE_SECONDS"]) < gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )
    (http_port,) = pod["ports"]
    assert http_port["containerPort"] == int(settings["SPECDEC_PORT"])
    service = resource("Service", "specdec-gateway")
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == http_port["name"]
