"""Where the wire meets the engine: protobuf messages into the engine's plain settings and back, and the
engine's errors into gRPC statuses, each conversion written once.

Only the server layer (servicer.py, validation.py, generate_stream.py, session.py, ...) imports this module; the
engine, sampling, speculative decoding and the model runner never see a proto or a status code (the layers:
tests/test_import_graph.py).
"""

from __future__ import annotations

import grpc

from executor_service.errors import EngineError, EngineUnavailable, OutOfKVCache
from executor_service.logprobs import TokenLogprob
from executor_service.sampling import SamplingSettings
from specdec.v1 import executor_pb2
from specdec_runtime.errors import FieldViolation, ResourceExhausted, SpecdecError


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
    )


def logprobs_message(found: TokenLogprob) -> executor_pb2.TokenLogprob:
    top = [executor_pb2.TopLogprob(token_id=token, logprob=value) for token, value in found.top]
    return executor_pb2.TokenLogprob(token_id=found.token_id, logprob=found.logprob, top_logprobs=top)


# Each kind of engine error and its status; the first that matches (subclasses before their bases).
_STATUS: tuple[tuple[type[EngineError], type[SpecdecError]], ...] = (
    (OutOfKVCache, ResourceExhausted),
    (EngineUnavailable, Unavailable),
)


def status_error(err: EngineError | SpecdecError) -> SpecdecError:
    """The status error the server answers `err` with: a SpecdecError as it is; an engine error as its kind's
    status (INTERNAL for a kind with none), its field (if any) as the one field violation."""
    if isinstance(err, SpecdecError):
        return err
    kind = next((status for engine, status in _STATUS if isinstance(err, engine)), SpecdecError)
    violations = (FieldViolation(err.field, err.description),) if err.field is not None else ()
    return kind(err.message, field_violations=violations)
