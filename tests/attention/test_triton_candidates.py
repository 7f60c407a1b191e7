"""The fused log-softmax + top-k kernel (kernels/triton_candidates.py) under the interpreter on the CPU, or compiled
on the GPU, against a reference that states the order: a stable descending sort of the logits (equal values
lowest index first) and torch's float32 log_softmax at the picked entries."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused(logits: torch.Tensor, k: int, **kwargs: object) -> tuple[torch.Tensor | None, torch.Tensor]:
    from kernels.triton_candidates import topk_log_softmax

    log_probs, ids = topk_log_softmax(logits.to(DEVICE), k, **kwargs)
    return None if log_probs is None else log_probs.cpu(), ids.cpu()


def reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = logits.float().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return logits.log_softmax(-1, dtype=torch.float32).gather(1, ids), ids


def check(logits: torch.Tensor, k: int, tile: int | None = None) -> None:
    kwargs = {} if tile is None else {"tile": tile}
    log_probs, ids = fused(logits, k, **kwargs)
    expected_log_probs, expected_ids = reference(logits, k)
    assert ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(log_probs, expected_log_probs, rtol=1e-5, atol=1e-5)
    # torch's own top-k: the same values, whatever its order among equal ones
    torch.testing.assert_close(log_probs, logits.log_softmax(-1, dtype=torch.float32).topk(k).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 1000, 1), (3, 1000, 16), (4, 8192, 4), (2, 16384, 8)])
def test_matches_log_softmax_topk(dtype: torch.dtype, rows: int, vocab: int, k: int) -> None:
    """bf16 logits of 8192 entries tie often: the reference's stable order then decides the ids."""
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + k)) * 4).to(dtype)
    check(logits, k)


@pytest.mark.parametrize("k", [1, 5, 16])
def test_long_rows_loop_over_tiles(k: int) -> None:
    """Rows past the tile (EAGLE-1's target vocabulary) read in tiles, the last one partial; the best entries
    in the first, a middle and the last tile."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(k))
    logits[0, 3], logits[1, 500], logits[2, 999] = 9.0, 9.0, 9.0
    check(logits, k, tile=64)
    check(logits, k, tile=512)


def test_a_row_past_the_longest_tile_at_the_default_tiles() -> None:
    from kernels.triton_candidates import MAX_TILE

    logits = torch.randn(2, MAX_TILE + 1000, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    logits[1, -1] = 20.0
    check(logits, 4)


@pytest.mark.parametrize("tile", [None, 16])
def test_ties_go_to_the_lowest_index_first(tile: int | None) -> None:
    """Planted ties, across tiles too: equal values in index order, then the next value down."""
    logits = torch.full((2, 40), -5.0)
    logits[0, [31, 7, 20, 2]] = 3.0
    logits[0, [0, 39]] = 2.0
    logits[1, [17, 18]] = 1.0
    log_probs, ids = fused(logits, 7, **({} if tile is None else {"tile": tile}))
    assert ids[0].tolist() == [2, 7, 20, 31, 0, 39, 1]
    assert ids[1].tolist() == [17, 18, 0, 1, 2, 3, 4]
    assert log_probs[0, 0] == log_probs[0, 3] and log_probs[0, 3] > log_probs[0, 4] > log_probs[0, 6]


@pytest.mark.parametrize("tile", [None, 8])
def test_negative_values_and_minus_infinity(tile: int | None) -> None:
    """All-negative rows rank by value (the key flips a negative's magnitude bits); -inf entries (a drafter's
    masked vocabulary) come last, lowest index first, with log-probability -inf."""
    logits = -torch.rand(2, 24, generator=torch.Generator().manual_seed(5)) - 1.0
    logits[:, 3:] = float("-inf")
    logits[1, 20] = -0.5
    log_probs, ids = fused(logits, 6, **({} if tile is None else {"tile": tile}))
    expected_log_probs, expected_ids = reference(logits, 6)
    assert ids.tolist() == expected_ids.tolist()
    assert ids[0].tolist()[3:] == [3, 4, 5] and ids[1].tolist()[0] == 20
    torch.testing.assert_close(log_probs, expected_log_probs)
    assert torch.isinf(log_probs[0, 3:]).all()


@pytest.mark.parametrize("tile", [None, 32])
def test_ids_map_through_to_target_and_scores_can_be_left_out(tile: int | None) -> None:
    """EAGLE-3's draft-to-target map: the kernel returns target ids; without scores, the same ids alone."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 100, generator=generator).to(torch.bfloat16)
    to_target = torch.randperm(1000, generator=generator)[:100].sort().values
    kwargs = {} if tile is None else {"tile": tile}
    log_probs, ids = fused(logits, 4, to_target=to_target.to(DEVICE), **kwargs)
    expected_log_probs, expected_ids = reference(logits, 4)
    assert ids.tolist() == to_target[expected_ids].tolist()
    torch.testing.assert_close(log_probs, expected_log_probs)
    no_scores, same_ids = fused(logits, 4, to_target=to_target.to(DEVICE), scores=False, **kwargs)
    assert no_scores is None and torch.equal(same_ids, ids)


def test_strided_rows_and_bounds() -> None:
    """Rows with a stride (a slice of a wider buffer) are read at it; k past MAX_K or past V is refused."""
    from kernels.triton_candidates import MAX_K

    wide = torch.randn(3, 300, generator=torch.Generator().manual_seed(11))
    check(wide[:, :257], 3)
    with pytest.raises(AssertionError):
        fused(wide, MAX_K + 1)
    with pytest.raises(AssertionError):
        fused(wide[:, :4], 5)
