"""The threads a fan-out runs its workers on are kept between fan-outs."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from tpus.remote import threads


def _run(one, items, lanes):
    return [f.result(timeout=10) for f in threads.start_all(one, items, lanes)]


def test_a_second_fan_out_right_after_the_first_starts_no_thread():
    def one(together: threading.Barrier, x: int) -> int:
        together.wait(timeout=10)  # each of the 8 lanes has one item
        return x * 2

    _run(functools.partial(one, threading.Barrier(8)), range(8), 8)
    before = threads.crew.started
    assert _run(functools.partial(one, threading.Barrier(8)), range(8), 8) == [
        x * 2 for x in range(8)
    ]
    assert threads.crew.started == before


def test_answers_come_in_the_items_order_and_at_most_lanes_run_at_once():
    running, most, lock = 0, 0, threading.Lock()

    def one(x):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01 * (7 - x))  # later items end first
        with lock:
            running -= 1
        return x

    assert _run(one, list(range(8)), 3) == list(range(8))
    assert most == 3


def test_an_error_reaches_whoever_waits_for_that_item_and_the_others_still_run():
    def one(x):
        if x == 2:
            raise ValueError("worker 2 broke")
        return x

    futures = threads.start_all(one, range(5), 5)
    with pytest.raises(ValueError, match="worker 2 broke"):
        futures[2].result(timeout=10)
    assert [futures[i].result(timeout=10) for i in (0, 1, 3, 4)] == [0, 1, 3, 4]


def test_a_fan_out_inside_a_fan_out_never_waits_for_a_thread():
    def outer(x):
        return sum(_run(lambda y: y + x, range(4), 4))

    assert _run(outer, range(6), 6) == [6 + 4 * x for x in range(6)]


def test_an_idle_thread_ends_after_its_idle_time(monkeypatch):
    monkeypatch.setattr(threads, "IDLE_SECONDS", 0.05)
    crew = threads._Crew()
    ran_on = []
    crew.hand(lambda: ran_on.append(threading.current_thread()))
    deadline = time.monotonic() + 5
    while not ran_on:
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.01)
    while ran_on[0].is_alive():
        assert time.monotonic() < deadline, "the idle thread did not end"
        time.sleep(0.01)
    assert crew.idle == []
