"""Responses written by the target itself, through our engine (continuous batching, CUDA graphs on GPUs) or,
for bulk runs, dense_generate.py (fixed batches over a dense cache, several times the engine's pace there).

The drafter must predict the target, so the target writes the training text: each prompt gets one
response, greedy or sampled (temperatures taken in turn; through the engine a sampled request has its own
seed, so a response does not depend on what else was batched with it). Sequences are appended to a JSONL file a
chunk at a time: an interrupted run picks up where it stopped. Token ids are stored compactly: base64 of
little-endian uint16 when the vocabulary fits (int32 otherwise), a third of the size of JSON lists.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from executor_service.engine.engine import StepObserver
from executor_service.engine.request import RequestOutput
from executor_service.models.loader import LoadedModel
from executor_service.sample.sampling import SamplingSettings
from specdec_training.dense_generate import generate_dense
from specdec_training.features import Sequence
from specdec_training.generation_engine import EngineSizes, TargetEngine, build_target_engine
from specdec_training.progress import Progress


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 0.7)  # prompt i is answered at temperatures[i % len]
    seed: int = 0
    chunk: int = 1024  # prompts per engine run and per append to the file
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_kv_blocks: int = 0  # 0: LoadModel's default (GPU: gpu_memory_utilization; CPU: 16k tokens)
    gpu_memory_utilization: float = 0.4  # leaves the rest for training, which follows in the same process
    dense_batch: int = 0  # > 0: dense_generate.py in batches of this many (bulk text, no engine); 0: the engine
    progress: bool = True
    deadline: float | None = None  # time.time() after which no new chunk starts (what is done is kept)


@dataclass(frozen=True)
class PromptIds:
    kind: str
    ids: list[int]


def random_prompts(vocab_size: int, count: int, seed: int, lengths: tuple[int, int] = (4, 48)) -> list[PromptIds]:
    """Random token ids: prompts for targets without a tokenizer (synthetic smoke runs and tests)."""
    rng = random.Random(seed)
    return [
        PromptIds("random", [rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))]) for _ in range(count)
    ]


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stored id type: uint16 below 65536 ids, else int32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def pack_ids(ids: list[int], dtype: np.dtype) -> str:
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(dtype).max):
        raise ValueError(f"token id out of range for {dtype.name}: {int(array.min())}..{int(array.max())}")
    return base64.b64encode(array.astype(dtype).tobytes()).decode()


def unpack_ids(packed: str, dtype: str) -> list[int]:
    return np.frombuffer(base64.b64decode(packed), dtype=np.dtype(dtype)).tolist()


def sequence_row(index: int, kind: str, prompt: list[int], response: list[int], vocab_size: int) -> dict:
    dtype = token_dtype(vocab_size)
    return {"index": index, "kind": kind, "dtype": dtype.str, "prompt": pack_ids(prompt, dtype),
            "response": pack_ids(response, dtype)}  # fmt: skip


def read_sequences(path: Path) -> list[Sequence]:
    """Rows as `generate` writes them; rows with plain id lists (older files) read too."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sequences = []
    for row in rows:
        ids = [unpack_ids(row[k], row["dtype"]) if "dtype" in row else row[k] for k in ("prompt", "response")]
        sequences.append(Sequence(ids[0], ids[1], row["kind"]))
    return sequences


def generate(
    loaded: LoadedModel, prompts: list[PromptIds], settings: GenerationSettings, device: torch.device, path: Path
) -> list[Sequence]:
    """One response per prompt, in prompt order; those already in `path` are kept (ValueError if `path`
    holds responses to other prompts). Past `settings.deadline`, only the prompts answered so far."""
    longest = loaded.config.max_position_embeddings - 1
    too_long = [i for i, p in enumerate(prompts) if not 0 < len(p.ids) <= longest]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts are empty or longer than {longest} tokens, e.g. #{too_long[0]}")
    done = read_sequences(path)
    for index, sequence in enumerate(done[: len(prompts)]):
        if sequence.prompt != prompts[index].ids:
            raise ValueError(f"{path} holds responses to other prompts (row {index}); remove it or pick another --out")
    if len(done) >= len(prompts) or past(settings.deadline):
        return done[: len(prompts)]
    total = sum(min(settings.max_new_tokens, loaded.config.max_position_embeddings - len(p.ids)) for p in prompts)
    bar = Progress(total, "generating", "tok", enabled=settings.progress)
    bar.update(sum(len(s.response) for s in done))
    engine = None
    if not settings.dense_batch:
        engine = _engine(loaded, settings, device, lambda _computed, generated, _seconds: bar.update(generated))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as file:
            for start in range(len(done), len(prompts), settings.chunk):
                if past(settings.deadline):
                    break
                chunk = list(enumerate(prompts[start : start + settings.chunk], start=start))
                if engine is None:
                    responses = _run_dense(loaded, chunk, settings)
                    bar.update(sum(len(r) for r in responses))
                else:
                    responses = _run(engine, chunk, settings)
                for (index, prompt), response in zip(chunk, responses, strict=True):
                    row = sequence_row(index, prompt.kind, prompt.ids, response, loaded.config.vocab_size)
                    file.write(json.dumps(row))
                    file.write("\n")
                    done.append(Sequence(prompt.ids, response, prompt.kind))
                file.flush()
    finally:
        bar.close()
        if engine is not None:
            engine.shutdown()
        del engine  # its KV cache and CUDA graphs: given back before training allocates
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return done


def past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def _engine(
    loaded: LoadedModel, settings: GenerationSettings, device: torch.device, on_step: StepObserver
) -> TargetEngine:
    sizes = EngineSizes(
        settings.max_num_batched_tokens, settings.max_num_seqs, settings.num_kv_blocks, settings.gpu_memory_utilization
    )
    ids_only = dataclasses.replace(loaded, tokenizer=None)  # no detokenizing of every generated token
    return build_target_engine(ids_only, sizes, device, on_step)


def _run_dense(
    loaded: LoadedModel, chunk: list[tuple[int, PromptIds]], settings: GenerationSettings
) -> list[list[int]]:
    """The chunk through dense_generate: prompt i at temperatures[i % len], its sampled draws seeded by the
    chunk's first index (a resumed run writes the same chunks)."""
    room = loaded.config.max_position_embeddings
    temperatures = [settings.temperatures[index % len(settings.temperatures)] for index, _ in chunk]
    budgets = [min(settings.max_new_tokens, room - len(prompt.ids)) for _, prompt in chunk]
    seed = settings.seed * 1_000_003 + chunk[0][0]
    stops = set(loaded.config.eos_token_ids)
    prompts = [prompt.ids for _, prompt in chunk]
    return generate_dense(loaded.model, prompts, temperatures, budgets, stops, seed, settings.dense_batch)


def _run(target: TargetEngine, chunk: list[tuple[int, PromptIds]], settings: GenerationSettings) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def sink(output: RequestOutput) -> None:
        outputs.setdefault(output.request_id, []).extend(output.token_ids)
        if output.error is not None:
            errors.append(output.error)

    max_len = target.max_model_len
    for index, prompt in chunk:
        temperature = settings.temperatures[index % len(settings.temperatures)]
        sampling = SamplingSettings(temperature=temperature, seed=settings.seed + index if temperature > 0 else None)
        max_tokens = min(settings.max_new_tokens, max_len - len(prompt.ids))
        target.engine.add(target.new_request(str(index), prompt.ids, sampling, max_tokens, sink))
    target.engine.run_until_idle()
    if errors:
        raise errors[0]
    return [outputs.get(str(index), []) for index, _ in chunk]
