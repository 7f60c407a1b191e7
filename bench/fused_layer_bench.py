#!/usr/bin/env python
"""Fused decoder layers (GPU; not a test): the small-M Triton GEMMs against cuBLAS, per shape, and a decode step.

1. Per op and shape (SmolLM2-135M, Llama-3-8B, the shipped SmolLM2 drafters' own; rows 1-64): the unfused ops
   (add + RMSNorm kernel, cuBLAS, RoPE + store or SiLU-and-mul) vs the fused kernel at each tile config of a small
   sweep; the best fused config wins the shape where it is at least 5 % faster. --write-table merges the winners
   into kernels/small_gemm_table.json.
2. One decoder layer and the whole decode step (batch 1, CUDA graph, context 300), fused (SPECDEC_SMALL_GEMM=
   triton), unfused (off) and as the table picks, each with programmatic dependent launch on and off
   (kernels/pdl.py; SPECDEC_PDL): step time, kernels per step and per layer (torch.profiler).
   The per-op table of 1. is measured with PDL as the host has it (on from sm_90).
3. --step-rows R (e.g. 8: a k = 7 verify at batch 1): the pass of one request's R rows as the table picks, unfused,
   and with every op of R rows fused at its best config of 1. (a trial table), PDL on. Kernels that each tie
   cuBLAS alone can win together (fewer kernels, chained by PDL), which 1.'s per-op rule cannot see: where the
   trial's pass is STEP_MARGIN faster than the table's, its R-row configs are the step's winners, and
   --write-table writes them too.
Times are CUDA-graph replays of REPS back-to-back calls, divided by REPS. Writes bench/results/fused_layer_*.json.

    python bench/fused_layer_bench.py [--dtypes bfloat16,float32] [--write-table] [--step-presets smollm2,llama3-8b]
    python bench/fused_layer_bench.py --presets smollm2 --rows 8 --step-rows 8 [--write-table]
    python bench/fused_layer_bench.py --presets llama3-8b,llama3-8b:tp2 --no-decode-steps --write-table  # TP shards
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from common import PRESETS, log, provenance, time_graph, write_result
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from executor_service.engine.kv_cache import KVCache
from executor_service.models.attention_step import build_attention_step
from executor_service.models.config import ModelConfig
from executor_service.models.fused_layer import NormInput, gate_up_silu
from executor_service.models.loader import build_synthetic
from executor_service.models.model import Attention
from kernels import pdl
from kernels.qkv_rope_gemm import qkv_rope_store
from kernels.small_gemm import MAX_DEFER_ROWS, MAX_GEMV_ROWS, small_gemm
from kernels.small_gemm_table import (
    POLICY_ENV,
    GemmConfig,
    dtype_name,
    load_table,
    merge_winners,
    rows_bucket,
    table_key,
    trial_table,
)

REPO = Path(__file__).resolve().parent.parent
REPS = 20  # calls per captured graph: launch gaps as in a real step, not one kernel's host latency
ROWS = (1, 2, 4, 8, 16, 32, 64)
SWEEP = [GemmConfig(n, k, 4) for n in (16, 32, 64) for k in (64, 128, 256)] + [
    GemmConfig(16, 512, 4),
    GemmConfig(32, 512, 4),
    GemmConfig(16, 1024, 8),
    GemmConfig(32, 512, 8),
]  # the wide K steps: a whole SmolLM2 row slice (K = 576) loaded before PDL's wait
GEMV_SWEEP = [GemmConfig(n, k, w, gemv=True) for n, k, w in [(4, 1024, 4), (8, 1024, 4), (8, 512, 4), (16, 256, 4),
    (16, 1024, 8), (32, 128, 4), (32, 256, 4)]]  # fmt: skip
# More rows than a GEMV program holds well (its products are rows x block_k x block_n registers): programs of 2 or 4
# rows each, the later ones reading the weights from L2. (Smaller K and N tiles at 8 rows, tried on the H200: slower.)
GEMV_SPLIT_SWEEP = [GemmConfig(n, k, 4, gemv=True, block_m=m) for m in (1, 2, 4) for n, k in [(4, 1024), (8, 1024),
    (8, 512), (4, 512)]]  # fmt: skip
# MMA programs of 32 or 64 rows (GemmConfig.block_m): a verify or decode batch of 32-64 rows reads each weight tile
# once, where programs of 16 rows read it two or four times (TP 2's o_proj, QKV and down_proj at batch 32 ran at
# 47-57 % of the H200's HBM bandwidth on cuBLAS).
WIDE_SWEEP = [GemmConfig(n, k, w, block_m=32) for n, k, w in [(16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4),
    (32, 256, 8), (64, 128, 8), (16, 512, 4)]] + [GemmConfig(n, k, w, block_m=64) for n, k, w in [(32, 128, 4),
    (64, 64, 4), (32, 128, 8), (64, 128, 8)]]  # fmt: skip
# Deferred GEMVs (each thread's products summed over K once, at the end): 1-2 rows, the large-K shapes of 8B and its
# shards, where the per-step sum across warps is the suspect.
DEFER_SWEEP = [GemmConfig(n, k, w, gemv=True, defer=True) for n, k, w in [(4, 1024, 4), (8, 512, 4), (16, 512, 8),
    (16, 256, 4), (4, 2048, 8), (2, 2048, 4), (32, 256, 8), (8, 1024, 8)]]  # fmt: skip
COPIES = 4  # weight copies a linear / gate-up case cycles through: 8B shards (29-117 MB each) then outgrow the L2
CONTEXT, BLOCK_SIZE = 300, 16
DRAFTER_MLP = {"smollm2": {"eagle3": 1024, "dflash": 768}}  # the shipped drafters' MLP widths (drafters/*/config.json)
WIN_MARGIN = 0.95  # a fused kernel replaces cuBLAS only 5 % faster alone: a tie in isolation is no win in a step
STEP_MARGIN = 0.97  # a trial table's R-row configs win where its pass is 3 % faster than the table's (medians)
TRIAL_ROUNDS = 7  # interleaved timing rounds of the step-level trials


def model_config(preset: str, num_layers: int | None = None) -> ModelConfig:
    """A preset's shape; "NAME:tpN" is one rank's shard of it under tensor parallelism over N GPUs (its heads, KV
    heads and MLP width divided by N, parallel/layers.py): the column-parallel QKV and gate/up GEMMs stay plain
    linears there, so the table's entries for these shapes serve every rank."""
    name, _, tp = preset.partition(":tp")
    ranks = int(tp or 1)
    p = PRESETS[name]
    if p["heads"] % ranks or p["kv_heads"] % ranks or p["intermediate"] % ranks:
        raise SystemExit(f"{preset}: heads, KV heads and MLP width must divide by {ranks}")
    return ModelConfig(
        architecture="llama", vocab_size=p["vocab"], hidden_size=p["hidden"],
        intermediate_size=p["intermediate"] // ranks, num_layers=num_layers or p["layers"],
        num_heads=p["heads"] // ranks, num_kv_heads=p["kv_heads"] // ranks, head_size=p["head_size"],
        max_position_embeddings=4096, rope_theta=100000.0, tie_word_embeddings=name == "smollm2",
    )  # fmt: skip


def per_call_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """ms of one fn() inside a graph of REPS calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    return time_graph(graph.replay, device, iters=50) / REPS


def set_policy(policy: str) -> None:
    os.environ[POLICY_ENV] = policy


def rotating(tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The next of `tensors` at each call: a graph of REPS calls reads each copy in turn, as a step reads each
    layer's weights once, not one copy the L2 may hold."""
    turn = itertools.cycle(tensors)
    return lambda: next(turn)


def linear_case(n: int, k: int, rows: int, dtype: torch.dtype, device: torch.device) -> tuple:
    x = torch.randn(rows, k, dtype=dtype, device=device)
    w = rotating([torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(COPIES)])
    return "linear", n, k, lambda: torch.nn.functional.linear(x, w()), lambda c: small_gemm(x, w(), config=c)


def op_cases(cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """(op, n, k, unfused call, fused call of a config) per GEMM of a decoder layer: QKV, o_proj, gate/up, down;
    and the EAGLE-3 drafter's fc over three of the target's hidden states."""
    x, res = (torch.randn(rows, cfg.hidden_size, dtype=dtype, device=device) for _ in range(2))
    norm_w = torch.ones(cfg.hidden_size, dtype=dtype, device=device)
    attn = Attention(cfg).to(device=device, dtype=dtype)
    cache = KVCache(cfg, 8, BLOCK_SIZE, dtype, device)  # cfg has one layer
    cos, sin = (torch.randn(rows, 1, cfg.head_size // 2, dtype=dtype, device=device) for _ in range(2))
    slots = torch.arange(rows, device=device)
    gate_ups = [
        torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, device=device, dtype=dtype)
        for _ in range(COPIES)
    ]
    gate_up = rotating(gate_ups)
    inp = NormInput(x, res, norm_w, 1e-5)
    qkv_w = attn.qkv_proj.weight
    hidden, attn_width = cfg.hidden_size, cfg.num_heads * cfg.head_size
    return [
        (
            "qkv_rope", qkv_w.shape[0], hidden,
            lambda: attn.project_and_store(inp, (cos, sin), cache.layers[0], slots),
            lambda c: qkv_rope_store(x, qkv_w, None, res, norm_w, 1e-5, cfg.num_heads, cfg.num_kv_heads, cos, sin,
                                     *cache.layers[0], slots, None, c),
        ),
        linear_case(hidden, attn_width, rows, dtype, device),
        (
            "gate_up_silu", gate_ups[0].out_features, hidden, lambda: gate_up_silu(inp, gate_up()),
            lambda c: small_gemm(x, gate_up().weight, None, res, norm_w, 1e-5, silu_mul=True, config=c),
        ),
        linear_case(hidden, cfg.intermediate_size, rows, dtype, device),
        linear_case(hidden, 3 * hidden, rows, dtype, device),
    ]  # fmt: skip


def eagle3_qkv_case(cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """EAGLE-3's QKV: its attention input is [norm(embedding) | norm(hidden)] (K = 2 x hidden), read by the
    fused kernel's prologue from both tensors."""
    x, x2 = (torch.randn(rows, cfg.hidden_size, dtype=dtype, device=device) for _ in range(2))
    norm_w = torch.ones(cfg.hidden_size, dtype=dtype, device=device)
    attn = Attention(cfg, input_size=2 * cfg.hidden_size).to(device=device, dtype=dtype)
    cache = KVCache(cfg, 8, BLOCK_SIZE, dtype, device)
    cos, sin = (torch.randn(rows, 1, cfg.head_size // 2, dtype=dtype, device=device) for _ in range(2))
    slots = torch.arange(rows, device=device)
    inp = NormInput(x, None, norm_w, 1e-5, x2, norm_w)
    qkv_w = attn.qkv_proj.weight
    return (
        "qkv_rope", qkv_w.shape[0], 2 * cfg.hidden_size,
        lambda: attn.project_and_store(inp, (cos, sin), cache.layers[0], slots),
        lambda c: qkv_rope_store(x, qkv_w, None, None, norm_w, 1e-5, cfg.num_heads, cfg.num_kv_heads, cos, sin,
                                 *cache.layers[0], slots, None, c, x2=x2, norm_weight2=norm_w),
    )  # fmt: skip


def drafter_cases(preset: str, rows: int, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """The shipped drafters' GEMMs whose shapes the target's lack (DRAFTER_MLP: their MLP widths; EAGLE-3's QKV
    over two inputs), so that drafting steps get their own table entries."""
    cases = []
    for method, intermediate in DRAFTER_MLP.get(preset, {}).items():
        cfg = dataclasses.replace(model_config(preset, 1), intermediate_size=intermediate)
        mlp = [c for c in op_cases(cfg, rows, dtype, device) if c[0] == "gate_up_silu" or c[2] == intermediate]
        cases += mlp + ([eagle3_qkv_case(cfg, rows, dtype, device)] if method == "eagle3" else [])
    return cases


def op_sweep(rows: int, kind: str, op: str) -> list[GemmConfig]:
    """The tile configs timed for `rows` rows of `op`: `kind` "all", "gemv" alone (a shorter run at 4-32 rows),
    "deferred" (the deferred GEMVs, 1-2 rows: small_gemm's ops only) or "wide" (MMA programs of 32-64 rows, as many
    rows at least)."""
    deferred = DEFER_SWEEP if rows <= MAX_DEFER_ROWS and op != "qkv_rope" else []
    wide = [c for c in WIDE_SWEEP if c.block_m <= rows]
    if kind in ("deferred", "wide"):
        sweep = deferred if kind == "deferred" else wide
    else:
        gemv = (GEMV_SWEEP if rows <= MAX_GEMV_ROWS else []) + (GEMV_SPLIT_SWEEP if 4 < rows <= 32 else [])
        sweep = gemv + deferred if kind == "gemv" else SWEEP + wide + gemv + deferred
    if op == "qkv_rope":  # an MMA program takes a whole head: block_n unused
        sweep = [c for c in sweep if c.gemv or c.block_n == 32]
    return sweep


def gemm_table(
    presets: list[str], dtypes: list[torch.dtype], rows_list: list[int], device: torch.device, sweep_kind: str = "all"
) -> tuple[list, dict]:
    rows_out, winners = [], {}
    set_policy("off")
    for dtype in dtypes:
        for preset in presets:
            cfg = model_config(preset, 1)
            for rows in rows_list:
                for op, n, k, unfused, fused in op_cases(cfg, rows, dtype, device) + drafter_cases(
                    preset, rows, dtype, device
                ):
                    base = per_call_ms(unfused, device)
                    sweep = op_sweep(rows, sweep_kind, op)
                    if not sweep:
                        continue
                    timed = [(per_call_ms(lambda c=c, f=fused: f(c), device), c) for c in sweep]
                    best_ms, best = min(timed, key=lambda t: t[0])
                    row = {"dtype": dtype_name(dtype), "preset": preset, "op": op, "rows": rows, "n": n, "k": k,
                           "unfused_us": base * 1e3, "fused_us": best_ms * 1e3, "config": best.__dict__,
                           "timed_us": {str(c): round(ms * 1e3, 2) for ms, c in timed}}  # fmt: skip
                    rows_out.append(row)
                    log(f"{preset} {dtype_name(dtype)} {op} M={rows} N={n} K={k}: unfused {base * 1e3:.1f} us, "
                        f"fused {best_ms * 1e3:.1f} us {best}")  # fmt: skip
                    if best_ms < WIN_MARGIN * base:
                        winners.setdefault(dtype_name(dtype), {})[table_key(op, rows, n, k)] = best.__dict__
    return rows_out, winners


def count_kernels(run: Callable[[], Any]) -> tuple[int, dict[str, float]]:
    """(kernels one run launches, copies and memsets left out; us per kernel name, largest first: under PDL a
    kernel's span includes its wait for the one before)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    per_name: dict[str, float] = {}
    for event in kernels:
        per_name[event.name[:80]] = per_name.get(event.name[:80], 0.0) + event.time_range.elapsed_us()
    return len(kernels), dict(sorted(per_name.items(), key=lambda item: -item[1])[:12])


def capture_pass(
    preset: str,
    policy: str,
    use_pdl: bool,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int | None,
    rows: int = 1,
) -> tuple[torch.cuda.CUDAGraph, dict]:
    """A pass of a request's `rows` new tokens (1: a decode step; k + 1: a verify of k drafts) after CONTEXT cached
    ones, captured as a CUDA graph under `policy` (the fused kernels are chosen at capture), and what it is."""
    set_policy(policy)
    os.environ[pdl.ENV] = "1" if use_pdl else "0"
    cfg = model_config(preset, num_layers)
    model = build_synthetic(cfg, 0, dtype, device).model
    blocks = -(-(CONTEXT + rows) // BLOCK_SIZE)
    cache = KVCache(cfg, blocks + 1, BLOCK_SIZE, dtype, device)
    step = build_attention_step("TRITON_ATTN", [list(range(blocks))], [rows], [CONTEXT + rows],
                                list(range(CONTEXT, CONTEXT + rows)), True, device)  # fmt: skip
    ids, pos = torch.full((rows,), 7, device=device), torch.arange(CONTEXT, CONTEXT + rows, device=device)

    def forward() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, cache.layers, step)[0])

    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    kernels, kernel_us = count_kernels(graph.replay)
    graph.keep_alive = (model, cache, step, ids, pos)  # what the replays read, allocated outside the graph's pool
    return graph, {"preset": preset, "policy": policy, "pdl": pdl.enabled(device), "layers": cfg.num_layers,
                   "rows": rows, "dtype": dtype_name(dtype), "kernels": kernels, "kernel_us": kernel_us}  # fmt: skip


def decode_step(
    preset: str, policy: str, use_pdl: bool, dtype: torch.dtype, device: torch.device, num_layers: int | None
) -> dict:
    """One decode step of batch 1 at CONTEXT as a CUDA graph: its time and kernels."""
    graph, info = capture_pass(preset, policy, use_pdl, dtype, device, num_layers)
    return {**info, "step_ms": time_graph(graph.replay, device, iters=100)}


def best_fused(gemms: list[dict], preset: str, rows: int, dtype: torch.dtype) -> dict[str, Any]:
    """{key: config}: every op of `preset` at `rows` fused at its best config of the per-op sweep, won or not."""
    return {
        table_key(g["op"], rows, g["n"], g["k"]): g["config"]
        for g in gemms
        if g["preset"] == preset and g["dtype"] == dtype_name(dtype) and rows_bucket(g["rows"]) == rows_bucket(rows)
    }


def step_trials(preset: str, rows: int, gemms: list[dict], dtype: torch.dtype, device: torch.device) -> dict:
    """The `rows`-row pass as the table picks, unfused, and under the trial table (the table with every `rows`-row
    op fused at its best config), PDL on; the trial's configs are the winners where it beats the table's pass."""
    trial = best_fused(gemms, preset, rows, dtype)
    if not trial:
        raise SystemExit(f"--step-rows {rows}: time {preset}'s ops at {rows} rows too (--presets, --rows)")
    device_key, dtype_key = torch.cuda.get_device_name(device), dtype_name(dtype)
    devices = json.loads(json.dumps(load_table()))  # a copy: the trial's entries replace the table's
    devices.setdefault(device_key, {}).setdefault(dtype_key, {}).update(trial)
    graphs = {policy: capture_pass(preset, policy, True, dtype, device, None, rows) for policy in ("table", "off")}
    with trial_table(devices):
        graphs["trial"] = capture_pass(preset, "table", True, dtype, device, None, rows)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(TRIAL_ROUNDS):  # interleaved: a drift of the clocks meets every pass alike
        for name, (graph, _) in graphs.items():
            times[name].append(time_graph(graph.replay, device, iters=30))
    passes = {name: {**info, "step_ms": statistics.median(times[name]), "rounds_ms": times[name]}
              for name, (_, info) in graphs.items()}  # fmt: skip
    wins = passes["trial"]["step_ms"] < STEP_MARGIN * passes["table"]["step_ms"]
    log(f"{preset} pass of {rows} rows, PDL: table {passes['table']['step_ms']:.3f} ms ({passes['table']['kernels']} "
        f"kernels), unfused {passes['off']['step_ms']:.3f}, all fused at best {passes['trial']['step_ms']:.3f} ms "
        f"({passes['trial']['kernels']} kernels): {'the trial wins' if wins else 'the table stays'}")  # fmt: skip
    return {"preset": preset, "rows": rows, "passes": passes, "trial": trial, "trial_wins": wins}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument(
        "--presets", default="smollm2,llama3-8b", help="shapes of the per-op table; NAME:tpN for one rank's shard"
    )
    parser.add_argument("--step-presets", default="smollm2", help="models of the decode-step runs")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows of the per-op table")
    parser.add_argument("--step-rows", default="", help="rows of the step-level trials (3.), e.g. 8")
    parser.add_argument(
        "--sweep", choices=("all", "gemv", "deferred", "wide"), default="all",
        help="gemv: the GEMV tiles alone; deferred: the deferred GEMVs (1-2 rows); wide: MMA programs of 32-64 rows",
    )  # fmt: skip
    parser.add_argument("--no-decode-steps", action="store_true", help="skip 2. (the batch-1 decode steps)")
    parser.add_argument("--write-table", action="store_true", help="merge the winners into small_gemm_table.json")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    report: dict[str, Any] = provenance("fused_layer_bench", device)
    rows_list = [int(r) for r in args.rows.split(",")]
    report["gemms"], winners = gemm_table(args.presets.split(","), dtypes, rows_list, device, args.sweep)
    report["winners"] = winners
    if args.write_table:
        measured: dict[str, set[str]] = {}
        # a partial sweep (gemv, deferred, wide) replaces only what it beat: its losers keep the entries they had
        for row in report["gemms"]:
            key = table_key(row["op"], row["rows"], row["n"], row["k"])
            if args.sweep == "all" or key in winners.get(row["dtype"], {}):
                measured.setdefault(row["dtype"], set()).add(key)
        merge_winners(winners, torch.cuda.get_device_name(device), measured)
    trials = [
        step_trials(preset, int(rows), report["gemms"], dtypes[0], device)
        for preset in args.step_presets.split(",")
        for rows in filter(None, args.step_rows.split(","))
    ]
    report["step_trials"] = trials
    if args.write_table:
        dtype_key = dtype_name(dtypes[0])
        for trial in (t for t in trials if t["trial_wins"]):
            entries = trial["trial"]
            merge_winners({dtype_key: entries}, torch.cuda.get_device_name(device), {dtype_key: set(entries)})
    steps = []
    for preset in [] if args.no_decode_steps else args.step_presets.split(","):
        for policy, use_pdl in itertools.product(("off", "triton", "table"), (False, True)):
            two, four = (decode_step(preset, policy, use_pdl, dtypes[0], device, n) for n in (2, 4))
            full = decode_step(preset, policy, use_pdl, dtypes[0], device, None)
            full["kernels_per_layer"] = (four["kernels"] - two["kernels"]) / 2
            full["layer_ms"] = (four["step_ms"] - two["step_ms"]) / 2
            log(
                f"{preset} decode step, {policy}, PDL {full['pdl']}: {full['step_ms']:.3f} ms, {full['kernels']} "
                f"kernels "
                f"({full['kernels_per_layer']:.1f} kernels and {full['layer_ms'] * 1e3:.1f} us per layer)"
            )
            torch.cuda.empty_cache()
            steps.append({**full, "two_layer_ms": two["step_ms"], "four_layer_ms": four["step_ms"]})
    report["decode_steps"] = steps
    write_result(Path(args.out), "fused_layer", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
