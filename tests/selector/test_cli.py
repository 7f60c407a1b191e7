"""The `specdec` client command line: local and remote selection, tables, JSON, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec_cli.cli import build_parser, main

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "select_dflash_h100.yaml")


def test_select_local_prints_both_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--config", EXAMPLE, "--local"]) == 0
    out = capsys.readouterr().out
    assert "target: FLASH_ATTN  (auto, causal)" in out
    assert "drafter: FLASH_ATTN  (auto, non-causal)" in out
    assert "FLASHINFER      flashinfer not installed" in out


def test_select_remote_json_equals_local(selector_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--config", EXAMPLE, "--selector", selector_address, "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["select", "--config", EXAMPLE, "--local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == remote
    assert remote["drafter"]["useNonCausal"] is True


def test_select_error_shows_field_details(
    tmp_path: Path, selector_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"hardware": {"platform": "PLATFORM_CPU"}, "targetLayers": {"headSize": 0}}))
    for where in (["--local"], ["--selector", selector_address]):
        assert main(["select", "--config", str(config), *where]) == 2
        err = capsys.readouterr().err
        assert "error: INVALID_ARGUMENT" in err
        assert "field target_layers.head_size: required and positive" in err


def test_no_backend_error_lists_candidates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "mla.yaml"
    config.write_text(
        "hardware: {platform: PLATFORM_CPU, libraries: [{name: torch}]}\n"
        "targetLayers: {headSize: 576, numHeads: 16, numKvHeads: 1, dtype: DTYPE_BFLOAT16, useMla: true}\n"
    )
    assert main(["select", "--config", str(config), "--local"]) == 2
    err = capsys.readouterr().err
    assert "error: FAILED_PRECONDITION: No valid attention backend found for cpu" in err
    assert "  CPU_ATTN: MLA not supported" in err


def test_unreadable_config_is_a_plain_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware: {platform: PLATFORM_MARS}\n")
    assert main(["select", "--config", str(bad), "--local"]) == 1
    assert "PLATFORM_MARS" in capsys.readouterr().err
    assert main(["select", "--config", str(tmp_path / "missing.yaml"), "--local"]) == 1


def test_backends_table(selector_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--platform", "rocm", "--selector", selector_address]) == 0
    out = capsys.readouterr().out
    assert "ROCM_AITER_UNIFIED_ATTN" in out and "CPU_ATTN" not in out
    assert "auto order, rocm (always): ROCM_ATTN > ROCM_AITER_FA > ROCM_AITER_UNIFIED_ATTN > TRITON_ATTN" in out


def test_unreachable_selector_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--selector", "127.0.0.1:1", "--timeout", "1"]) == 2
    assert "error: UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["backends", "--selector", "127.0.0.1:99999"],
        ["select", "--config", EXAMPLE, "--selector", "localhost:-5"],
        ["demo", "--selector", "127.0.0.1:65536"],
        ["demo", "--synthetic", "--executor", "[::1]:0"],
    ],
)
def test_addresses_with_a_port_out_of_range_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """gRPC would dial the port modulo 65536 (99999 -> 34463): refused like a bad flag, naming it, no traceback."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    flag, address = argv[-2:]
    assert f"argument {flag}: {address!r}: " in err and "is not a port in 1..65535" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "[::1]:50051", "localhost", "unix:/tmp/specdec.sock"])
def test_addresses_without_a_bad_port_parse(address: str) -> None:
    assert build_parser().parse_args(["demo", "--selector", address, "--executor", address]).executor == address


def test_malformed_yaml_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Malformed YAML: one line naming the file and where, no traceback (it was a yaml.ScannerError traceback)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware: [unclosed\n")
    assert main(["select", "--config", str(bad), "--local"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: not valid YAML: ") and "line 2, column 1" in err
    assert err.count("\n") == 1


def test_an_executor_command_at_the_selector_says_what_answers_there(
    selector_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdec server-info` pointed at the selector: besides UNIMPLEMENTED, which service answers there and which
    flag to check (it printed only "Method not found!")."""
    assert main(["server-info", "--executor", selector_address]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: UNIMPLEMENTED: Method not found!",
        f"  {selector_address} is not a specdec executor: specdec.v1.BackendSelector (a specdec selector) answers "
        "there, not specdec.v1.Executor (check --executor)",
    ]
