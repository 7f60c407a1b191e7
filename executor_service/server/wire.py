"""Where the wire meets the engine: protobuf messages into the engine's plain settings and back, and the
engine's errors into gRPC statuses, each conversion written once.

Only the server layer (servicer.py, validation.py, generate_stream.py, session.py, ...) imports this module; the
engine, sampling, speculative decoding and the model runner never see a proto or a status code (the layers:
tests/test_import_graph.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import grpc
import torch

from executor_service.errors import (
    EngineError,
    EngineUnavailable,
    FieldProblem,
    InvalidField,
    OutOfKVCache,
    RequestFieldError,
    UnmetPrecondition,
)
from executor_service.models.config import ModelConfig
from executor_service.models.model_loading import TargetSource, default_dtype, resolve_target_path
from executor_service.sample.logprobs import TokenLogprob
from executor_service.sample.sampling import SamplingSettings
from specdec.v1 import common_pb2, executor_pb2
from specdec_runtime.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    ResourceExhausted,
    SpecdecError,
    invalid_fields,
)

TORCH_DTYPES = {
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_FLOAT32: torch.float32,
}
DTYPE_ENUMS = {dtype: enum for enum, dtype in TORCH_DTYPES.items()}


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


def sampling_settings(params: executor_pb2.SamplingParams) -> SamplingSettings:
    """A request's SamplingParams as the engine's settings (unset optional fields: their defaults)."""
    return SamplingSettings(
        temperature=params.temperature,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        top_k=params.top_k,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        seed=params.seed if params.HasField("seed") else None,
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        logit_bias=tuple((entry.token_id, entry.bias) for entry in params.logit_bias),
    )


def logprobs_message(found: TokenLogprob) -> executor_pb2.TokenLogprob:
    top = [executor_pb2.TopLogprob(token_id=token, logprob=value) for token, value in found.top]
    return executor_pb2.TokenLogprob(token_id=found.token_id, logprob=found.logprob, top_logprobs=top)


# Each kind of engine error and its status; the first that matches (subclasses before their bases).
_STATUS: tuple[tuple[type[EngineError], type[SpecdecError]], ...] = (
    (OutOfKVCache, ResourceExhausted),
    (EngineUnavailable, Unavailable),
    (InvalidField, InvalidArgument),
    (UnmetPrecondition, FailedPrecondition),
)


def status_error(err: EngineError | SpecdecError) -> SpecdecError:
    """The status error the server answers `err` with: a SpecdecError as it is; an engine error as its kind's
    status (INTERNAL for a kind with none), its field (if any) as the one field violation."""
    if isinstance(err, SpecdecError):
        return err
    kind = next((status for engine, status in _STATUS if isinstance(err, engine)), SpecdecError)
    violations = tuple(field_violations(err.problems))
    if isinstance(err, RequestFieldError) and err.summarized:  # the summary of the clipped violations
        return kind(invalid_fields(list(violations)).message, field_violations=violations)
    return kind(err.message, field_violations=violations)


def field_violations(problems: Iterable[FieldProblem]) -> list[FieldViolation]:
    """The engine's field problems as a status's field violations."""
    return [FieldViolation(p.field, p.description) for p in problems]


def synthetic_config(spec: executor_pb2.SyntheticModel, field_prefix: str, default_vocab_size: int = 0) -> ModelConfig:
    """A SyntheticModel request's model shape (a vocab_size of 0 takes `default_vocab_size`: a drafter's, the
    target's); InvalidField naming each bad field under `field_prefix`."""
    return ModelConfig.synthetic(
        architecture=spec.architecture,
        vocab_size=spec.vocab_size or default_vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        field_prefix=field_prefix,
    )


def resolve_target(source: executor_pb2.ModelSource, model_root: Path | None, field: str) -> TargetSource:
    """A request's ModelSource as the target to load: its config (config.json is read; weights are not yet)."""
    if source.WhichOneof("source") == "synthetic":
        return TargetSource(synthetic_config(source.synthetic, f"{field}.synthetic"), None, source.synthetic.seed)
    return resolve_target_path(source.path, model_root, f"{field}.path")


def resolve_dtype(requested: int, device: torch.device) -> torch.dtype:
    """A request's DType as the weights' dtype (unspecified: model_loading.default_dtype)."""
    if requested == common_pb2.DTYPE_UNSPECIFIED:
        return default_dtype(device)
    return TORCH_DTYPES[requested]
