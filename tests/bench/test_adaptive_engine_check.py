"""adaptive_engine_check's cost model prices every steady step at the GPU result's median for its bucket and k,
whatever the CPU step took, and a bucket the result never measured at its largest bucket's."""

from __future__ import annotations

import pytest
from adaptive_engine_check import GpuPriced

from executor_service.spec_decode.adaptive_k import MIN_SAMPLES


def test_steps_cost_the_gpu_prices() -> None:
    model = GpuPriced({1: {0: 0.75, 3: 1.04}, 2: {0: 0.8, 3: 1.4}}, 3)
    for _ in range(MIN_SAMPLES + 1):  # a warm-up, then the samples
        model.record(1, 3, 0.5)  # the CPU's own time: not used
        model.record(64, 0, 0.5)  # never measured on the GPU: its largest bucket's price
    assert model.costs[1][3].seconds == pytest.approx(1.04e-3)
    assert model.costs[model.bucket(64)][0].seconds == pytest.approx(0.8e-3)
    model.record_deferred(1, 9.0, 4, 2)  # the flushes' surcharge is in the GPU's k = 0 price already
    assert 0 not in model.costs[1]
