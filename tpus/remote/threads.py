"""Threads kept between fan-outs, as connections are (``tpus.remote.kept``).

A fan-out over 32 workers used to start 32 threads, one after another, and
``Thread.start`` waits until each new thread has run: on a machine whose cores are
busy with the very runs being started, the last worker's run began a quarter of a
second after the first's. Here a fan-out hands each of its lanes to a thread that
is idle, and starts a thread only when none is; a thread idle for ``IDLE_SECONDS``
ends. A lane never waits for a thread, so fan-outs inside fan-outs cannot starve.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

IDLE_SECONDS = 60.0


class _Hand:
    """One kept thread: runs what it is handed, then waits for the next."""

    def __init__(self, crew: _Crew):
        self.crew = crew
        self.work: queue.SimpleQueue[Callable[[], Callable[[], None] | None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="remote", daemon=True)

    def _loop(self) -> None:
        from django.db import connections

        while True:
            try:
                job = self.work.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                if self.crew.retire(self):
                    return
                continue  # handed work just as it timed out: it is in the queue
            after = None
            try:
                after = job()
            finally:
                # A lane that read the database leaves no connection open in a thread
                # that may wait a minute for its next lane.
                connections.close_all()
            # Idle first, then the last answer: whoever waits for it and fans out
            # again at once finds this thread free.
            self.crew.rest(self)
            if after is not None:
                after()


class _Crew:
    def __init__(self):
        self.lock = threading.Lock()
        self.idle: list[_Hand] = []
        self.started = 0  # threads ever started in this process (tests read it)

    def hand(self, job: Callable[[], Callable[[], None] | None]) -> None:
        """Run ``job`` on an idle thread (a new one if none is); what ``job`` returns,
        if anything, is called once the thread is idle again."""
        with self.lock:
            hand = self.idle.pop() if self.idle else None
            if hand is None:
                self.started += 1
        if hand is None:
            hand = _Hand(self)
            hand.work.put(job)
            hand.thread.start()
        else:
            hand.work.put(job)

    def rest(self, hand: _Hand) -> None:
        with self.lock:
            self.idle.append(hand)

    def retire(self, hand: _Hand) -> bool:
        """Whether an idle ``hand`` may end: not when it was just handed work."""
        with self.lock:
            if hand in self.idle:
                self.idle.remove(hand)
                return True
            return False

    def forget(self) -> None:
        """In a forked child: the parent's threads do not exist here."""
        self.lock = threading.Lock()
        self.idle = []


crew = _Crew()
os.register_at_fork(after_in_child=crew.forget)


def start_all(one: Callable, items: Sequence, lanes: int) -> list[Future]:
    """``one(item)`` for every item, at most ``lanes`` at a time, on kept threads: a
    future per item, in the items' order. Each lane takes the next item not yet
    taken until none is left."""
    futures = [Future() for _ in items]
    taken = iter(range(len(items)))
    taking = threading.Lock()

    def lane() -> Callable[[], None] | None:
        answer = None
        while True:
            with taking:
                index = next(taken, None)
            if index is None:
                return answer  # given once this thread is idle again
            if answer is not None:
                answer()
            answer = _answer(futures[index], one, items[index])

    for _ in range(max(1, min(lanes, len(items)))):
        crew.hand(lane)
    return futures


def _answer(future: Future, one: Callable, item) -> Callable[[], None] | None:
    """Run ``one(item)`` for ``future``; what gives the future its answer."""
    if not future.set_running_or_notify_cancel():
        return None
    try:
        value = one(item)
    except BaseException as exc:  # handed to whoever waits on the future
        return functools.partial(future.set_exception, exc)
    return functools.partial(future.set_result, value)
