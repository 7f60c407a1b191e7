"""Compile TRITON_ATTN's split decode kernel with and without the one-kernel combine, for sm_90 (Triton's own
ptxas) and gfx942, on a machine without a GPU; print one JSON line of what test_split_combine.py checks. Run as a
script, without TRITON_INTERPRET (the interpreter's kernels cannot be compiled).

    python tests/attention/split_combine_compile.py bf16
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_attn import _paged_attention_kernel as kernel


def compile_for(target: str, dtype: str, combine: bool, head_size: int = 128, group: int = 4) -> Any:
    """The decode kernel (16 rows: 4 tokens x a group of 4, 16 splits) as choose_config launches it on an H100."""
    pointers = {"q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype, "out_ptr": dtype, "counters_ptr": "i32"}
    pointers |= {"block_table_ptr": "i32", "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32", "tree_mask_ptr": "i64"}
    constants = dict(
        GROUP=group, ROW_GROUP=group, BLOCK_Q=16 // group, BLOCK_M=16, BLOCK_N=64, HEAD_SIZE=head_size,
        HEAD_PAD=head_size, CAUSAL=True, SPLIT=True, PAGE_ALIGNED=True, DOT_PRECISION="tf32", MAX_SPLITS=16,
        MIN_SPLIT_LEN=128, TREE=False, NUM_SPLITS=16, COMBINE=combine, PDL=target == "cuda",
    )  # fmt: skip
    signature = {n: f"*{pointers.get(n, 'fp32')}" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
    signature |= {"scale_log2": "fp32"} | dict.fromkeys(constants, "constexpr")
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()})
    gpu = GPUTarget("cuda", 90, 32) if target == "cuda" else GPUTarget("hip", "gfx942", 64)
    return triton.compile(source, target=gpu, options={"num_warps": 4, "num_stages": 3 if target == "cuda" else 2})


def main(dtype: str) -> None:
    one, two = compile_for("cuda", dtype, True), compile_for("cuda", dtype, False)
    ptx = one.asm["ptx"]
    add = ptx.find("atom.global.gpu.acq_rel.add")
    found = {
        "barrier_before_add": add > 0 and "bar.sync" in ptx[max(0, add - 600) : add],
        "cg_loads": "ld.global.cg" in ptx,
        "two_kernel_atomics": "atom." in two.asm["ptx"],
        "shared_one": one.metadata.shared,
        "shared_two": two.metadata.shared,
        "hip_atomic_add": "global_atomic_add" in compile_for("hip", dtype, True).asm["amdgcn"],
    }
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
