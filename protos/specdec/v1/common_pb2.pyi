from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Platform(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLATFORM_UNSPECIFIED: _ClassVar[Platform]
    PLATFORM_CUDA: _ClassVar[Platform]
    PLATFORM_ROCM: _ClassVar[Platform]
    PLATFORM_CPU: _ClassVar[Platform]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]

class SpecMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_METHOD_UNSPECIFIED: _ClassVar[SpecMethod]
    SPEC_METHOD_NONE: _ClassVar[SpecMethod]
    SPEC_METHOD_EAGLE: _ClassVar[SpecMethod]
    SPEC_METHOD_EAGLE3: _ClassVar[SpecMethod]
    SPEC_METHOD_DFLASH: _ClassVar[SpecMethod]
PLATFORM_UNSPECIFIED: Platform
PLATFORM_CUDA: Platform
PLATFORM_ROCM: Platform
PLATFORM_CPU: Platform
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
SPEC_METHOD_UNSPECIFIED: SpecMethod
SPEC_METHOD_NONE: SpecMethod
SPEC_METHOD_EAGLE: SpecMethod
SPEC_METHOD_EAGLE3: SpecMethod
SPEC_METHOD_DFLASH: SpecMethod

class KernelLibrary(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class HardwareCapabilities(_message.Message):
    __slots__ = ("platform", "device_name", "compute_capability_major", "compute_capability_minor", "gcn_arch", "total_memory_bytes", "device_count", "libraries", "tensor_parallel_size")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MAJOR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MINOR_FIELD_NUMBER: _ClassVar[int]
    GCN_ARCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LIBRARIES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    platform: Platform
    device_name: str
    compute_capability_major: int
    compute_capability_minor: int
    gcn_arch: str
    total_memory_bytes: int
    device_count: int
    libraries: _containers.RepeatedCompositeFieldContainer[KernelLibrary]
    tensor_parallel_size: int
    def __init__(self, platform: _Optional[_Union[Platform, str]] = ..., device_name: _Optional[str] = ..., compute_capability_major: _Optional[int] = ..., compute_capability_minor: _Optional[int] = ..., gcn_arch: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., device_count: _Optional[int] = ..., libraries: _Optional[_Iterable[_Union[KernelLibrary, _Mapping]]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("head_size", "num_heads", "num_kv_heads", "dtype", "kv_cache_dtype", "block_size", "use_mla", "sliding_window", "has_sink", "tensor_parallel_size", "num_heads_per_rank", "num_kv_heads_per_rank")
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    USE_MLA_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    HAS_SINK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: DType
    kv_cache_dtype: str
    block_size: int
    use_mla: bool
    sliding_window: int
    has_sink: bool
    tensor_parallel_size: int
    num_heads_per_rank: int
    num_kv_heads_per_rank: int
    def __init__(self, head_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., use_mla: _Optional[bool] = ..., sliding_window: _Optional[int] = ..., has_sink: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., num_heads_per_rank: _Optional[int] = ..., num_kv_heads_per_rank: _Optional[int] = ...) -> None: ...

class AttentionConfig(_message.Message):
    __slots__ = ("backend", "use_non_causal")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    USE_NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    backend: str
    use_non_causal: bool
    def __init__(self, backend: _Optional[str] = ..., use_non_causal: _Optional[bool] = ...) -> None: ...

class DFlashConfig(_message.Message):
    __slots__ = ("causal", "target_layer_ids", "mask_token_id", "block_size")
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    causal: bool
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_token_id: int
    block_size: int
    def __init__(self, causal: _Optional[bool] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., mask_token_id: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("branching", "top_k", "verify_budget")
    BRANCHING_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    branching: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    verify_budget: int
    def __init__(self, branching: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ..., verify_budget: _Optional[int] = ...) -> None: ...

class SpeculativeConfig(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "attention_backend", "draft_layers", "dflash_config", "tree")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DFLASH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    method: SpecMethod
    num_speculative_tokens: int
    attention_backend: str
    draft_layers: LayerSpec
    dflash_config: DFlashConfig
    tree: DraftTree
    def __init__(self, method: _Optional[_Union[SpecMethod, str]] = ..., num_speculative_tokens: _Optional[int] = ..., attention_backend: _Optional[str] = ..., draft_layers: _Optional[_Union[LayerSpec, _Mapping]] = ..., dflash_config: _Optional[_Union[DFlashConfig, _Mapping]] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ...) -> None: ...

class CandidateVerdict(_message.Message):
    __slots__ = ("backend", "reasons")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, backend: _Optional[str] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class BackendDecision(_message.Message):
    __slots__ = ("backend", "explicit", "use_non_causal", "candidates", "use_tree_attention")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_FIELD_NUMBER: _ClassVar[int]
    USE_NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    USE_TREE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    backend: str
    explicit: bool
    use_non_causal: bool
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateVerdict]
    use_tree_attention: bool
    def __init__(self, backend: _Optional[str] = ..., explicit: _Optional[bool] = ..., use_non_causal: _Optional[bool] = ..., candidates: _Optional[_Iterable[_Union[CandidateVerdict, _Mapping]]] = ..., use_tree_attention: _Optional[bool] = ...) -> None: ...
