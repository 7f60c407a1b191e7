"""The drafter's context pass deferred while no step drafts (adaptive speculation's k = 0).

Drafting can resume at any step only if the drafter's cache holds every verified position: EAGLE's layer attends
to its own K/V of the whole sequence, DFlash's block pass to the context K/V made of the target's features. Running
the context pass on every k = 0 step keeps it so, but each such pass (one row per request: the drafter's weights
read, its kernels launched) is all that k = 0 adds to target-only decoding, and on an H100 at batch 64 it left
adaptive speculation at 0.955x (EAGLE-3) and 0.84x (DFlash) of target-only with a drafter never right (issue 31).

So on a k = 0 step the drafter does not run: each drafting request's verified feature rows are copied out of the
step's features (a graph replay's live in static buffers that the next step overwrites) into a buffer here. The
rest of what the pass reads is the request's own: the held rows are consecutive positions that end at its
computed tokens, each paired with the token after it. A flush runs every held row, with the step's own rows, as
one context pass batched across requests (the multi-row pass a prefill chunk takes, `Proposer.propose`):

- at a switch to drafting (k != 0): per request its held rows and the step's verified rows form one context
  pass, which drafts from the newest row as it would have;
- at k = 0, when a request's rows would pass DEFER_MAX (a long prefill chunk at once) or the buffer is full:
  every held row runs, so later flushes of all requests fall on one step (one pass, the weights read once for
  them all).

The buffer is a log: each k = 0 step's verified rows are appended in the step's order after the last step's, and
a request remembers where its rows went. A decode step's verified rows are its first rows, one per request in
batch order, so its whole share is one device copy of a contiguous block, with no index built on the host or sent
to the device (adaptive speculation's k = 0 must cost what a target-only step costs: issue 31); other steps (a
prefill chunk, the accepted path of a verify step) gather their rows with one indexed copy. The rows of a request
dropped before the flush stay in the log until then.

A row's K/V depends only on its own features and token, and a row's outputs on the K/V before it, so after a
flush the drafter's cache is what per-step passes would have written (up to the rounding of a batched pass) and
the next drafts are the same. A chain's rejected rows are not kept: their K/V lies past the verified tokens and is
overwritten before anything reads it. Whatever else reads the drafter's cache waits for the flush: the prefix cache
registers blocks only up to a request's first held row (`written`), and the device step takes no request with
held rows (none has: its drafts came from a flush).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from executor_service.engine.request import Request
from executor_service.models.attention_step import to_device
from executor_service.spec_decode.proposer import ProposeBatch, ProposeEntry

# Rows held per request before they run. A flush reads the drafter's weights once for up to this many rows per
# request, so a k = 0 step pays about 1/16 of a one-row pass; memory is DEFER_MAX x the feature width x
# max_num_seqs (EAGLE-3 over Llama-3-8B in bf16: 16 x 12288 x 2 B = 384 KiB a request, 96 MiB at 256; DFlash's
# 5 target layers: 160 MiB), and the switch to drafting runs at most 16 rows per request at once.
DEFER_MAX = 16


@dataclass(slots=True)
class Held:
    """One request's held rows: positions start, start + 1, ... at buffer rows `at` (in that order)."""

    request: Request
    start: int
    at: list[int]

    @property
    def rows(self) -> int:
        return len(self.at)

    @property
    def end(self) -> int:
        return self.start + len(self.at)


class DeferredContext:
    """Every drafting request's held rows, and the flush that runs them; one per engine, on its thread."""

    def __init__(self, max_num_seqs: int, limit: int = DEFER_MAX) -> None:
        self.limit = limit
        self.capacity = max_num_seqs * limit  # buffer rows: every running request's DEFER_MAX
        self.held: dict[str, Held] = {}
        self.filled = 0  # buffer rows written since the last flush (a dropped request's among them)
        self.most = 0  # the most rows a held request holds (`stage` checks the limit without a look per request)
        self._buffer: torch.Tensor | None = None  # [capacity, F], at the first k = 0 step
        self.steps = 0  # k = 0 steps whose rows were held since the last flush (adaptive speculation's price)
        self.counts: Counter[str] = Counter()  # "deferred steps", "flushes at k = 0", "flushes to draft"

    @property
    def rows(self) -> int:
        return sum(len(held.at) for held in self.held.values())

    def holds_any(self, requests: list[Request]) -> bool:
        return bool(self.held) and any(r.request_id in self.held for r in requests)

    def written(self, request: Request) -> int:
        """Positions whose drafter K/V is written: up to the first held row, else every computed token."""
        held = self.held.get(request.request_id)
        return held.start if held is not None else request.num_computed_tokens

    def drop(self, request: Request) -> None:
        """Forget a request's held rows: it finished, or was preempted (its tokens are computed again). Its rows
        stay in the log until the next flush, unless nothing else is held."""
        dropped = self.held.pop(request.request_id, None)
        if dropped is None:
            return
        if not self.held:
            self.filled, self.most = 0, 0
        elif len(dropped.at) == self.most:
            self.most = max(len(held.at) for held in self.held.values())

    @torch.inference_mode()
    def defer(self, entries: list[ProposeEntry], features: torch.Tensor) -> bool:
        """Hold the entries' verified rows of a k = 0 step instead of running them: one copy into the log. False,
        holding nothing, where a request's rows would pass the limit or the log is full: the caller flushes now."""
        if not entries:
            return True
        found = self._found(entries)
        sources = [row for entry in entries for row in entry.verified_rows]
        start = self.filled
        if found is None or start + len(sources) > self.capacity:
            return False
        if sources:
            self._append(features, sources, start)
        self.filled = start + len(sources)
        self._commit(entries, found, start, staged=False)
        return True

    @torch.inference_mode()
    def stage(self, requests: list[Request], features: torch.Tensor) -> int | None:
        """A decode step's feature rows (its first rows, one per request in order) copied into the log now, before
        a step launched after it overwrites them (a graph's static buffers; overlap_decode.py), and held by `hold`
        once the step is booked; the log row where they start. None, copying nothing, where a request's rows would
        pass the limit or the log is full: the step is then booked as a host step is (deferred or flushed from
        its own features), so nothing may be launched after it first."""
        count = len(requests)
        if self.filled + count > self.capacity or self.most >= self.limit:  # each request's rows grow by one
            return None
        start = self.filled
        self._buffer_like(features)[start : start + count].copy_(features[:count])
        self.filled += count
        return start

    def hold(self, entries: list[ProposeEntry], start: int) -> None:
        """Hold a booked decode step's entries (one row each: row r was staged at log row start + r)."""
        found = self._found(entries)
        assert found is not None, "staging checked the limit"
        self._commit(entries, found, start, staged=True)

    def _found(self, entries: list[ProposeEntry]) -> list[Held | None] | None:
        """Each entry's held rows (None: none yet), checked to end where its rows start; None where a request's rows
        would pass the limit. Checked before anything is held (a decode step's: one row each)."""
        held, limit, most = self.held, self.limit, self.most
        found: list[Held | None] = []
        for entry in entries:
            mine = held.get(entry.request.request_id)
            total = len(entry.verified_rows) + (len(mine.at) if mine is not None else 0)
            if mine is not None and mine.start + total != entry.request.num_computed_tokens:
                _follows(mine, entry.first_position)
            if total > limit:
                return None
            if total > most:
                most = total
            found.append(mine)
        self.most = most  # what the entries will hold once committed (they are, right after)
        return found

    def _commit(self, entries: list[ProposeEntry], found: list[Held | None], start: int, staged: bool) -> None:
        """Hold each entry's rows, in the log from `start` on: one after the other (`defer`), or `staged`, a decode
        step's row r at start + r."""
        held, offset = self.held, start
        for entry, mine in zip(entries, found, strict=True):
            taken = len(entry.verified_rows)
            first = start + entry.verified_rows[0] if staged else offset
            offset += taken
            if mine is None:
                position = entry.request.num_computed_tokens - taken
                held[entry.request.request_id] = Held(entry.request, position, [*range(first, first + taken)])
            elif taken == 1:  # a decode step's
                mine.at.append(first)
            else:
                mine.at += range(first, first + taken)
        self.steps += 1
        self.counts["deferred steps"] += 1

    def _append(self, features: torch.Tensor, sources: list[int], start: int) -> None:
        """Rows `sources` of the step's features to buffer rows start, start + 1, ...: one copy, without an index
        when they are the step's first rows in order (a decode step's)."""
        count = len(sources)
        into = self._buffer_like(features)[start : start + count]
        if sources[-1] == count - 1 and sources == list(range(count)):
            into.copy_(features[:count])
        else:
            torch.index_select(features, 0, to_device(sources, torch.int64, features.device), out=into)

    @torch.inference_mode()
    def flush(self, batch: ProposeBatch, at_zero: bool) -> ProposeBatch:
        """The batch that runs every held row with `batch`'s rows, one entry per request: its held rows, then its
        verified rows of this step (a request without held rows keeps its rows as they are); held requests not
        in the step store their context alone. Empties the store."""
        in_step = {e.request.request_id for e in batch.entries}
        for entry in batch.entries:
            if entry.request.request_id in self.held:
                _follows(self.held[entry.request.request_id], entry.first_position)
        for rid, held in self.held.items():
            if rid not in in_step:
                _follows(held, held.request.num_computed_tokens)
        merge = _Merge(batch.features, self._buffer)
        for entry in batch.entries:
            merge.add(entry, self.held.pop(entry.request.request_id, None))
        for held in self.held.values():  # not in this step: their rows alone, no drafts
            merge.add_held(held)
        self.held.clear()
        self.filled, self.most = 0, 0
        self.steps = 0
        self.counts["flushes at k = 0" if at_zero else "flushes to draft"] += 1
        return ProposeBatch(merge.entries, merge.features(), batch.reserve)

    def _buffer_like(self, features: torch.Tensor) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = features.new_empty((self.capacity, features.shape[1]))
        return self._buffer


class _Merge:
    """A flush's batch as it is laid out: per request its rows at offset, offset + 1, ..., gathered from the
    step's features and the held buffer by one copy each."""

    def __init__(self, features: torch.Tensor, buffer: torch.Tensor | None) -> None:
        self.step_features, self.buffer = features, buffer
        self.entries: list[ProposeEntry] = []
        self.from_step: tuple[list[int], list[int]] = ([], [])  # (step rows, merged rows)
        self.from_held: tuple[list[int], list[int]] = ([], [])  # (buffer rows, merged rows)
        self.offset = 0

    def add(self, entry: ProposeEntry, held: Held | None) -> None:
        """A request of the step: its held rows and verified rows as one entry, or its rows as they were."""
        if held is None:
            rows = list(range(entry.row_start, entry.row_start + entry.num_rows))
            verified = [self.offset + r - entry.row_start for r in entry.verified_rows]
            before = 0
        else:
            before = self._take(held)
            rows = entry.verified_rows
            verified = list(range(self.offset, self.offset + before + len(rows)))
        start = self.offset + before
        self.from_step[0].extend(rows)
        self.from_step[1].extend(range(start, start + len(rows)))
        self.entries.append(ProposeEntry(entry.request, self.offset, before + len(rows), verified, entry.propose))
        self.offset += before + len(rows)

    def add_held(self, held: Held) -> None:
        count = self._take(held)
        self.entries.append(
            ProposeEntry(held.request, self.offset, count, list(range(self.offset, self.offset + count)), False)
        )
        self.offset += count

    def _take(self, held: Held) -> int:
        self.from_held[0].extend(held.at)
        self.from_held[1].extend(range(self.offset, self.offset + len(held.at)))
        return len(held.at)

    def features(self) -> torch.Tensor:
        """[rows, F]: one copy from the step's features, one from the buffer."""
        step = self.step_features
        merged = step.new_empty((self.offset, step.shape[1]))
        for (sources, targets), source in ((self.from_step, step), (self.from_held, self.buffer)):
            if sources:
                assert source is not None
                index = to_device(sources, torch.int64, step.device)
                merged.index_copy_(0, to_device(targets, torch.int64, step.device), source.index_select(0, index))
        return merged


def _follows(held: Held, position: int) -> None:
    """The rows a request brings next must start where its held rows end (else they are another life's)."""
    if held.end != position:
        raise RuntimeError(
            f"request {held.request.request_id[:64]!r}: held drafter context ends at position {held.end}, "
            f"its next rows start at {position}"
        )
