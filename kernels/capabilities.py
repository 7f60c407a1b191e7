"""The capability table of every attention backend, and the one `validate` that explains refusals.

Torch-free on purpose: the selector (a CPU-only service) and the executor both read this table, so
what a backend claims and what it is asked to do are decided in one place.

For the backends this project implements (TRITON_ATTN, FLEX_ATTENTION, FLASH_ATTN through our wrapper,
CPU_ATTN, ROCM_ATTN) the entries say what our implementations compute, and tests/attention checks that
they do: no sinks, no sliding window, KV cache in the activation's precision (no fp8). FLASHINFER and
the AITER backends have no implementation here; their entries keep vLLM 0.33's figures, and the
executor reports them unavailable. The fields and the selection rules (R1-R11): docs/selection.md.
CPU_ATTN is SDPA over gathered KV, so it takes any head and block size. Tree attention (tree drafting's verify
and draft passes) is ours alone: TRITON_ATTN, FLEX_ATTENTION and CPU_ATTN compute it; the others are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class Platform(StrEnum):
    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


class DType(StrEnum):
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
_NATIVE_KV = ("auto", "float16", "bfloat16")

# The fixed reason vocabulary, in the order validate reports reasons.
PLATFORM_NOT_SUPPORTED = "platform not supported"
HEAD_SIZE_NOT_SUPPORTED = "head_size not supported"
DTYPE_NOT_SUPPORTED = "dtype not supported"
KV_CACHE_DTYPE_NOT_SUPPORTED = "kv_cache_dtype not supported"
BLOCK_SIZE_NOT_SUPPORTED = "block_size not supported"
MLA_NOT_SUPPORTED = "MLA not supported"
SINK_NOT_SUPPORTED = "attention sinks not supported"
COMPUTE_CAPABILITY_NOT_SUPPORTED = "compute capability not supported"
SLIDING_WINDOW_NOT_SUPPORTED = "sliding window not supported"
NON_CAUSAL_NOT_SUPPORTED = "non-causal attention not supported"
TREE_ATTENTION_NOT_SUPPORTED = "tree attention not supported"
NOT_INSTALLED_SUFFIX = " not installed"  # preceded by the library name: "flash_attn not installed"

REASON_ORDER = (
    PLATFORM_NOT_SUPPORTED,
    HEAD_SIZE_NOT_SUPPORTED,
    DTYPE_NOT_SUPPORTED,
    KV_CACHE_DTYPE_NOT_SUPPORTED,
    BLOCK_SIZE_NOT_SUPPORTED,
    MLA_NOT_SUPPORTED,
    SINK_NOT_SUPPORTED,
    COMPUTE_CAPABILITY_NOT_SUPPORTED,
    SLIDING_WINDOW_NOT_SUPPORTED,
    NON_CAUSAL_NOT_SUPPORTED,
    TREE_ATTENTION_NOT_SUPPORTED,
)


def not_installed(library: str) -> str:
    return library + NOT_INSTALLED_SUFFIX


@dataclass(frozen=True)
class SizeRule:
    """Accepted sizes: one of `allowed` if given, else multiples of `multiple_of` in [minimum, maximum]."""

    allowed: tuple[int, ...] = ()
    multiple_of: int = 1
    minimum: int = 1
    maximum: int = 0  # 0: unbounded

    def accepts(self, size: int) -> bool:
        if self.allowed:
            return size in self.allowed
        return size >= self.minimum and size % self.multiple_of == 0 and (not self.maximum or size <= self.maximum)


@dataclass(frozen=True)
class Hardware:
    """The parts of a capability report that validation reads."""

    platform: Platform
    compute_capability: tuple[int, int] = (0, 0)  # CUDA
    gcn_arch: str = ""  # ROCm
    libraries: tuple[tuple[str, str], ...] = ()  # (name, version), as reported

    def library_version(self, name: str) -> str | None:
        return dict(self.libraries).get(name)


@dataclass(frozen=True)
class AttentionNeeds:
    """What one attention stack (the target's or the drafter's) asks of a backend."""

    head_size: int
    dtype: DType
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None: the backend's choice
    use_mla: bool = False
    has_sink: bool = False
    has_sliding_window: bool = False
    use_non_causal: bool = False
    # Tree drafting: each draft attends to the context and its ancestors only (a mask per token, R11).
    use_tree_attention: bool = False


VersionCheck = Callable[[AttentionNeeds, Hardware, str], list[str]]


@dataclass(frozen=True)
class BackendCapability:
    name: str
    description: str
    platforms: tuple[Platform, ...]
    dtypes: tuple[DType, ...]
    kv_cache_dtypes: tuple[str, ...]
    head_sizes: SizeRule
    block_sizes: SizeRule
    required_library: str
    compute_capability: tuple[int, int] = (0, 0)  # CUDA: inclusive (min, max) as major*10+minor; 0 = open
    gcn_archs: tuple[str, ...] = ()  # ROCm: empty = any
    supports_mla: bool = False
    supports_sink: bool = False
    supports_sliding_window: bool = True
    supports_non_causal: bool = False
    supports_tree_attention: bool = False  # a per-token ancestor mask over the newest keys (R11)
    # Narrowing by the installed library's version (FA2 vs FA4, ...); gets the reported version.
    version_check: VersionCheck | None = None
    notes: tuple[str, ...] = field(default=())

    def validate(self, needs: AttentionNeeds, hardware: Hardware) -> list[str]:
        """Every reason this backend cannot serve `needs` on `hardware`; empty when it can."""
        reasons: set[str] = set()
        if hardware.platform not in self.platforms:
            reasons.add(PLATFORM_NOT_SUPPORTED)
        if not self.head_sizes.accepts(needs.head_size):
            reasons.add(HEAD_SIZE_NOT_SUPPORTED)
        if needs.dtype not in self.dtypes:
            reasons.add(DTYPE_NOT_SUPPORTED)
        if needs.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.add(KV_CACHE_DTYPE_NOT_SUPPORTED)
        if needs.block_size is not None and not self.block_sizes.accepts(needs.block_size):
            reasons.add(BLOCK_SIZE_NOT_SUPPORTED)
        if needs.use_mla and not self.supports_mla:
            reasons.add(MLA_NOT_SUPPORTED)
        if needs.has_sink and not self.supports_sink:
            reasons.add(SINK_NOT_SUPPORTED)
        if not self._supports_device(hardware):
            reasons.add(COMPUTE_CAPABILITY_NOT_SUPPORTED)
        if needs.has_sliding_window and not self.supports_sliding_window:
            reasons.add(SLIDING_WINDOW_NOT_SUPPORTED)
        if needs.use_non_causal and not self.supports_non_causal:
            reasons.add(NON_CAUSAL_NOT_SUPPORTED)
        if needs.use_tree_attention and not self.supports_tree_attention:
            reasons.add(TREE_ATTENTION_NOT_SUPPORTED)
        version = hardware.library_version(self.required_library)
        if version is not None and self.version_check is not None:
            reasons.update(self.version_check(needs, hardware, version))
        ordered = [r for r in REASON_ORDER if r in reasons]
        if version is None:
            ordered.append(not_installed(self.required_library))
        return ordered

    def _supports_device(self, hardware: Hardware) -> bool:
        if hardware.platform is Platform.CUDA:
            lo, hi = self.compute_capability
            cc = hardware.compute_capability[0] * 10 + hardware.compute_capability[1]
            return cc >= lo and (not hi or cc <= hi)
        if hardware.platform is Platform.ROCM:
            return not self.gcn_archs or hardware.gcn_arch.split(":")[0] in self.gcn_archs
        return True


def library_major(version: str) -> int:
    """Leading integer of a version string ("4.0.0b36" -> 4); 0 when there is none."""
    digits = ""
    for ch in version.strip().lstrip("v"):
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else 0


def _flash_attn_version_check(needs: AttentionNeeds, hardware: Hardware, version: str) -> list[str]:
    """FA2: SM8.0+, head <= 256, pages of a multiple of 256 tokens. FA3: SM9x, head <= 256.
    FA4 4.0.0b36 with paged KV: heads 32, 64, 128, 256 (SM10x also 512). On an H100 it refused head 40
    ("Paged KV does not support irregular head dim") and returned wrong results for 80 and 96."""
    major = library_major(version)
    cc_major = hardware.compute_capability[0]
    reasons = []
    if major >= 4:
        head_ok = needs.head_size in ((32, 64, 128, 256, 512) if cc_major == 10 else (32, 64, 128, 256))
    else:
        head_ok = needs.head_size <= 256
    if not head_ok:
        reasons.append(HEAD_SIZE_NOT_SUPPORTED)
    if major <= 2 and needs.block_size is not None and needs.block_size % 256:
        reasons.append(BLOCK_SIZE_NOT_SUPPORTED)
    if (major == 3 and cc_major != 9) or (major >= 4 and cc_major not in (9, 10)):
        reasons.append(COMPUTE_CAPABILITY_NOT_SUPPORTED)
    return reasons


def _flashinfer_version_check(needs: AttentionNeeds, hardware: Hardware, version: str) -> list[str]:
    """Sinks only through the TRT-LLM kernels, which exist on SM10x alone."""
    if needs.has_sink and hardware.compute_capability[0] != 10:
        return [SINK_NOT_SUPPORTED]
    return []


_HALF = (DType.FLOAT16, DType.BFLOAT16)
_ALL_DTYPES = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32)
_MULTIPLE_OF_16 = SizeRule(multiple_of=16)

BACKENDS: dict[str, BackendCapability] = {
    cap.name: cap
    for cap in (
        BackendCapability(
            name="FLASH_ATTN",
            description="flash_attn package: FA2 varlen with block_table (SM8x), FA4 CuTe with page_table (SM9x/SM10x)",
            platforms=(Platform.CUDA,),
            dtypes=_HALF,
            kv_cache_dtypes=_NATIVE_KV,
            head_sizes=SizeRule(multiple_of=8, minimum=8, maximum=512),
            block_sizes=_MULTIPLE_OF_16,
            required_library="flash_attn",
            compute_capability=(80, 0),
            supports_sliding_window=False,
            supports_non_causal=True,
            version_check=_flash_attn_version_check,
            notes=(
                "flash_attn 2.x: head_size <= 256; pages (block_size) a multiple of 256",
                "flash_attn 3.x: compute capability 9.x only",
                "flash_attn 4.x: compute capability 9.x or 10.x; head_size 32, 64, 128, 256 (10.x: also 512)",
                "no tree attention: its varlen kernels take causal or full masks, not a mask per token",
            ),
        ),
        BackendCapability(
            name="FLASHINFER",
            description="FlashInfer paged prefill/decode kernels",
            platforms=(Platform.CUDA,),
            dtypes=_HALF,
            kv_cache_dtypes=(*_NATIVE_KV, *FP8_KV_CACHE_DTYPES),
            head_sizes=SizeRule(allowed=(64, 128, 256, 512)),
            block_sizes=SizeRule(allowed=(16, 32, 64)),
            required_library="flashinfer",
            compute_capability=(80, 121),
            supports_sink=True,
            supports_non_causal=True,
            version_check=_flashinfer_version_check,
            notes=("attention sinks only on compute capability 10.x (TRT-LLM kernels)",),
        ),
        BackendCapability(
            name="TRITON_ATTN",
            description="our Triton kernel: GQA, varlen, paged, causal or not, split-KV for long contexts",
            platforms=(Platform.CUDA, Platform.ROCM, Platform.CPU),
            dtypes=_ALL_DTYPES,
            kv_cache_dtypes=_NATIVE_KV,
            head_sizes=SizeRule(minimum=32, maximum=256),
            block_sizes=_MULTIPLE_OF_16,
            required_library="triton",
            supports_sliding_window=False,
            supports_non_causal=True,
            supports_tree_attention=True,
            notes=("on CPU it runs through the Triton interpreter (tests only)",),
        ),
        BackendCapability(
            name="FLEX_ATTENTION",
            description="torch flex_attention over the paged cache with causal, bidirectional or tree mask_mods",
            platforms=(Platform.CUDA, Platform.ROCM, Platform.CPU),
            dtypes=_ALL_DTYPES,
            kv_cache_dtypes=_NATIVE_KV,
            head_sizes=SizeRule(),
            block_sizes=_MULTIPLE_OF_16,
            required_library="torch",
            supports_sliding_window=False,
            supports_non_causal=True,
            supports_tree_attention=True,
        ),
        BackendCapability(
            name="ROCM_ATTN",
            description="prefix-prefill style Triton kernel (context unmasked, new tokens causal or not)",
            platforms=(Platform.ROCM,),
            dtypes=_ALL_DTYPES,
            kv_cache_dtypes=_NATIVE_KV,
            head_sizes=SizeRule(allowed=(32, 64, 80, 96, 128, 160, 192, 224, 256)),
            block_sizes=_MULTIPLE_OF_16,
            required_library="triton",
            supports_sliding_window=False,
            supports_non_causal=True,
        ),
        BackendCapability(
            name="ROCM_AITER_FA",
            description="AITER flash-attention (CDNA3+)",
            platforms=(Platform.ROCM,),
            dtypes=_HALF,
            kv_cache_dtypes=KV_CACHE_DTYPES,
            head_sizes=SizeRule(allowed=(64, 128, 256)),
            block_sizes=SizeRule(allowed=(16, 32)),
            required_library="aiter",
            gcn_archs=("gfx940", "gfx941", "gfx942", "gfx950"),
            supports_sink=True,
            supports_non_causal=True,
        ),
        BackendCapability(
            name="ROCM_AITER_UNIFIED_ATTN",
            description="AITER unified attention (causal only)",
            platforms=(Platform.ROCM,),
            dtypes=_HALF,
            kv_cache_dtypes=KV_CACHE_DTYPES,
            head_sizes=SizeRule(minimum=32),
            block_sizes=_MULTIPLE_OF_16,
            required_library="aiter",
            supports_sink=True,
            supports_non_causal=False,
        ),
        BackendCapability(
            name="CPU_ATTN",
            description="torch SDPA over gathered KV: the CPU default and the reference implementation",
            platforms=(Platform.CPU,),
            dtypes=_ALL_DTYPES,
            kv_cache_dtypes=_NATIVE_KV,
            head_sizes=SizeRule(),
            block_sizes=SizeRule(),
            required_library="torch",
            supports_sliding_window=False,
            supports_non_causal=True,
            supports_tree_attention=True,
        ),
    )
}

BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def get_backend(name: str) -> BackendCapability | None:
    """The capability entry for a backend name, case-insensitive; None if there is no such backend."""
    return BACKENDS.get(name.strip().upper())


def reason_vocabulary() -> list[str]:
    """Every reason validate can return, for documentation and the ListBackends answer."""
    libs = sorted({cap.required_library for cap in BACKENDS.values()})
    return [*REASON_ORDER, *(not_installed(lib) for lib in libs)]
