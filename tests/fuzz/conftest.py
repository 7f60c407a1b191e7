"""The fuzz suite's hypothesis profiles, and the helper folders it borrows builders from.

SPECDEC_FUZZ_PROFILE picks the profile: "ci" (the default; what scripts/test.sh runs: derandomized, so every
run draws the same examples, and bounded so the whole folder takes a couple of minutes on 2 cores) or "deep"
(random seeds and many more examples, for hunting on a developer's machine). SPECDEC_FUZZ_EXAMPLES overrides
the example count of either.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

TESTS = Path(__file__).resolve().parents[1]
for folder in ("executor", "selector", "gateway"):  # executor_builders, spec_builders, builders, gateway_stack
    if str(TESTS / folder) not in sys.path:
        sys.path.append(str(TESTS / folder))

# Examples call real servers: slow by hypothesis's standards, and large by design (oversize fields).
_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    "print_blob": False,
}
examples = os.environ.get("SPECDEC_FUZZ_EXAMPLES")
# CI reports the first failing example as drawn: shrinking a hang would repeat its timeout many times over.
settings.register_profile(
    "ci",
    max_examples=int(examples or 60),
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    **_COMMON,
)
settings.register_profile("deep", max_examples=int(examples or 1000), derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("SPECDEC_FUZZ_PROFILE", "ci"))
