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
    __slots__ = ("method", "source", "num_speculative_tokens", "attention_backend", "dflash_config", "tree")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DFLASH_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    method: _common_pb2.SpecMethod
    source: ModelSource
    num_speculative_tokens: int
    attention_backend: str
    dflash_config: _common_pb2.DFlashConfig
    tree: _common_pb2.DraftTree
    def __init__(self, method: _Optional[_Union[_common_pb2.SpecMethod, str]] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., attention_backend: _Optional[str] = ..., dflash_config: _Optional[_Union[_common_pb2.DFlashConfig, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("target", "draft", "dtype", "attention", "block_size", "num_kv_blocks", "gpu_memory_utilization", "enable_prefix_caching")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    target: ModelSource
    draft: DraftModel
    dtype: _common_pb2.DType
    attention: _common_pb2.AttentionConfig
    block_size: int
    num_kv_blocks: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    def __init__(self, target: _Optional[_Union[ModelSource, _Mapping]] = ..., draft: _Optional[_Union[DraftModel, _Mapping]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., attention: _Optional[_Union[_common_pb2.AttentionConfig, _Mapping]] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., enable_prefix_caching: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_size", "max_model_len", "dtype", "block_size", "num_kv_blocks", "spec_method", "num_speculative_tokens", "has_tokenizer", "eos_token_id", "has_chat_template", "prefix_caching")
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
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
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
    has_chat_template: bool
    prefix_caching: bool
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., spec_method: _Optional[_Union[_common_pb2.SpecMethod, str]] = ..., num_speculative_tokens: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., eos_token_id: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., prefix_caching: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "ignore_eos", "stop", "logprobs", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "messages", "sampling", "num_speculative_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: str
    messages: ChatMessages
    sampling: SamplingParams
    num_speculative_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "drafted_tokens", "accepted_tokens", "mean_acceptance_length", "acceptance_rate_per_position", "cached_prompt_tokens", "verify_steps")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    acceptance_rate_per_position: _containers.RepeatedScalarFieldContainer[float]
    cached_prompt_tokens: int
    verify_steps: int
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_rate_per_position: _Optional[_Iterable[float]] = ..., cached_prompt_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "num_drafted", "num_accepted", "finished", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    num_drafted: int
    num_accepted: int
    finished: Finished
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

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

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("server_version", "torch_version", "grpc_version", "capabilities", "model_loaded", "info", "target_backend", "draft_backend", "max_batch_size", "max_queued_requests", "max_prompt_tokens", "uptime_seconds", "started_unix_ms")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRPC_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_LOADED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TARGET_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    torch_version: str
    grpc_version: str
    capabilities: _common_pb2.HardwareCapabilities
    model_loaded: bool
    info: ModelInfo
    target_backend: _common_pb2.BackendDecision
    draft_backend: _common_pb2.BackendDecision
    max_batch_size: int
    max_queued_requests: int
    max_prompt_tokens: int
    uptime_seconds: float
    started_unix_ms: int
    def __init__(self, server_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., grpc_version: _Optional[str] = ..., capabilities: _Optional[_Union[_common_pb2.HardwareCapabilities, _Mapping]] = ..., model_loaded: _Optional[bool] = ..., info: _Optional[_Union[ModelInfo, _Mapping]] = ..., target_backend: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ..., draft_backend: _Optional[_Union[_common_pb2.BackendDecision, _Mapping]] = ..., max_batch_size: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., started_unix_ms: _Optional[int] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadsResponse(_message.Message):
    __slots__ = ("running_requests", "queued_requests", "num_kv_blocks", "used_kv_blocks", "kv_cache_usage", "generation_tokens_per_second", "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "cached_free_kv_blocks")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    queued_requests: int
    num_kv_blocks: int
    used_kv_blocks: int
    kv_cache_usage: float
    generation_tokens_per_second: float
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    cached_free_kv_blocks: int
    def __init__(self, running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., used_kv_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., generation_tokens_per_second: _Optional[float] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., cached_free_kv_blocks: _Optional[int] = ...) -> None: ...
