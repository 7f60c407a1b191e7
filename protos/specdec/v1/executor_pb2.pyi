from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyntheticModel(_message.Message):
    __slots__ = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_size", "seed", "draft_vocab_size")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    seed: int
    draft_vocab_size: int
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., seed: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ...) -> None: ...

class ModelSource(_message.Message):
    __slots__ = ("path", "synthetic")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_FIELD_NUMBER: _ClassVar[int]
    path: str
    synthetic: SyntheticModel
    def __init__(self, path: _Optional[str] = ..., synthetic: _Optional[_Union[SyntheticModel, _Mapping]] = ...) -> None: ...

class DraftModel(_message.Message):
    __slots__ = ("method", "source", "num_speculative_tokens", "attention_backend", "dflash_config")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DFLASH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    method: _common_pb2.SpecMethod
    source: ModelSource
    num_speculative_tokens: int
    attention_backend: str
    dflash_config: _common_pb2.DFlashConfig
    def __init__(self, method: _Optional[_Union[_common_pb2.SpecMethod, str]] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., attention_backend: _Optional[str] = ..., dflash_config: _Optional[_Union[_common_pb2.DFlashConfig, _Mapping]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("target", "draft", "dtype", "attention", "block_size", "num_kv_blocks", "gpu_memory_utilization")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    target: ModelSource
    draft: DraftModel
    dtype: _common_pb2.DType
    attention: _common_pb2.AttentionConfig
    block_size: int
    num_kv_blocks: int
    gpu_memory_utilization: float
    def __init__(self, target: _Optional[_Union[ModelSource, _Mapping]] = ..., draft: _Optional[_Union[DraftModel, _Mapping]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., attention: _Optional[_Union[_common_pb2.AttentionConfig, _Mapping]] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_size", "max_model_len", "dtype", "block_size", "num_kv_blocks", "spec_method", "num_speculative_tokens", "has_tokenizer", "eos_token_id")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int
    dtype: _common_pb2.DType
    block_size: int
    num_kv_blocks: int
    spec_method: _common_pb2.SpecMethod
    num_speculative_tokens: int
    has_tokenizer: bool
    eos_token_id: int
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., spec_method: _Optional[_Union[_common_pb2.SpecMethod, str]] = ..., num_speculative_tokens: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., eos_token_id: _Optional[int] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("target_backend", "draft_backend", "info")
    TARGET_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    target_backend: _common_pb2.BackendDecision
    draft_backend: _common_pb2.BackendDecision
    info: ModelInfo
    def __init__(self, target_backend: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ..., draft_backend: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ..., info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("info", "target_backend", "draft_backend")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TARGET_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    target_backend: _common_pb2.BackendDecision
    draft_backend: _common_pb2.BackendDecision
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ..., target_backend: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ..., draft_backend: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: str
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "drafted_tokens", "accepted_tokens", "mean_acceptance_length", "acceptance_rate_per_position")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    acceptance_rate_per_position: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_rate_per_position: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "num_drafted", "num_accepted", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    num_drafted: int
    num_accepted: int
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...
