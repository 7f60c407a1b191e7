"""specdec_runtime.client.resolved_addresses: the addresses `specdec loads --each` asks, for every target form the
balanced channel takes (dns:, ipv4:/ipv6: lists, host:port, unix:), and the service config every client channel
carries (round_robin; retries of UNAVAILABLE only for the calls that are safe to repeat)."""

from __future__ import annotations

import json

import pytest

from specdec_runtime.client import SERVICE_CONFIG, resolved_addresses


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("dns:///localhost:50052", ["127.0.0.1:50052"]),
        ("dns://8.8.8.8/localhost:7", ["127.0.0.1:7"]),  # an authority (DNS server) is not the name
        ("dns:127.0.0.1:5", ["127.0.0.1:5"]),
        ("127.0.0.1:50052", ["127.0.0.1:50052"]),
        ("ipv4:127.0.0.1:1,127.0.0.2:2,127.0.0.3:3", ["127.0.0.1:1", "127.0.0.2:2", "127.0.0.3:3"]),
        ("ipv6:[::1]:1,[::1]:2", ["[::1]:1", "[::1]:2"]),
        ("[::1]:9", ["[::1]:9"]),
        ("unix:/tmp/specdec.sock", ["unix:/tmp/specdec.sock"]),
        ("127.0.0.1", ["127.0.0.1:443"]),  # gRPC's default port
    ],
)
def test_resolved_addresses(target: str, expected: list[str]) -> None:
    assert resolved_addresses(target) == expected


def test_a_name_that_does_not_resolve_is_an_os_error() -> None:
    with pytest.raises(OSError):
        resolved_addresses("dns:///no-such-host.invalid:50052")


def test_the_service_config_balances_and_retries_only_safe_calls() -> None:
    config = json.loads(SERVICE_CONFIG)
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method_config,) = config["methodConfig"]
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    retried = {(name["service"], name.get("method")) for name in method_config["name"]}
    assert ("specdec.v1.Executor", "Generate") in retried
    assert not retried & {("specdec.v1.Executor", "LoadModel"), ("specdec.v1.Executor", "Abort")}
    assert ("specdec.v1.Executor", None) not in retried  # not the whole service: LoadModel is not to be repeated
