"""The control ring (parallel/channel.py) on its own: messages arrive whole and in order across many laps of the
ring, rank 0 waits (through its callback, which may raise) while a follower lags a whole ring behind, and a
follower's wait ends when its idle callback raises (rank 0 gone)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from executor_service.parallel.channel import MAX_VALUES, SLOTS, ControlRing

BOUND_S = 30.0  # no-hang bound


class Stalled(Exception):
    pass


def test_messages_arrive_in_order_over_many_laps() -> None:
    driver = ControlRing.create(3)
    try:
        readers = [ControlRing.attach(driver.path, rank, 3) for rank in (1, 2)]
    finally:
        driver.unlink()
    count = 5 * SLOTS
    received: dict[int, list[list[int]]] = {1: [], 2: []}

    def read(ring: ControlRing) -> None:
        for _ in range(count):
            received[ring.rank].append(ring.receive(lambda waited: None, 0.0))

    threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in readers]
    for thread in threads:
        thread.start()
    sent = [[n, *range(n % 7)] for n in range(count)]
    for message in sent:
        driver.send(message, lambda: None)
    for thread in threads:
        thread.join(BOUND_S)
        assert not thread.is_alive()
    assert received[1] == sent and received[2] == sent


def test_rank_0_waits_on_a_follower_a_whole_ring_behind() -> None:
    driver = ControlRing.create(2)
    follower = ControlRing.attach(driver.path, 1, 2)
    driver.unlink()
    for n in range(SLOTS):  # the follower has read none: the ring is full after these
        driver.send([n], lambda: None)

    def stalled() -> None:
        raise Stalled

    with pytest.raises(Stalled):
        driver.send([SLOTS], stalled)
    assert follower.receive(lambda waited: None, 0.0) == [0]
    driver.send([SLOTS], stalled)  # one slot free again: no wait
    assert [follower.receive(lambda waited: None, 0.0)[0] for _ in range(SLOTS)] == list(range(1, SLOTS + 1))


def test_a_follower_stops_waiting_when_told_to() -> None:
    driver = ControlRing.create(2)
    follower = ControlRing.attach(driver.path, 1, 2)
    driver.unlink()

    def gone(waited: float) -> None:
        if waited > 0.05:
            raise Stalled

    with pytest.raises(Stalled):
        follower.receive(gone, 0.01)


def test_bad_messages_and_rings_are_refused(tmp_path: Path) -> None:
    driver = ControlRing.create(2)
    driver.unlink()
    with pytest.raises(ValueError, match="at most"):
        driver.send([0] * (MAX_VALUES + 1), lambda: None)
    stray = tmp_path / "stray"
    stray.write_bytes(b"\0" * (1 << 20))
    with pytest.raises((ValueError, OSError)):
        ControlRing.attach(stray, 1, 2)
    with pytest.raises(ValueError, match="ranks"):
        ControlRing.create(0)


def test_heartbeats() -> None:
    driver = ControlRing.create(2)
    follower = ControlRing.attach(driver.path, 1, 2)
    driver.unlink()
    assert driver.heartbeat_age(1) == 0.0  # not started yet: not late
    follower.beat()
    assert 0.0 <= driver.heartbeat_age(1) < BOUND_S
