"""Running the example clients (Python, Node.js, Go) as subprocesses, and building the Go one (imported as
`example_clients`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
CLIENT_TIMEOUT_S = 120
GO_PACKAGES = (
    "golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev golang-google-protobuf-dev "
    "protoc-gen-go protoc-gen-go-grpc protobuf-compiler"
)


def run_client(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    try:
        return subprocess.run(
            command, cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{command} ran past {CLIENT_TIMEOUT_S} s\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}")


def build_go_client(out: Path) -> Path | str:
    """examples/go built into `out`, or why it cannot be (the missing tools and packages)."""
    sources = Path(os.environ.get("GOPATH_DEPS", "/usr/share/gocode")) / "src"
    missing = [
        tool for tool in ("go", "gofmt", "protoc", "protoc-gen-go", "protoc-gen-go-grpc") if not shutil.which(tool)
    ]
    missing += [
        str(sources / p) for p in ("google.golang.org/grpc", "google.golang.org/protobuf") if not (sources / p).is_dir()
    ]
    if missing:
        return f"the Go toolchain is missing {', '.join(missing)}: apt-get install {GO_PACKAGES}"
    built = subprocess.run(
        ["bash", str(EXAMPLES / "go" / "build.sh"), str(out)], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, f"examples/go/build.sh failed:\n{built.stdout}\n{built.stderr}"
    unformatted = subprocess.run(["gofmt", "-l", str(EXAMPLES / "go")], capture_output=True, text=True, check=True)
    assert unformatted.stdout == "", f"gofmt would change: {unformatted.stdout}"
    return out / "specdec-client"
