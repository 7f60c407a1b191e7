"""Rank 0's control messages to the followers on the same host: a ring of slots in shared memory.

Why: a gloo broadcast per op costs a TCP round trip on every rank and leaves a follower blocked in a socket
wait; a shared-memory ring (vLLM's MessageQueue for its workers does the same) costs a few microseconds. Rank 0
writes each message (a list of int64: the op and its sizes, and any host-side values) into the next slot and
then publishes its sequence number; each follower polls for it, reads, and marks it read. Rank 0 reuses a slot
only once every follower has read it (backpressure, bounded by the group's failure).

The same page carries each follower's heartbeat (written every HEARTBEAT_PERIOD_S by a thread of its own):
a follower frozen (SIGSTOP), deadlocked in the interpreter or killed stops beating, and rank 0's watchdog
(launcher.py) notices within SPECDEC_TP_HEARTBEAT_TIMEOUT_S.

Ordering: the data words are written before the slot's sequence word, and read after it. x86 keeps stores in
order; `_fence` (a lock's acquire and release: a full barrier) keeps them in order elsewhere.
"""

from __future__ import annotations

import array
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

MAGIC = 0x5350_4543_5450_0001  # "SPECTP", layout 1
MAX_RANKS = 64
SLOTS = 64
SLOT_WORDS = 1024  # a message's values, at most SLOT_WORDS - 2 (the slot's sequence and length come first)
MAX_VALUES = SLOT_WORDS - 2
_WRITTEN, _READ, _BEAT = 1, 8, 8 + MAX_RANKS  # word offsets: last sequence written, reads by rank, heartbeats
_SLOTS_AT = 256
SIZE = (_SLOTS_AT + SLOTS * SLOT_WORDS) * 8
HEARTBEAT_PERIOD_S = 0.25
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (pthread mutex acquire + release), as vLLM's shared-memory queue does."""
    _fence_lock.acquire()
    _fence_lock.release()


class ControlRing:
    """One mapping of the ring; `create` on rank 0, `attach` on each follower."""

    def __init__(self, path: Path, file_descriptor: int, rank: int, world_size: int) -> None:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"a control ring for {world_size} ranks (at most {MAX_RANKS})")
        self.path, self.rank, self.world_size = path, rank, world_size
        self._map = mmap.mmap(file_descriptor, SIZE)
        self.words = memoryview(self._map).cast("q")
        self.next = 1  # the sequence number of the next message to write (rank 0) or read (a follower)

    @classmethod
    def create(cls, world_size: int) -> ControlRing:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, name = tempfile.mkstemp(prefix="specdec-tp-", dir=directory)
        try:
            os.ftruncate(fd, SIZE)
            ring = cls(Path(name), fd, 0, world_size)
        finally:
            os.close(fd)
        ring.words[0] = MAGIC
        return ring

    @classmethod
    def attach(cls, path: Path, rank: int, world_size: int) -> ControlRing:
        fd = os.open(path, os.O_RDWR)
        try:
            ring = cls(path, fd, rank, world_size)
        finally:
            os.close(fd)
        if ring.words[0] != MAGIC:
            raise ValueError(f"{path} is not a specdec control ring")
        return ring

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid): rank 0 does so once every follower has attached."""
        Path(self.path).unlink(missing_ok=True)

    # Rank 0.

    def send(self, values: list[int], wait: Callable[[], None]) -> None:
        """Publish one message. `wait` is called while a slot is still unread by a follower (it raises when the
        group has failed, so a dead follower cannot stall rank 0 here)."""
        if len(values) > MAX_VALUES:
            raise ValueError(f"a control message of {len(values)} values (at most {MAX_VALUES})")
        seq, words = self.next, self.words
        while seq - SLOTS > min((words[_READ + r] for r in range(1, self.world_size)), default=seq):
            wait()
        at = _SLOTS_AT + (seq % SLOTS) * SLOT_WORDS
        words[at + 1] = len(values)
        words[at + 2 : at + 2 + len(values)] = array.array("q", values)
        _fence()
        words[at] = seq
        words[_WRITTEN] = seq
        self.next = seq + 1

    def heartbeat_age(self, rank: int) -> float:
        """Seconds since `rank` last beat (0 before its first beat: it is still starting)."""
        beat = self.words[_BEAT + rank]
        return 0.0 if beat == 0 else (time.monotonic_ns() - beat) / 1e9

    # A follower.

    def receive(self, idle: Callable[[float], None], spin_s: float) -> list[int]:
        """The next message. Polls for `spin_s`, then sleeps between polls (up to 1 ms); `idle(seconds waited)`
        is called between sleeps (it raises or exits when rank 0 is gone)."""
        seq, words = self.next, self.words
        at = _SLOTS_AT + (seq % SLOTS) * SLOT_WORDS
        started = time.monotonic()
        nap = 20e-6
        while words[at] != seq:
            waited = time.monotonic() - started
            if waited < spin_s:
                os.sched_yield()
                continue
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
            idle(waited)
        _fence()
        length = words[at + 1]
        if not 0 < length <= MAX_VALUES:
            raise ValueError(f"a control message of {length} values")
        values = words[at + 2 : at + 2 + length].tolist()
        words[_READ + self.rank] = seq
        self.next = seq + 1
        return values

    def beat(self) -> None:
        self.words[_BEAT + self.rank] = time.monotonic_ns()

    def start_heartbeat(self) -> threading.Thread:
        """A daemon thread that beats every HEARTBEAT_PERIOD_S while the process runs."""

        def run() -> None:
            while True:
                self.beat()
                time.sleep(HEARTBEAT_PERIOD_S)

        self.beat()
        thread = threading.Thread(target=run, name=f"specdec-tp-heartbeat-{self.rank}", daemon=True)
        thread.start()
        return thread
