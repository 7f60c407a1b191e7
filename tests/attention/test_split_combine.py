"""TRITON_ATTN's one-kernel split-KV combine (kernels/split_combine.py) against the float64 reference and the
two-kernel path: decode, verify-like and DFlash-like calls, trees, GQA groups, head sizes, fewer programs than
splits. Each batch mixes a request whose keys fit one part (written directly), one using some parts and one using
every part. The counters must be zero after every call; a buffer too small falls back to the combine kernel; and a
buffer left non-zero shows that the counter is what gates the combine.

Splits are forced on small inputs with min_split_len 16 and 8 splits: a context of 16 keys or fewer is one part,
128 keys fill all eight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tree_attention_cases import dense_reference, tree_batch

from kernels import unavailable_reason
from kernels.attention import AttentionBatch, new_split_counters
from kernels.testing import BatchSpec, PagedBatch, make_paged_batch, reference_attention
from kernels.tree_mask import TREE_WINDOW

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOL = 2e-4 if DTYPE is torch.float32 else 1.6e-2
KV_HEADS = 2
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(unavailable_reason("TRITON_ATTN", DEVICE) is not None, reason="triton unavailable")

# name -> (per request: keys, queries; causal). Parts used per request with 8 splits of >= 16 keys: 1, 5, 8 (decode),
# 1, 5, 8 (verify: the causal tile's keys), 1, 4, 8 (DFlash).
CASES = {
    "decode": (BatchSpec("decode", (9, 70, 128), (1, 1, 1)), True),
    "verify": (BatchSpec("verify", (12, 75, 128), (8, 8, 8)), True),
    "dflash": (BatchSpec("dflash", (16, 60, 128), (16, 16, 16)), False),
}


def config(split_programs: int | None = None, num_splits: int = 8, block_m: int = 64):
    from kernels.triton_attn import LaunchConfig

    return LaunchConfig(block_m, 16, num_splits, 4, 2, min_split_len=16, split_programs=split_programs)


def attend(
    batch: PagedBatch, causal: bool, cfg, counters: torch.Tensor | None, tree_mask: torch.Tensor | None = None
) -> torch.Tensor:
    from kernels import triton_attn

    meta = AttentionBatch(
        batch.block_table, batch.query_start_loc, batch.seq_lens, causal, batch.q.shape[-1] ** -0.5,
        batch.max_query_len, batch.max_seq_len, tree_mask=tree_mask, split_counters=counters,
    )  # fmt: skip
    out = torch.full_like(batch.q, float("nan"))
    return triton_attn.forward(batch.q, batch.k_cache, batch.v_cache, meta, out, cfg)


@pytest.fixture
def combine_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the second (combine) kernel was launched: one entry per launch."""
    from kernels import triton_attn

    launches: list[int] = []
    original = triton_attn.combine_splits

    def counting(*args, **kwargs) -> None:
        launches.append(1)
        original(*args, **kwargs)

    monkeypatch.setattr(triton_attn, "combine_splits", counting)
    return launches


def check_both_paths(
    batch: PagedBatch, causal: bool, cfg, reference: torch.Tensor, launches: list[int], tree_mask=None, one_part=True
) -> None:
    """One kernel (twice on one buffer, as a graph's replays) against the reference and two kernels. `one_part`:
    the first request's keys fit one part."""
    counters = new_split_counters(batch.seq_lens.shape[0], batch.q.shape[1], DEVICE)
    one = attend(batch, causal, cfg, counters, tree_mask)
    assert not launches and not one.isnan().any()
    assert not counters.any(), "the last program zeroes the counters"
    again = attend(batch, causal, cfg, counters, tree_mask)
    assert torch.equal(one, again) and not counters.any()
    two = attend(batch, causal, cfg, None, tree_mask)
    assert len(launches) == 1
    torch.testing.assert_close(one.double().cpu(), reference, atol=TOL, rtol=TOL)
    torch.testing.assert_close(one, two, atol=TOL / 4, rtol=TOL / 4)
    if one_part and DEVICE.type == "cpu":  # written directly by its one program: the same bits as combined from
        # one part (the interpreter runs one code path; a GPU's two specialisations may round apart)
        first = batch.spec.query_lens[0]
        assert torch.equal(one[:first], two[:first])


@pytest.mark.parametrize("split_programs", [None, 3])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_one_kernel_matches_reference_and_two_kernels(
    case: str, group: int, split_programs: int | None, combine_launches: list[int]
) -> None:
    spec, causal = CASES[case]
    batch = make_paged_batch(spec, group * KV_HEADS, KV_HEADS, 64, 16, DTYPE, DEVICE, seed=5)
    check_both_paths(batch, causal, config(split_programs), reference_attention(batch, causal), combine_launches)


@pytest.mark.parametrize("head_size", [128, 80])
def test_head_sizes(head_size: int, combine_launches: list[int]) -> None:
    """Head 128, and 80 (padded to 128: masked columns in the partials and the combine); GQA group 4."""
    spec, causal = CASES["decode"]
    batch = make_paged_batch(spec, 4 * KV_HEADS, KV_HEADS, head_size, 16, DTYPE, DEVICE, seed=6)
    check_both_paths(batch, causal, config(3), reference_attention(batch, causal), combine_launches)


def test_tree_masks(combine_launches: list[int]) -> None:
    """Tree requests and causal ones (test_tree_attention.py's batch), split in four over tiles of 64 queries."""
    batch, trees, masks = tree_batch(2, block_size=32)
    assert batch.max_query_len == TREE_WINDOW
    reference = dense_reference(batch, trees, batch.q.shape[-1] ** -0.5)
    cfg = config(num_splits=4, block_m=128)
    check_both_paths(batch, True, cfg, reference, combine_launches, masks, one_part=False)


def test_a_buffer_too_small_falls_back_to_the_combine_kernel(combine_launches: list[int]) -> None:
    spec, causal = CASES["verify"]
    batch = make_paged_batch(spec, 3 * KV_HEADS, KV_HEADS, 64, 16, DTYPE, DEVICE, seed=7)
    needed = len(spec.seq_lens) * KV_HEADS  # one counter per request and KV head (GQA rows packed)
    small = torch.zeros(needed - 1, dtype=torch.int32, device=DEVICE)
    out = attend(batch, causal, config(), small)
    assert len(combine_launches) == 1 and not small.any()
    torch.testing.assert_close(out.double().cpu(), reference_attention(batch, causal), atol=TOL, rtol=TOL)
    exact = torch.zeros(needed, dtype=torch.int32, device=DEVICE)
    attend(batch, causal, config(), exact)
    assert len(combine_launches) == 1, "a buffer of exactly the launch's size is used"
    with pytest.raises(ValueError, match="int32"):
        attend(batch, causal, config(), exact.long())


def test_the_counter_gates_the_combine(combine_launches: list[int]) -> None:
    """Negative control: counters left non-zero (as a kernel that failed to reset them would) mean no program
    arrives last, so nobody combines: the split requests' rows keep the NaN `out` was filled with, and their
    counters grow by the participants. The request of one part needs no counter and stays right."""
    spec, causal = CASES["decode"]
    batch = make_paged_batch(spec, 3 * KV_HEADS, KV_HEADS, 64, 16, DTYPE, DEVICE, seed=8)
    stale = 1000
    counters = torch.full((len(spec.seq_lens) * KV_HEADS,), stale, dtype=torch.int32, device=DEVICE)
    out = attend(batch, causal, config(3), counters)
    assert not combine_launches
    assert out[1:].isnan().all(), "a combine ran although the counter never reached its last arrival"
    reference = reference_attention(batch, causal)
    torch.testing.assert_close(out[:1].double().cpu(), reference[:1], atol=TOL, rtol=TOL)
    participants = [0, 3, 3]  # per request: min(parts used, 3 programs); one part takes no counter
    expected = torch.tensor([stale + p for p in participants for _ in range(KV_HEADS)], dtype=torch.int32)
    assert torch.equal(counters.cpu(), expected)


@pytest.mark.skipif(not os.environ.get("SPECDEC_COMPILE_TESTS"), reason="set SPECDEC_COMPILE_TESTS=1 (compiles)")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_one_kernel_compiles_for_sm90_and_gfx942(dtype: str) -> None:
    """The real compilers, not the interpreter (a subprocess without TRITON_INTERPRET; no GPU needed): a CTA barrier
    right before one thread's acq_rel GPU-scope add (the kernel's debug_barrier; Triton's lowering of a scalar
    atomic happens to add one too), the partials read past L1, and shared memory as the two-kernel variant's
    (triton_attn_config's estimate still bounds it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("split_combine_compile.py")
    done = subprocess.run([sys.executable, str(script), dtype], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["barrier_before_add"] and found["cg_loads"] and not found["two_kernel_atomics"]
    assert found["shared_one"] == found["shared_two"]
    assert found["hip_atomic_add"]
