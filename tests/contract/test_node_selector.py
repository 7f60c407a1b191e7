"""Contract test: a Node.js gRPC client (@grpc/grpc-js, @grpc/proto-loader) against a real selector server.

Needs `node` on PATH and `npm install` run in tests/contract/node; skipped otherwise.
"""

from __future__ import annotations

import pytest


@pytest.mark.node
def test_node_client_against_selector(run_node, selector_server) -> None:
    run_node("selector_contract.mjs", selector_server)

    # Graceful shutdown is part of the contract: SIGTERM drains and exits 0 within the grace period.
    status = selector_server.stop()
    assert status == 0, selector_server.shutdown_failure()
