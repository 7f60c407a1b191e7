"""The fused log-softmax + top-k kernel (kernels/triton_topk.py) under the interpreter on the CPU (or compiled on
the GPU) against a reference that states the order: a stable descending sort of the logits (equal values keep
the lower index first), their log-probabilities from torch's log_softmax in fp64 (torch's fp32 log_softmax on
the CPU is itself 2e-5 off on a 24k row of near-equal terms; the kernel is within 2e-7 of fp64)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_topk import CHUNK, MAX_K, ONE_BLOCK_VOCAB

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LONG = ONE_BLOCK_VOCAB + CHUNK + 123  # six pieces, the last one partial


def topk(logits: torch.Tensor, k: int, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.triton_topk import topk_log_softmax

    values, ids = topk_log_softmax(logits.to(DEVICE), k, **kwargs)
    return values.cpu(), ids.cpu()


def reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = logits.float().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return logits.double().log_softmax(-1).float().gather(1, ids), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1000), (5, 8192), (2, LONG)])
@pytest.mark.parametrize("k", [1, 4, MAX_K])
def test_random_rows_match_the_reference(dtype: torch.dtype, rows: int, vocab: int, k: int) -> None:
    """bf16 rows hold many equal values: the ids must follow the stated order, not just the values."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + k)).mul(3).to(dtype)
    values, ids = topk(logits, k)
    expected_values, expected_ids = reference(logits, k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (rows, k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=2e-5)


@pytest.mark.parametrize("vocab", [1000, LONG])
def test_equal_values_come_lowest_index_first(vocab: int) -> None:
    """Planted ties (across pieces of a long row too), and -0.0 equal to +0.0."""
    logits = torch.full((3, vocab), -5.0)
    tied = [vocab - 1, 7, vocab // 2, 3, CHUNK + 1 if vocab > CHUNK else 600]
    logits[0, tied] = 9.0
    logits[0, 11] = 8.0
    logits[1, [4, 9]] = torch.tensor([-0.0, 0.0])  # equal: the lower index first, whatever the sign
    logits[1, 2] = 1.0
    logits[2, :] = 0.5  # every entry equal
    values, ids = topk(logits, 7)
    assert ids[0].tolist() == [*sorted(tied), 11, 0]
    assert ids[1].tolist() == [2, 4, 9, 0, 1, 3, 5]
    assert ids[2].tolist() == list(range(7))
    torch.testing.assert_close(values, reference(logits, 7)[0], rtol=0, atol=2e-5)


def test_minus_infinity_entries() -> None:
    """Masked-out entries (-inf) rank last, in index order, with log-probability -inf; a row with fewer finite
    entries than k still returns k ids."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(1))
    logits[0, ::2] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, [250, 40]] = torch.tensor([1.0, 2.0])
    values, ids = topk(logits, 4)
    expected_values, expected_ids = reference(logits, 4)
    assert torch.equal(ids, expected_ids)
    assert ids[1].tolist() == [40, 250, 0, 1]
    torch.testing.assert_close(values, expected_values, rtol=0, atol=2e-5)
    assert values[1, 2:].tolist() == [float("-inf")] * 2


@pytest.mark.parametrize("vocab", [1000, LONG])
def test_ids_mapped_through_to_target(vocab: int) -> None:
    """EAGLE-3's draft-to-target map (index + d2t offset) applied to the chosen ids."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, vocab, generator=generator).half()
    to_target = torch.arange(vocab) + torch.randint(0, 50000, (vocab,), generator=generator).sort().values
    _, ids = topk(logits, 5, to_target=to_target.to(DEVICE))
    assert torch.equal(ids, to_target[reference(logits, 5)[1]])


def test_unnormalized_values_are_the_logits() -> None:
    """normalize=False (static trees rank by the logits alone): the same ids, the logits as values."""
    logits = torch.randn(4, 2000, generator=torch.Generator().manual_seed(3)).bfloat16()
    values, ids = topk(logits, 6, normalize=False)
    assert torch.equal(ids, reference(logits, 6)[1])
    assert torch.equal(values, logits.float().gather(1, ids))


def test_bad_arguments_are_refused() -> None:
    from kernels.triton_topk import topk_log_softmax

    logits = torch.zeros(2, 10, device=DEVICE)
    for rows, k in [(logits, 0), (logits, 11), (torch.zeros(2, 40, device=DEVICE), MAX_K + 1)]:
        with pytest.raises(ValueError, match="k must be"):
            topk_log_softmax(rows, k)
    with pytest.raises(ValueError, match="contiguous"):
        topk_log_softmax(torch.zeros(10, 2, device=DEVICE).T, 1)
    with pytest.raises(ValueError, match="to_target"):
        topk_log_softmax(logits, 1, to_target=torch.arange(9, device=DEVICE))
    values, ids = topk_log_softmax(logits[:0], 3)
    assert values.shape == ids.shape == (0, 3)
