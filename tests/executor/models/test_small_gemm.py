"""The fused small-M GEMM kernels (kernels/small_gemm.py, kernels/qkv_rope_gemm.py) against the unfused torch
compositions they replace, under the Triton interpreter on the CPU or compiled on the GPU: plain GEMM with a
bias, (add +) RMSNorm prologue, SiLU-and-mul epilogue, and QKV with RoPE, Qwen3's q/k norm and the paged K/V
write. Shapes are odd on purpose (rows, N and K not multiples of the tiles), bf16 and fp32."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from executor_service.models.rope import apply_rotary
from kernels.kv_cache import write_kv
from kernels.small_gemm_table import GemmConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
SMALL_TILES = GemmConfig(block_n=16, block_k=32, num_warps=4)  # several K steps and column tiles at test sizes
GEMV_TILES = GemmConfig(block_n=8, block_k=32, num_warps=4, gemv=True)  # the same on the CUDA cores, rows <= 8
SPLIT_GEMV_TILES = GemmConfig(block_n=8, block_k=32, num_warps=4, gemv=True, block_m=2)  # programs of 2 rows each
MMA32_TILES = GemmConfig(block_n=16, block_k=32, num_warps=4, block_m=32)  # MMA programs of 32 rows
DEFERRED_GEMV_TILES = GemmConfig(block_n=8, block_k=32, num_warps=4, gemv=True, block_m=2, defer=True)  # summed once
TRITON_ATTN_HEADS = (32, 64, 80, 96, 128, 160, 192, 224, 256)  # kernels/capabilities.py's TRITON_ATTN claim


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: summation order only. bf16: the same rounding points, so a value (outputs are O(1): weights are
    scaled by 1/sqrt(K)) may differ by an ulp or two, or by a normed input's ulp times its weight."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def stream_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """The residual stream x + residual is rounded once, as torch rounds it: equal, except under the interpreter
    in 16 bits, whose fp32 -> bf16 cast truncates where the GPU rounds to nearest (an ulp apart)."""
    interpreted_16_bit = DEVICE == "cpu" and dtype != torch.float32
    return {"rtol": 2**-7, "atol": 0.0} if interpreted_16_bit else {"rtol": 0.0, "atol": 0.0}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


def norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None) -> tuple:
    """(the GEMM's input, the stream) as the unfused ops compute them: add (rounded), then RMSNorm in fp32."""
    stream = x if residual is None else x + residual
    if weight is None:
        return stream, stream
    h = stream.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return normed.to(x.dtype), stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 72), (3, 100, 200), (8, 24, 40), (17, 33, 48)])
@pytest.mark.parametrize("prologue", ["none", "norm", "add_norm"])
@pytest.mark.parametrize(
    "config",
    [SMALL_TILES, MMA32_TILES, GEMV_TILES, SPLIT_GEMV_TILES, DEFERRED_GEMV_TILES],
    ids=["mma", "mma_rows32", "gemv", "gemv_rows2", "gemv_deferred"],
)
def test_small_gemm_matches_norm_then_linear(
    dtype: torch.dtype, rows: int, n: int, k: int, prologue: str, config: GemmConfig
) -> None:
    from kernels.small_gemm import MAX_GEMV_ROWS, small_gemm

    if config.gemv and rows > MAX_GEMV_ROWS and not config.block_m:
        pytest.skip("a GEMV program takes a few rows")
    x, residual = randn(rows, k, dtype=dtype, seed=1), randn(rows, k, dtype=dtype, seed=2)
    weight, bias, norm_w = (
        randn(n, k, dtype=dtype, seed=3) / k**0.5,
        randn(n, dtype=dtype, seed=4),
        randn(k, dtype=dtype, seed=5),
    )
    residual = residual if prologue == "add_norm" else None
    norm_w = None if prologue == "none" else norm_w
    out, stream = small_gemm(x, weight, bias, residual, norm_w, EPS, config=config)
    a, expected_stream = norm_reference(x, residual, norm_w)
    torch.testing.assert_close(stream, expected_stream, **stream_tolerance(dtype))
    torch.testing.assert_close(out.float(), F.linear(a.float(), weight.float(), bias.float()), **tolerance(dtype))
    assert out.dtype == dtype and out.shape == (rows, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "half", "k", "config"),
    [
        (1, 24, 40, SMALL_TILES),
        (5, 50, 72, SMALL_TILES),
        (2, 24, 40, GEMV_TILES),
        (7, 24, 40, SPLIT_GEMV_TILES),
        (3, 24, 72, DEFERRED_GEMV_TILES),
        (40, 24, 40, MMA32_TILES),  # two programs of 32 rows, the second 8 of them
    ],
)
def test_small_gemm_silu_and_mul_epilogue(dtype: torch.dtype, rows: int, half: int, k: int, config: GemmConfig) -> None:
    from kernels.small_gemm import small_gemm

    x, residual = randn(rows, k, dtype=dtype, seed=6), randn(rows, k, dtype=dtype, seed=7)
    weight, norm_w = randn(2 * half, k, dtype=dtype, seed=8) / k**0.5, randn(k, dtype=dtype, seed=9)
    out, stream = small_gemm(x, weight, None, residual, norm_w, EPS, silu_mul=True, config=config)
    a, expected_stream = norm_reference(x, residual, norm_w)
    gate, up = F.linear(a.float(), weight.float()).to(dtype).float().split(half, dim=-1)
    torch.testing.assert_close(stream, expected_stream, **stream_tolerance(dtype))
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **tolerance(dtype))
    assert out.shape == (rows, half)


def qkv_reference(x, residual, norm_w, weight, bias, qk_norm, heads, kv_heads, cos, sin, caches, slots) -> tuple:
    """The unfused path: norm, GEMM (rounded), per-head norm, RoPE (torch's expression), write_kv."""
    a, stream = norm_reference(x, residual, norm_w)
    qkv = F.linear(a.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    size = weight.shape[0] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * size, kv_heads * size, kv_heads * size], dim=-1)
    rows = x.shape[0]
    q, k, v = q.reshape(rows, heads, size), k.reshape(rows, kv_heads, size), v.reshape(rows, kv_heads, size)
    if qk_norm is not None:
        q, k = (
            F.rms_norm(t.float(), (size,), w.float(), EPS).to(x.dtype) for t, w in zip((q, k), qk_norm[:2], strict=True)
        )
    q, k = apply_rotary(q.cpu(), k.cpu(), cos.cpu(), sin.cpu())
    k_cache, v_cache = (c.cpu().clone() for c in caches)
    write_kv(k, v.cpu(), k_cache, v_cache, slots.cpu())
    return q, stream, k_cache, v_cache


def rotary_tables(positions: list[int], size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000.0 ** (torch.arange(0, size, 2, dtype=torch.float32) / size)
    angles = torch.outer(torch.tensor(positions, dtype=torch.float32), inv)
    return angles.cos().to(dtype)[:, None, :].to(DEVICE), angles.sin().to(dtype)[:, None, :].to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "size", "heads", "kv_heads", "prologue", "extras"),
    [(torch.float32, size, 1, 1, "norm", "") for size in TRITON_ATTN_HEADS]
    + [
        (torch.bfloat16, 64, 3, 1, "add_norm", "bias"),
        (torch.bfloat16, 80, 2, 2, "none", "qk_norm"),
        (torch.float32, 32, 4, 2, "add_norm", "qk_norm,bias"),
        (torch.bfloat16, 128, 2, 1, "norm", ""),
        (torch.bfloat16, 64, 3, 1, "add_norm", "bias,gemv"),
        (torch.float32, 32, 4, 2, "add_norm", "qk_norm,gemv"),
        (torch.bfloat16, 80, 2, 2, "none", "gemv"),  # halves of 40 in column chunks of 16: the last one partial
        (torch.bfloat16, 64, 3, 1, "add_norm", "gemv,rows8"),  # a k = 7 chain's verify rows at batch 1
        (torch.bfloat16, 64, 3, 1, "add_norm", "gemv,rows8,split"),  # the same as four programs of 2 rows
        (torch.bfloat16, 64, 3, 1, "add_norm", "rows8,mma32"),  # an MMA program of 32 rows, 24 of them masked
    ],
)
def test_qkv_rope_store_matches_the_unfused_path(
    dtype: torch.dtype, size: int, heads: int, kv_heads: int, prologue: str, extras: str
) -> None:
    from kernels.qkv_rope_gemm import qkv_rope_store

    rows, k_dim, blocks, block_size = (8 if "rows8" in extras else 3), 40, 3, 4
    slots = torch.tensor([5, -1, 9, 0, 1, 2, 3, 11][:rows], device=DEVICE)  # the second token stores nothing
    x, residual = randn(rows, k_dim, dtype=dtype, seed=10), randn(rows, k_dim, dtype=dtype, seed=11)
    weight = randn((heads + 2 * kv_heads) * size, k_dim, dtype=dtype, seed=12) / k_dim**0.5
    bias = randn(weight.shape[0], dtype=dtype, seed=13) if "bias" in extras else None
    norm_w = None if prologue == "none" else randn(k_dim, dtype=dtype, seed=14)
    residual = residual if prologue == "add_norm" else None
    qk_norm = (randn(size, dtype=dtype, seed=15), randn(size, dtype=dtype, seed=16), EPS) if "qk" in extras else None
    cos, sin = rotary_tables([7, 0, 130, 1, 2, 3, 4, 5][:rows], size, dtype)
    caches = tuple(randn(blocks, block_size, kv_heads, size, dtype=dtype, seed=17 + i) for i in range(2))
    expected = qkv_reference(x, residual, norm_w, weight, bias, qk_norm, heads, kv_heads, cos, sin, caches, slots)
    k_cache, v_cache = (c.clone() for c in caches)
    q, stream = qkv_rope_store(
        x, weight, bias, residual, norm_w, EPS, heads, kv_heads, cos, sin, k_cache, v_cache, slots, qk_norm,
        GemmConfig(
            block_n=16 if size == 80 else 8, block_k=16, gemv="gemv" in extras,
            block_m=2 * ("split" in extras) + 32 * ("mma32" in extras),
        ),
    )  # fmt: skip
    tol = tolerance(dtype)
    torch.testing.assert_close(stream.cpu(), expected[1].cpu(), **stream_tolerance(dtype))
    torch.testing.assert_close(q.float().cpu(), expected[0].float(), **tol)
    torch.testing.assert_close(k_cache.float().cpu(), expected[2].float(), **tol)
    torch.testing.assert_close(v_cache.float().cpu(), expected[3].float(), **tol)
    untouched = caches[0].clone().view(-1, kv_heads, size)  # slots no row writes keep their old contents
    kept = [s for s in range(blocks * block_size) if s not in slots.tolist()]
    torch.testing.assert_close(k_cache.view(-1, kv_heads, size)[kept], untouched[kept], rtol=0, atol=0)


def concat_reference(x: torch.Tensor, x2: torch.Tensor, norm_w, norm_w2) -> torch.Tensor:
    """[rmsnorm(x) | rmsnorm(x2)] as the unfused ops write it (each normed and rounded, then concatenated)."""
    return torch.cat([norm_reference(x, None, norm_w)[0], norm_reference(x2, None, norm_w2)[0]], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k1", "k2"), [(1, 40, 24, 40), (5, 33, 50, 50)])  # K1 inside a K tile
@pytest.mark.parametrize("normed", [False, True])
def test_small_gemm_concatenated_input(dtype: torch.dtype, rows: int, n: int, k1: int, k2: int, normed: bool) -> None:
    """EAGLE-1's fc over [embedding | hidden] (as is, with a bias), or two separately normed inputs."""
    from kernels.small_gemm import small_gemm

    x, x2 = randn(rows, k1, dtype=dtype, seed=20), randn(rows, k2, dtype=dtype, seed=21)
    weight, bias = randn(n, k1 + k2, dtype=dtype, seed=22) / (k1 + k2) ** 0.5, randn(n, dtype=dtype, seed=23)
    norm_w, norm_w2 = (randn(k1, dtype=dtype, seed=24), randn(k2, dtype=dtype, seed=25)) if normed else (None, None)
    out, stream = small_gemm(x, weight, bias, None, norm_w, EPS, config=SMALL_TILES, x2=x2, norm_weight2=norm_w2)
    a = concat_reference(x, x2, norm_w, norm_w2)
    torch.testing.assert_close(out.float(), F.linear(a.float(), weight.float(), bias.float()), **tolerance(dtype))
    assert stream is x


def test_concatenated_input_refuses_a_residual_or_one_norm() -> None:
    from kernels.small_gemm import small_gemm

    x, w = randn(2, 8, dtype=torch.float32, seed=1), randn(4, 16, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="concatenated"):
        small_gemm(x, w, residual=x, x2=x)
    with pytest.raises(ValueError, match="concatenated"):
        small_gemm(x, w, norm_weight=x[0], x2=x)


@pytest.mark.parametrize(("dtype", "size", "extras"), [(torch.bfloat16, 64, "bias"), (torch.float32, 32, "qk_norm")])
def test_qkv_rope_store_concatenated_normed_input(dtype: torch.dtype, size: int, extras: str) -> None:
    """EAGLE-3's attention input: [rmsnorm(embedding) | rmsnorm(hidden)] in the QKV kernel's prologue."""
    from kernels.qkv_rope_gemm import qkv_rope_store

    rows, k1, heads, kv_heads, blocks, block_size = 3, 40, 2, 1, 3, 4
    slots = torch.tensor([5, -1, 9], device=DEVICE)
    x, x2 = randn(rows, k1, dtype=dtype, seed=30), randn(rows, k1, dtype=dtype, seed=31)
    norm_w, norm_w2 = randn(k1, dtype=dtype, seed=32), randn(k1, dtype=dtype, seed=33)
    weight = randn((heads + 2 * kv_heads) * size, 2 * k1, dtype=dtype, seed=34) / (2 * k1) ** 0.5
    bias = randn(weight.shape[0], dtype=dtype, seed=35) if "bias" in extras else None
    qk_norm = (randn(size, dtype=dtype, seed=36), randn(size, dtype=dtype, seed=37), EPS) if "qk" in extras else None
    cos, sin = rotary_tables([3, 0, 77], size, dtype)
    caches = tuple(randn(blocks, block_size, kv_heads, size, dtype=dtype, seed=38 + i) for i in range(2))
    a = concat_reference(x, x2, norm_w, norm_w2)
    expected = qkv_reference(a, None, None, weight, bias, qk_norm, heads, kv_heads, cos, sin, caches, slots)
    k_cache, v_cache = (c.clone() for c in caches)
    q, stream = qkv_rope_store(
        x, weight, bias, None, norm_w, EPS, heads, kv_heads, cos, sin, k_cache, v_cache, slots, qk_norm,
        GemmConfig(block_k=16), x2=x2, norm_weight2=norm_w2,
    )  # fmt: skip
    tol = tolerance(dtype)
    assert stream is x
    torch.testing.assert_close(q.float().cpu(), expected[0].float(), **tol)
    torch.testing.assert_close(k_cache.float().cpu(), expected[2].float(), **tol)
    torch.testing.assert_close(v_cache.float().cpu(), expected[3].float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", ["", "qk_norm,bias"])
def test_qkv_rope_store_keys_and_values_only(dtype: torch.dtype, extras: str) -> None:
    """DFlash's context: no query heads, qkv_proj's k/v rows, the RMSNorm (hidden_norm) in the prologue."""
    from kernels.qkv_rope_gemm import qkv_rope_store

    rows, k_dim, kv_heads, size, blocks, block_size = 5, 40, 2, 32, 3, 4
    slots = torch.tensor([0, 1, 2, -1, 11], device=DEVICE)
    x, norm_w = randn(rows, k_dim, dtype=dtype, seed=40), randn(k_dim, dtype=dtype, seed=41)
    weight = randn(2 * kv_heads * size, k_dim, dtype=dtype, seed=42) / k_dim**0.5
    bias = randn(weight.shape[0], dtype=dtype, seed=43) if "bias" in extras else None
    qk_norm = (randn(size, dtype=dtype, seed=44), randn(size, dtype=dtype, seed=45), EPS) if "qk" in extras else None
    cos, sin = rotary_tables([0, 1, 2, 3, 4], size, dtype)
    caches = tuple(randn(blocks, block_size, kv_heads, size, dtype=dtype, seed=46 + i) for i in range(2))
    expected = qkv_reference(x, None, norm_w, weight, bias, qk_norm, 0, kv_heads, cos, sin, caches, slots)
    k_cache, v_cache = (c.clone() for c in caches)
    q, _ = qkv_rope_store(
        x, weight, bias, None, norm_w, EPS, 0, kv_heads, cos, sin, k_cache, v_cache, slots, qk_norm,
        GemmConfig(block_k=16),
    )  # fmt: skip
    assert q.shape == (rows, 0, size)
    tol = tolerance(dtype)
    torch.testing.assert_close(k_cache.float().cpu(), expected[2].float(), **tol)
    torch.testing.assert_close(v_cache.float().cpu(), expected[3].float(), **tol)


def test_pdl_is_off_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter has no griddepcontrol: kernels there are built without PDL and launched plainly."""
    from kernels import pdl

    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(pdl.enabled(torch.device("cpu"))) == {}
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # switched off before any device is asked about


def test_gemv_config_refuses_more_rows_than_it_takes() -> None:
    from kernels.small_gemm import MAX_GEMV_ROWS, small_gemm

    x = randn(MAX_GEMV_ROWS + 1, 16, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="GEMV"):
        small_gemm(x, randn(8, 16, dtype=torch.float32, seed=2), config=GEMV_TILES)
    with pytest.raises(ValueError, match="GEMV"):  # its programs' rows, not the call's, are what is bounded
        small_gemm(x, randn(8, 16, dtype=torch.float32, seed=2), config=replace(GEMV_TILES, block_m=16))
    with pytest.raises(ValueError, match="deferred GEMV"):  # its accumulator holds every row's products
        small_gemm(x[:4], randn(8, 16, dtype=torch.float32, seed=2), config=replace(DEFERRED_GEMV_TILES, block_m=4))
    with pytest.raises(ValueError, match="MMA program takes 16, 32 or 64"):
        small_gemm(x[:4], randn(8, 16, dtype=torch.float32, seed=2), config=replace(SMALL_TILES, block_m=8))
    with pytest.raises(ValueError, match="GEMV's option"):
        small_gemm(x[:4], randn(8, 16, dtype=torch.float32, seed=2), config=replace(SMALL_TILES, defer=True))
