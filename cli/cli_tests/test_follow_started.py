"""``tpu run``/``tpu logs`` follow a job's log on its workers only once its command
began there: a job cancelled while its pre-flight ran shows ``cancelling`` without
anything started, and nothing is tailed then."""

from __future__ import annotations

from tpu_cli.follow import _started


def test_a_job_cancelled_during_its_pre_flight_has_nothing_to_follow():
    parts = [{"index": 0, "started_at": None}, {"index": 1, "started_at": None}]
    assert not _started({"state": "cancelling", "parts": parts})
    assert not _started({"state": "rejected", "parts": parts})


def test_a_started_job_is_followed_while_it_runs_and_is_being_cancelled():
    parts = [{"index": 0, "started_at": "2026-01-01T00:00:00Z"}]
    assert _started({"state": "running", "parts": []})
    assert _started({"state": "cancelling", "parts": parts})
