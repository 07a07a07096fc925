"""A worker whose log ssh cannot show from here is followed from the portal: once the
portal has seen its log grow while ssh showed nothing for a while, the client prints
the new end of it at each poll, so a running job's output never goes quiet."""

from __future__ import annotations

from tpu_cli import follow


class Vm:
    api_path = "/labs/vision/vms/5"


class QuietTail:
    printed = False
    stopped = False

    def stop(self):
        self.stopped = True


def test_a_silent_ssh_tail_gives_way_to_the_portals_log(capsys, monkeypatch):
    run = follow.Follow(api=None, vm=Vm(), job_id=7, ssh=[], say=print)
    run.tailers = {0: QuietTail(), 1: QuietTail()}
    run.tails_began = 0.0  # long ago
    job = {"parts": [
        {"index": 0, "log_size": 6, "log_tail": "start\n"},
        {"index": 1, "log_size": 0, "log_tail": ""},
    ]}  # fmt: skip
    run._from_the_portal(job)
    assert capsys.readouterr().out == "(w0) start\n"
    assert run.tailers[0].stopped and not run.tailers[1].stopped

    job["parts"][0].update(log_size=12, log_tail="start\nstep1\n")
    run._from_the_portal(job)
    run._from_the_portal(job)  # nothing new: nothing printed twice
    assert capsys.readouterr().out == "(w0) step1\n"


def test_a_tail_that_shows_the_log_is_left_alone(capsys, monkeypatch):
    run = follow.Follow(api=None, vm=Vm(), job_id=7, ssh=[], say=print)
    tail = QuietTail()
    tail.printed = True
    run.tailers = {0: tail}
    run.tails_began = 0.0
    run._from_the_portal({"parts": [{"index": 0, "log_size": 6, "log_tail": "start\n"}]})
    assert capsys.readouterr().out == "" and not tail.stopped
