"""The CUDA graphs' block tables reserve MAX_LOOKAHEAD positions past the context: every drafter LoadModel accepts
writes at most that far ahead, and one that would write further is refused at load."""

from __future__ import annotations

import pytest
from executor_builders import load_request
from spec_builders import draft_model

from executor_service.errors import InvalidField
from executor_service.models.draft_config import MAX_SPECULATIVE_TOKENS
from executor_service.models.limits import MAX_DFLASH_BLOCK_SIZE
from executor_service.runner.cuda_graphs import MAX_LOOKAHEAD
from executor_service.server.drafting import resolve_draft
from executor_service.server.wire import resolve_target, status_error
from specdec_runtime.errors import InvalidArgument


def lookahead(method: str, k: int, block: int | None = None) -> int:
    request = load_request()
    request.draft.CopyFrom(draft_model(method, k))
    if block is not None:
        request.draft.dflash_config.block_size = block
    source = resolve_target(request.target, None, "target")
    return resolve_draft(request.draft, source.config, None).config.positions_ahead


def test_the_largest_drafters_fit_the_reserved_lookahead() -> None:
    assert lookahead("eagle3", MAX_SPECULATIVE_TOKENS) <= MAX_LOOKAHEAD
    assert lookahead("dflash", MAX_DFLASH_BLOCK_SIZE - 1, MAX_DFLASH_BLOCK_SIZE) <= MAX_LOOKAHEAD


@pytest.mark.parametrize(
    ("method", "k", "block"),
    [("eagle", MAX_SPECULATIVE_TOKENS + 1, None), ("dflash", 3, MAX_LOOKAHEAD + 1)],
)
def test_a_drafter_writing_further_ahead_is_refused(method: str, k: int, block: int | None) -> None:
    with pytest.raises(InvalidField) as err:  # INVALID_ARGUMENT at the server's edge
        lookahead(method, k, block)
    assert isinstance(status_error(err.value), InvalidArgument)
