#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) for the offline GPU host (Python 3.12, x86_64), in parts that each
# travel beside the working tree in one call (a call carries 64 MB in all; the tree is about 31 MB):
#   bash bench/fa4_parts.sh            -> fa/pNN/cu.partNN (the 92 MB CUTLASS runtime wheel, cut) and, in the
#                                         last part's folder, the other wheels
# On the host, one call per part: `bash bench/gpu_run.sh stash` carries fa/p00..; the last carries its part and
# runs `bash bench/gpu_run.sh install STEPS`, which joins the parts and installs every wheel (bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
part_bytes=${PART_BYTES:-19000000}
rm -rf fa && mkdir -p fa/.dl
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
for wheel in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5; do
  python3 -m pip download -q --no-deps "${platform[@]}" -d fa/.dl "$wheel"
done
runtime=$(ls fa/.dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b "$part_bytes" -d -a 2 "$runtime" fa/.dl/cu.part
rm "$runtime"
last=""
for part in fa/.dl/cu.part*; do
  number=${part#fa/.dl/cu.part}
  mkdir -p "fa/p$number" && mv "$part" "fa/p$number/"
  last="fa/p$number"
done
mv fa/.dl/*.whl "$last/"
rmdir fa/.dl
du -sh fa/p*
