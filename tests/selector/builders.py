"""Request builders for the selector tests (imported as `builders`: pytest puts this folder on sys.path)."""

from __future__ import annotations

from specdec.v1 import common_pb2, selector_pb2

GPU_LIBS = {"torch": "2.11.0", "triton": "3.6.0"}


def libraries(**versions: str) -> list[common_pb2.KernelLibrary]:
    return [common_pb2.KernelLibrary(name=name, version=version) for name, version in versions.items()]


def cuda(major: int = 9, minor: int = 0, **extra_libs: str) -> common_pb2.HardwareCapabilities:
    """A CUDA machine with torch and triton, plus the given libraries (flash_attn="4.0.0b36", ...)."""
    return common_pb2.HardwareCapabilities(
        platform=common_pb2.PLATFORM_CUDA,
        device_name="test GPU",
        compute_capability_major=major,
        compute_capability_minor=minor,
        device_count=1,
        libraries=libraries(**GPU_LIBS, **extra_libs),
    )


def rocm(arch: str = "gfx942", **extra_libs: str) -> common_pb2.HardwareCapabilities:
    return common_pb2.HardwareCapabilities(
        platform=common_pb2.PLATFORM_ROCM, gcn_arch=arch, device_count=1, libraries=libraries(**GPU_LIBS, **extra_libs)
    )


def cpu(**libs: str) -> common_pb2.HardwareCapabilities:
    return common_pb2.HardwareCapabilities(
        platform=common_pb2.PLATFORM_CPU, libraries=libraries(torch="2.13.0", **libs)
    )


def layers(
    head_size: int = 128,
    dtype: int = common_pb2.DTYPE_BFLOAT16,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    **fields: object,
) -> common_pb2.LayerSpec:
    return common_pb2.LayerSpec(
        head_size=head_size, dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, **fields
    )


def dflash(causal: bool = False, backend: str = "", k: int = 15, **fields: object) -> common_pb2.SpeculativeConfig:
    return common_pb2.SpeculativeConfig(
        method=common_pb2.SPEC_METHOD_DFLASH,
        num_speculative_tokens=k,
        attention_backend=backend,
        dflash_config=common_pb2.DFlashConfig(causal=causal, mask_token_id=5, block_size=16),
        **fields,
    )


def eagle(method: int = common_pb2.SPEC_METHOD_EAGLE3, backend: str = "", k: int = 3, **fields: object):
    return common_pb2.SpeculativeConfig(method=method, num_speculative_tokens=k, attention_backend=backend, **fields)


def request(
    hardware: common_pb2.HardwareCapabilities | None = None,
    target: common_pb2.LayerSpec | None = None,
    backend: str = "",
    use_non_causal: bool = False,
    speculative: common_pb2.SpeculativeConfig | None = None,
) -> selector_pb2.SelectBackendsRequest:
    req = selector_pb2.SelectBackendsRequest(
        hardware=hardware if hardware is not None else cuda(flash_attn="4.0.0b36"),
        target_layers=target if target is not None else layers(),
        attention=common_pb2.AttentionConfig(backend=backend, use_non_causal=use_non_causal),
    )
    if speculative is not None:
        req.speculative.CopyFrom(speculative)
    return req
