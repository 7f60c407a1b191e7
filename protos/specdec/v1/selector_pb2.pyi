from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectBackendsRequest(_message.Message):
    __slots__ = ("hardware", "target_layers", "attention", "speculative")
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    hardware: _common_pb2.HardwareCapabilities
    target_layers: _common_pb2.LayerSpec
    attention: _common_pb2.AttentionConfig
    speculative: _common_pb2.SpeculativeConfig
    def __init__(self, hardware: _Optional[_Union[_common_pb2.HardwareCapabilities, _Mapping]] = ..., target_layers: _Optional[_Union[_common_pb2.LayerSpec, _Mapping]] = ..., attention: _Optional[_Union[_common_pb2.AttentionConfig, _Mapping]] = ..., speculative: _Optional[_Union[_common_pb2.SpeculativeConfig, _Mapping]] = ...) -> None: ...

class SelectBackendsResponse(_message.Message):
    __slots__ = ("target", "drafter")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.BackendDecision
    drafter: _common_pb2.BackendDecision
    def __init__(self, target: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ..., drafter: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ...) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ("platform",)
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    platform: _common_pb2.Platform
    def __init__(self, platform: _Optional[_Union[_common_pb2.Platform, str]] = ...) -> None: ...

class SizeRule(_message.Message):
    __slots__ = ("allowed", "multiple_of", "minimum", "maximum")
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    MULTIPLE_OF_FIELD_NUMBER: _ClassVar[int]
    MINIMUM_FIELD_NUMBER: _ClassVar[int]
    MAXIMUM_FIELD_NUMBER: _ClassVar[int]
    allowed: _containers.RepeatedScalarFieldContainer[int]
    multiple_of: int
    minimum: int
    maximum: int
    def __init__(self, allowed: _Optional[_Iterable[int]] = ..., multiple_of: _Optional[int] = ..., minimum: _Optional[int] = ..., maximum: _Optional[int] = ...) -> None: ...

class ComputeCapabilityRange(_message.Message):
    __slots__ = ("minimum", "maximum")
    MINIMUM_FIELD_NUMBER: _ClassVar[int]
    MAXIMUM_FIELD_NUMBER: _ClassVar[int]
    minimum: int
    maximum: int
    def __init__(self, minimum: _Optional[int] = ..., maximum: _Optional[int] = ...) -> None: ...

class BackendCapabilities(_message.Message):
    __slots__ = ("name", "description", "platforms", "dtypes", "kv_cache_dtypes", "head_sizes", "block_sizes", "compute_capability", "gcn_archs", "supports_mla", "supports_sink", "supports_sliding_window", "supports_non_causal", "required_library", "notes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPES_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    GCN_ARCHS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_MLA_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SINK_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_LIBRARY_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    platforms: _containers.RepeatedScalarFieldContainer[_common_pb2.Platform]
    dtypes: _containers.RepeatedScalarFieldContainer[_common_pb2.DType]
    kv_cache_dtypes: _containers.RepeatedScalarFieldContainer[str]
    head_sizes: SizeRule
    block_sizes: SizeRule
    compute_capability: ComputeCapabilityRange
    gcn_archs: _containers.RepeatedScalarFieldContainer[str]
    supports_mla: bool
    supports_sink: bool
    supports_sliding_window: bool
    supports_non_causal: bool
    required_library: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., platforms: _Optional[_Iterable[_Union[_common_pb2.Platform, str]]] = ..., dtypes: _Optional[_Iterable[_Union[_common_pb2.DType, str]]] = ..., kv_cache_dtypes: _Optional[_Iterable[str]] = ..., head_sizes: _Optional[_Union[SizeRule, _Mapping]] = ..., block_sizes: _Optional[_Union[SizeRule, _Mapping]] = ..., compute_capability: _Optional[_Union[ComputeCapabilityRange, _Mapping]] = ..., gcn_archs: _Optional[_Iterable[str]] = ..., supports_mla: _Optional[bool] = ..., supports_sink: _Optional[bool] = ..., supports_sliding_window: _Optional[bool] = ..., supports_non_causal: _Optional[bool] = ..., required_library: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class PlatformPriority(_message.Message):
    __slots__ = ("platform", "condition", "backends")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    platform: _common_pb2.Platform
    condition: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, platform: _Optional[_Union[_common_pb2.Platform, str]] = ..., condition: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ...) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends", "priorities", "reason_vocabulary")
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    REASON_VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[BackendCapabilities]
    priorities: _containers.RepeatedCompositeFieldContainer[PlatformPriority]
    reason_vocabulary: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, backends: _Optional[_Iterable[_Union[BackendCapabilities, _Mapping]]] = ..., priorities: _Optional[_Iterable[_Union[PlatformPriority, _Mapping]]] = ..., reason_vocabulary: _Optional[_Iterable[str]] = ...) -> None: ...
