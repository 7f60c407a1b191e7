"""docker-compose.yml: valid for docker-compose, read the same way here, and its selector and cpu-profile executor
run as local processes (their image's ENTRYPOINT, the service's command and environment; no Docker engine): the
compose health check gates the start, then the whole flow runs through them and SIGTERM stops both cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from compose_local import (
    COMPOSE_FILE,
    REPO_ROOT,
    LocalService,
    load_compose,
    local_service,
    process_env,
    variable_defaults,
)
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc, selector_pb2, selector_pb2_grpc

COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="docker-compose is not installed (Debian: apt-get install docker-compose; scripts/test.sh installs it)",
)
HEALTHY_TIMEOUT_S = 300.0  # no-hang bounds, not performance bars
STOP_TIMEOUT_S = 60.0
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
HEAD_SIZE, K, MAX_TOKENS, PROMPT = 32, 3, 24, [5, 17, 42, 7, 99, 3, 250, 11]


def run_compose(*args: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    """docker-compose on our file with nothing from this shell or an .env file: only the file's defaults."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SPECDEC_", "COMPOSE_"))}
    command = [str(COMPOSE), "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


@needs_compose
@pytest.mark.parametrize("profiles", [[], ["cpu"], ["gpu"], ["cpu", "gpu"]])
def test_docker_compose_config_is_valid(profiles: list[str], tmp_path: Path) -> None:
    (tmp_path / "empty.env").write_text("")
    flags = [word for profile in profiles for word in ("--profile", profile)]
    result = run_compose(*flags, "config", "-q", env_file=tmp_path / "empty.env")
    assert result.returncode == 0, result.stderr


@needs_compose
def test_docker_compose_reads_the_file_as_we_do(tmp_path: Path) -> None:
    """What the local runs below use (environment, command, health check) is what compose itself resolves."""
    (tmp_path / "empty.env").write_text("")
    result = run_compose("config", env_file=tmp_path / "empty.env")
    assert result.returncode == 0, result.stderr
    theirs = yaml.safe_load(result.stdout)["services"]
    ours = load_compose({})["services"]
    services = ["client", "executor-0", "executor-1", "executor-cpu", "gateway", "selector"]
    assert sorted(theirs) == sorted(ours) == services
    for name, service in ours.items():
        for key in ("environment", "entrypoint", "command", "profiles", "deploy", "depends_on", "read_only"):
            assert theirs[name].get(key) == service.get(key), (name, key)
        if name != "client":  # a one-off command, not a server
            assert theirs[name]["healthcheck"]["test"] == service["healthcheck"]["test"], name


def test_env_example_lists_every_variable_with_its_default() -> None:
    example = {}
    for line in (REPO_ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            example[key] = value
    assert {key: value for key, value in example.items() if not key.startswith("COMPOSE_")} == variable_defaults(
        COMPOSE_FILE.read_text()
    )


def test_one_gpu_per_executor_and_a_cpu_profile() -> None:
    services = load_compose({})["services"]
    gpu = [name for name, service in services.items() if service.get("profiles") == ["gpu"]]
    assert gpu == ["executor-0", "executor-1"]
    device_ids = []
    for name in gpu:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"]), name
        device_ids += device["device_ids"]
        assert services[name]["environment"]["SPECDEC_DEVICE"] == "cuda"
    assert device_ids == ["0", "1"]
    cpu = services["executor-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu and cpu["environment"]["SPECDEC_DEVICE"] == "cpu"
    assert cpu["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    for name in [*gpu, "executor-cpu"]:
        service = services[name]
        assert service["depends_on"] == {"selector": {"condition": "service_healthy"}}, name
        assert service["volumes"] == ["./models:/models:ro"], name
        assert service["command"] == ["--selector-address", "selector:50051", "--model-root", "/models"], name
    assert "profiles" not in services["selector"]
    # --scale executor-cpu=N: a range of host ports, one per replica, never one fixed port that the second would want.
    (cpu_port,) = cpu["ports"]
    first, last = map(int, cpu_port.rsplit(":", 2)[1].split("-"))
    assert last - first >= 2, cpu_port
    published = [port for service in services.values() for port in service.get("ports", [])]
    assert len({port.rsplit(":", 2)[1] for port in published}) == len(published), f"a host port twice: {published}"


def test_images_run_as_an_unprivileged_user() -> None:
    for dockerfile in ("deploy/selector.Dockerfile", "deploy/executor.Dockerfile", "deploy/gateway.Dockerfile"):
        final_stage = (REPO_ROOT / dockerfile).read_text().rsplit("\nFROM ", 1)[1]
        users = [line.split()[1] for line in final_stage.splitlines() if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), dockerfile


# --- the selector and the cpu executor as local processes -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Started:
    def __init__(self, service: LocalService, directory: Path) -> None:
        self.service, self.log_path = service, directory / f"{service.name}.log"
        with self.log_path.open("wb") as log:  # cwd: not the repository, as in the image
            self.process = subprocess.Popen(
                service.argv, cwd=directory, env=process_env(service), stdout=log, stderr=subprocess.STDOUT
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def probe(self, **env: str) -> subprocess.CompletedProcess[str]:
        """The compose health check, run as `docker exec` would: in the service's environment."""
        environment = {**process_env(self.service), **env}
        return subprocess.run(self.service.healthcheck, env=environment, capture_output=True, text=True, timeout=30)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        while (result := self.probe()).returncode != 0:
            assert self.process.poll() is None, f"{self.service.name} exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"unhealthy: {result.stderr}\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> int | None:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Started]]:
    processes: list[Started] = []
    yield processes
    for process in processes:
        if process.process.poll() is None:
            process.process.kill()
            process.process.wait()


def write_tiny_checkpoint(directory: Path) -> None:
    """A Hugging Face directory (config.json + safetensors) for the executor to load from its model root."""
    torch = pytest.importorskip("torch", reason="the executor needs torch")
    from executor_service.models.config import ModelConfig
    from executor_service.models.loader import build_synthetic, save_directory

    config = ModelConfig(architecture="llama", head_size=HEAD_SIZE, max_position_embeddings=512, **TINY)
    save_directory(build_synthetic(config, 0, torch.float32, torch.device("cpu")).model, directory)


def load_request(with_drafter: bool) -> executor_pb2.LoadModelRequest:
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path="tiny-llama"), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=64
    )
    if with_drafter:  # a synthetic EAGLE drafter of the target's width, one layer
        request.draft.method = common_pb2.SPEC_METHOD_EAGLE
        request.draft.num_speculative_tokens = K
        request.draft.source.synthetic.CopyFrom(
            executor_pb2.SyntheticModel(architecture="llama", seed=7, head_size=HEAD_SIZE, **{**TINY, "num_layers": 1})
        )
    return request


def generate(stub: executor_pb2_grpc.ExecutorStub, request_id: str) -> list[executor_pb2.GenerateResponse]:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=PROMPT),
        sampling=executor_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=60))


def rpc_count(metrics_port: int, method: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return sum(s.value for s in samples if s.name == "specdec_rpc_requests_total" and s.labels["method"] == method)


def test_selector_and_cpu_executor_serve_the_full_flow(tmp_path: Path, started: list[Started]) -> None:
    models = tmp_path / "models"
    write_tiny_checkpoint(models / "tiny-llama")
    compose = load_compose({"SPECDEC_MODEL_DIR": str(models)})
    assert compose["services"]["executor-cpu"]["depends_on"]["selector"]["condition"] == "service_healthy"

    # The compose network's name "selector:<its container port>" becomes the local process's address.
    selector_port = local_service(compose, "selector", {}, {}).container_port
    local_ports = {name: (free_port(), free_port()) for name in ("selector", "executor-cpu")}
    addresses = {f"selector:{selector_port}": f"127.0.0.1:{local_ports['selector'][0]}"}

    def run(name: str) -> Started:
        port, metrics_port = local_ports[name]
        overrides = {"SPECDEC_PORT": str(port), "SPECDEC_METRICS_PORT": str(metrics_port)}
        started.append(Started(local_service(compose, name, overrides, addresses), tmp_path))
        started[-1].wait_healthy()  # depends_on: condition: service_healthy
        return started[-1]

    selector = run("selector")
    executor = run("executor-cpu")
    assert executor.service.env["SPECDEC_DEVICE"] == "cpu" and str(models) in executor.service.argv

    with (
        grpc.insecure_channel(f"127.0.0.1:{local_ports['executor-cpu'][0]}") as executor_channel,
        grpc.insecure_channel(f"127.0.0.1:{local_ports['selector'][0]}") as selector_channel,
    ):
        executor_stub = executor_pb2_grpc.ExecutorStub(executor_channel)
        hardware = executor_stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), timeout=10)
        assert hardware.platform == common_pb2.PLATFORM_CPU
        selection = selector_pb2_grpc.BackendSelectorStub(selector_channel).SelectBackends(
            selector_pb2.SelectBackendsRequest(
                hardware=hardware,
                target_layers=common_pb2.LayerSpec(
                    head_size=HEAD_SIZE, num_heads=4, num_kv_heads=2, dtype=common_pb2.DTYPE_FLOAT32
                ),
                speculative=common_pb2.SpeculativeConfig(method=common_pb2.SPEC_METHOD_EAGLE, num_speculative_tokens=K),
            ),
            timeout=10,
        )
        assert (selection.target.backend, selection.drafter.backend) == ("CPU_ATTN", "CPU_ATTN")

        # Healthy by default before any model (the server answers); a readiness probe is not, until LoadModel.
        not_ready = executor.probe(SPECDEC_HEALTHCHECK_ALLOW_NOT_SERVING="0")
        assert not_ready.returncode == 1 and "is NOT_SERVING" in not_ready.stderr, not_ready.stderr

        executor_stub.LoadModel(load_request(with_drafter=False), timeout=60)  # from the read-only model dir
        assert executor.probe(SPECDEC_HEALTHCHECK_ALLOW_NOT_SERVING="0").returncode == 0
        reference = [t for response in generate(executor_stub, "target-only") for t in response.token_ids]

        loaded = executor_stub.LoadModel(load_request(with_drafter=True), timeout=60)
        pairs = ((loaded.target_backend, selection.target), (loaded.draft_backend, selection.drafter))
        for decision, expected in pairs:
            assert decision.backend == expected.backend
            assert [c.backend for c in decision.candidates] == [c.backend for c in expected.candidates]
        responses = generate(executor_stub, "speculative")

    assert [r.HasField("finished") for r in responses] == [False] * (len(responses) - 1) + [True]
    finished = responses[-1].finished
    tokens = [t for response in responses for t in response.token_ids]
    assert tokens == reference, "greedy speculative output differs from the target alone"
    assert (finished.finish_reason, finished.prompt_tokens, finished.completion_tokens) == (
        "length",
        len(PROMPT),
        MAX_TOKENS,
    )
    assert finished.drafted_tokens == sum(r.num_drafted for r in responses) > 0
    assert finished.accepted_tokens == sum(r.num_accepted for r in responses) <= finished.drafted_tokens
    assert len(finished.acceptance_rate_per_position) == K and finished.mean_acceptance_length >= 1.0
    # The executor asked the compose selector for both loads (--selector-address), besides our own call.
    assert rpc_count(local_ports["selector"][1], "SelectBackends") == 3

    for process in (executor, selector):  # compose stops dependents first
        assert process.stop() == 0, process.log()
        assert json.loads(process.log().splitlines()[-1])["msg"] == "stopped", process.log()


def test_the_scaled_cpu_executor_serves_through_one_name(tmp_path: Path, started: list[Started]) -> None:
    """`--scale executor-cpu=3` as local processes: three replicas of the service's command and environment, each
    loading the model at start (SPECDEC_LOAD, healthy only once loaded); the compose network's name
    dns:///executor-cpu:50052 becomes the gRPC target listing the three. Generate calls through one balanced
    channel reach all three, and the client service's command (`specdec loads --each`) sees each replica's share."""
    from specdec_runtime.client import open_channel

    models = tmp_path / "models"
    write_tiny_checkpoint(models / "tiny-llama")
    (models / "load.json").write_text(json_format.MessageToJson(load_request(with_drafter=True)))
    variables = {
        "SPECDEC_MODEL_DIR": str(models),
        "SPECDEC_LOAD": "/models/load.json",
        "SPECDEC_EXECUTOR_HEALTHY_WITHOUT_MODEL": "0",
    }
    compose = load_compose(variables)
    selector_port = local_service(compose, "selector", {}, {}).container_port
    selector_local = free_port()
    addresses = {f"selector:{selector_port}": f"127.0.0.1:{selector_local}"}
    started.append(Started(local_service(compose, "selector", {"SPECDEC_PORT": str(selector_local)}, {}), tmp_path))
    started[-1].wait_healthy()
    replicas = []
    for index in range(3):
        directory = tmp_path / f"executor-cpu-{index}"
        directory.mkdir()
        overrides = {"SPECDEC_PORT": str(free_port()), "SPECDEC_METRICS_PORT": "-1"}
        replicas.append(Started(local_service(compose, "executor-cpu", overrides, addresses), directory))
    started.extend(replicas)
    for replica in replicas:
        replica.wait_healthy()  # the model is loaded and warm
    target = "ipv4:" + ",".join(f"127.0.0.1:{replica.service.env['SPECDEC_PORT']}" for replica in replicas)

    client = compose["services"]["client"]
    assert client["depends_on"] == {"executor-cpu": {"condition": "service_healthy"}}
    assert client["image"] == compose["services"]["executor-cpu"]["image"]  # the image that has the CLI and torch
    command = [*client["entrypoint"], *client["command"]]
    service_name = next(word for word in command if word.startswith("dns:///executor-cpu:"))
    assert service_name == "dns:///executor-cpu:50052"
    client_argv = [
        str(Path(sys.executable).with_name(command[0])),
        *(target if w == service_name else w for w in command[1:]),
    ]

    requests = 6
    with open_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = executor_pb2_grpc.ExecutorStub(channel)
        outputs = [[t for r in generate(stub, f"scaled-{i}") for t in r.token_ids] for i in range(requests)]
    assert all(output == outputs[0] and len(output) == MAX_TOKENS for output in outputs)  # same model everywhere

    shown = subprocess.run([*client_argv, "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    loads = json.loads(shown.stdout)
    assert sorted(loads) == sorted(target.removeprefix("ipv4:").split(","))
    served = [int(replica_loads["promptTokensTotal"]) // len(PROMPT) for replica_loads in loads.values()]
    assert sum(served) == requests and all(count > 0 for count in served), served

    for process in [*replicas, started[0]]:
        assert process.stop() == 0, process.log()
