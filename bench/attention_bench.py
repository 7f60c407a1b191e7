#!/usr/bin/env python
"""Attention benchmark (GPU; not a test): Llama-3-8B's attention shape (32 q heads, 8 KV heads, d=128,
bf16, paged) in the cases of CASES (DFlash block, verify, decode, 4k prefill), for every backend that runs
here, measured in one run next to FlashAttention-4 called directly and flex_attention compiled and called
directly. Writes bench/results/attention_<date>_<commit>.json.

    python bench/attention_bench.py [--block-size 128] [--sweep] [--cases dflash,decode]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing
from common import commit_id, device_tag

from kernels import paged_attention, unavailable_reason
from kernels.attention import AttentionBatch
from kernels.testing import BatchSpec, PagedBatch, make_paged_batch

REPO = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128
CASES = {
    "dflash": (BatchSpec("dflash_block_q16_kv4k_b32", (4096,) * 32, (16,) * 32), False),
    "verify": (BatchSpec("verify_q16_kv4k_b32", (4096,) * 32, (16,) * 32), True),
    "decode": (BatchSpec("decode_q1_kv4k_b64", (4096,) * 64, (1,) * 64), True),
    "prefill_causal": (BatchSpec("prefill_4k_b1", (4096,), (4096,)), True),
    "prefill_noncausal": (BatchSpec("prefill_4k_b1", (4096,), (4096,)), False),
}
# Bars of the issue: TRITON_ATTN throughput / FA4's.
BARS = {"dflash": 0.8, "verify": 0.8, "decode": 0.8, "prefill_causal": 0.6, "prefill_noncausal": 0.6}


def time_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def reference(batch: PagedBatch, causal: bool) -> torch.Tensor:
    """fp32 SDPA over the gathered keys on the GPU (CPU_ATTN's algorithm, upcast)."""
    return paged_attention(
        "CPU_ATTN",
        batch.q.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        causal,
    )


def implementations(batch: PagedBatch, causal: bool) -> dict[str, Callable[[], torch.Tensor]]:
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, causal)
    hints = {"max_query_len": batch.max_query_len, "max_seq_len": batch.max_seq_len}
    impls: dict[str, Callable[[], torch.Tensor]] = {}
    for backend in ("TRITON_ATTN", "FLASH_ATTN", "FLEX_ATTENTION", "ROCM_ATTN"):
        if unavailable_reason(backend, batch.q.device) is None:
            impls[backend] = lambda b=backend: paged_attention(b, *args, **hints)
    from kernels import flash_attn

    fa = flash_attn.load()
    if fa is not None and fa.generation == 4 and "FLASH_ATTN" in impls:

        def fa4_direct() -> torch.Tensor:
            return fa.varlen(
                batch.q, batch.k_cache, batch.v_cache, cu_seqlens_q=batch.query_start_loc, seqused_k=batch.seq_lens,
                page_table=batch.block_table, max_seqlen_q=batch.max_query_len, max_seqlen_k=batch.max_seq_len,
                softmax_scale=HEAD_SIZE**-0.5, causal=causal,
            )[0]  # fmt: skip

        impls["fa4_direct"] = fa4_direct
    if "FLEX_ATTENTION" in impls:
        impls.update(flex_variants(batch, causal))
    return impls


def flex_variants(batch: PagedBatch, causal: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """Our FLEX_ATTENTION with metadata built once (as the executor does per step), and flex_attention compiled
    and called directly on the same cache and block mask: the difference is our wrapper's own cost."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from kernels import flex_attn

    num_blocks, block_size = batch.k_cache.shape[:2]
    meta = flex_attn.build_flex_metadata(
        batch.block_table, batch.query_start_loc, batch.seq_lens, causal, num_blocks, block_size, batch.q.shape[0]
    )
    scale = HEAD_SIZE**-0.5
    direct = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    key = batch.k_cache.view(num_blocks * block_size, KV_HEADS, HEAD_SIZE).transpose(0, 1)[None]
    value = batch.v_cache.view(num_blocks * block_size, KV_HEADS, HEAD_SIZE).transpose(0, 1)[None]
    query = F.pad(batch.q.transpose(0, 1)[None], (0, 0, 0, meta.padded_tokens - batch.q.shape[0]))
    options = flex_attn._kernel_options(block_size, HEAD_SIZE, batch.q.element_size())
    return {
        "FLEX_ATTENTION_prebuilt_metadata": lambda: flex_attn.forward_with_metadata(
            batch.q, batch.k_cache, batch.v_cache, meta, scale, None
        ),
        "flex_direct": lambda: direct(
            query, key, value, block_mask=meta.block_mask, scale=scale, enable_gqa=True, kernel_options=options
        )[0, :, : batch.q.shape[0]].transpose(0, 1),
    }


def sweep_triton(batch: PagedBatch, causal: bool) -> list[dict]:
    """Time TRITON_ATTN launch configurations for this shape; the heuristic's pick is marked."""
    from kernels import triton_attn
    from kernels.triton_attn import LaunchConfig

    meta = AttentionBatch(
        batch.block_table, batch.query_start_loc, batch.seq_lens, causal, HEAD_SIZE**-0.5,
        batch.max_query_len, batch.max_seq_len,
    )  # fmt: skip
    group = HEADS // KV_HEADS
    chosen = triton_attn.choose_config(
        len(batch.spec.seq_lens), KV_HEADS, group, batch.max_query_len, batch.max_seq_len, HEAD_SIZE, batch.q.device,
        batch.q.element_size(),
    )  # fmt: skip
    rows = batch.max_query_len * group
    small = rows <= 128
    block_ms = [max(16, triton.next_power_of_2(rows))] if small else [64, 128]
    splits = [1, 2, 4, 8] if small else [1]
    results = []
    for block_m in block_ms:
        for block_n in (32, 64, 128):
            for num_splits in splits:
                for num_warps in (4, 8):
                    for num_stages in (2, 3):
                        cfg = LaunchConfig(block_m, block_n, num_splits, num_warps, num_stages)
                        try:
                            ms = time_ms(
                                lambda c=cfg: triton_attn.forward(batch.q, batch.k_cache, batch.v_cache, meta, None, c)
                            )
                        except Exception as err:  # out of shared memory, registers: report and go on
                            results.append({"config": cfg.__dict__, "error": f"{type(err).__name__}: {str(err)[:120]}"})
                            continue
                        results.append({"config": cfg.__dict__, "ms": round(ms, 4), "chosen": cfg == chosen})
    return sorted(results, key=lambda r: r.get("ms", float("inf")))


def kernel_report() -> list[dict]:
    """Registers, spills and shared memory of the compiled TRITON_ATTN kernels (the compiler's view).
    Reads Triton's launch cache, whose layout varies across versions: best effort."""
    try:
        return _kernel_report()
    except Exception as err:
        return [{"error": f"{type(err).__name__}: {err}"}]


def _kernel_report() -> list[dict]:
    from kernels import triton_attn

    report = []
    for kernel in (triton_attn._paged_attention_kernel, triton_attn._combine_splits_kernel):
        for device_cache in getattr(kernel, "device_caches", {}).values():
            for compiled in device_cache[0].values():
                meta = compiled.metadata
                report.append(
                    {
                        "kernel": kernel.__name__ if hasattr(kernel, "__name__") else str(kernel.fn.__name__),
                        "constants": {k: str(v) for k, v in getattr(meta, "constants", {}).items()}
                        if hasattr(meta, "constants")
                        else {},
                        "num_warps": meta.num_warps,
                        "num_stages": meta.num_stages,
                        "shared_bytes": meta.shared,
                        "registers": getattr(compiled, "n_regs", None),
                        "spills": getattr(compiled, "n_spills", None),
                    }
                )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sweep", action="store_true", help="also sweep TRITON_ATTN launch configurations")
    parser.add_argument("--only", help="comma-separated implementations to time (default: all)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_bench needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = {}
    for name in args.cases.split(","):
        spec, causal = CASES[name]
        batch = make_paged_batch(
            spec, HEADS, KV_HEADS, HEAD_SIZE, args.block_size, torch.bfloat16, device, poison=False
        )
        expected = reference(batch, causal)
        rows = {}
        impls = implementations(batch, causal)
        if args.only:
            impls = {k: v for k, v in impls.items() if k in args.only.split(",")}
        for impl, fn in impls.items():
            try:
                got = fn()
                err = ((got.float() - expected).abs().max() / expected.abs().max()).item()
                ms = time_ms(fn)
            except Exception as exc:
                rows[impl] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"{name:18s} {impl:34s} ERROR {exc}", flush=True)
                continue
            rows[impl] = {
                "ms": round(ms, 4),
                "TBps_kv": round(batch.kv_bytes() / ms / 1e9, 3),
                "TFLOPs": round(batch.flops(causal) / ms / 1e9, 1),
                "max_rel_err": float(f"{err:.2e}"),
            }
        fa4 = rows.get("fa4_direct", {}).get("ms")
        for impl, row in rows.items():
            if fa4 and "ms" in row:
                row["throughput_vs_fa4"] = round(fa4 / row["ms"], 3)
            print(f"{name:18s} {impl:34s} {json.dumps(row)}", flush=True)
        entry = {
            "causal": causal,
            "spec": spec.__dict__
            | {"seq_lens": spec.seq_lens[:1], "query_lens": spec.query_lens[:1], "num_requests": len(spec.seq_lens)},
            "impls": rows,
        }
        triton_ratio = rows.get("TRITON_ATTN", {}).get("throughput_vs_fa4")
        if triton_ratio is not None:
            entry["bar"] = {"triton_vs_fa4_min": BARS[name], "value": triton_ratio, "pass": triton_ratio >= BARS[name]}
        if args.sweep and "TRITON_ATTN" in rows:
            entry["triton_sweep_top"] = sweep_triton(batch, causal)[:12]
            print(f"{name:18s} sweep best: {entry['triton_sweep_top'][:3]}", flush=True)
        results[name] = entry
        del batch, expected
        torch.cuda.empty_cache()

    commit, _ = commit_id()  # SPECDEC_COMMIT on the GPU host, whose copy of the tree has no .git
    from kernels import flash_attn

    fa = flash_attn.load()
    now = dt.datetime.now(dt.UTC)
    report = {
        "benchmark": "attention",
        "utc": now.isoformat(timespec="seconds"),
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flash_attn": fa.version if fa else None,
        },
        "shape": {
            "q_heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_size": HEAD_SIZE,
            "dtype": "bfloat16",
            "block_size": args.block_size,
        },
        "method": (
            "triton.testing.do_bench median (L2 flushed between reps); TBps_kv = K+V bytes of all requests / time; "
            "TFLOPs counts QK and PV over visible keys; error relative to fp32 SDPA on gathered KV"
        ),
        "cases": results,
        "triton_kernels": kernel_report(),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = device_tag(torch.device("cuda"))  # "NVIDIA H100 80GB HBM3" -> "h100"
    path = out_dir / f"attention_{now:%Y-%m-%d}_{tag}_{commit}_bs{args.block_size}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
