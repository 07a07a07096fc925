"""The job scripts' stdin and stdout formats (tpus/remote/jobs.py), without a host."""

from __future__ import annotations

import base64

import pytest

from tpus.remote.jobs import (
    Pod,
    Preflight,
    StartJob,
    encode_cancel,
    encode_preflight,
    encode_start,
    encode_status,
    judge_versions,
    parse_preflight,
    parse_status,
)


def job(**changes) -> StartJob:
    fields = {"job_id": "j1", "user": "milo", "argv": ("python", "train.py")} | changes
    return StartJob(**fields)


def test_a_start_carries_free_text_only_as_base64():
    data = encode_start(job(argv=("sh", "-c", "rm -rf / ; $(x)"), env=(("A", "b c"),),
                            pod=Pod("10.0.0.2:8476", 4, 3)))  # fmt: skip
    lines = data.decode().splitlines()
    assert lines[0] == "tpu-portal-job-start 1" and lines[-1] == "end"
    assert "pod 10.0.0.2:8476 4 3" in lines
    assert f"env A {base64.b64encode(b'b c').decode()}" in lines
    assert "rm -rf" not in data.decode()


@pytest.mark.parametrize(
    "changes",
    [
        {"job_id": "J1"},
        {"user": "root!"},
        {"argv": ()},
        {"argv": ("A=b", "x")},
        {"argv": ("python", "a\nb")},
        {"env": (("TPU_VISIBLE_CHIPS", "0"),)},
        {"env": (("TPU_PORTAL_PROCESS_ID", "0"),)},
        {"env": (("LD_LIBRARY_PATH", "/x"),)},
        {"env": (("1X", "0"),)},
        {"cwd": "relative/dir"},
        {"pod": Pod("10.0.0.2:8476", 4, 4)},
        {"pod": Pod("10.0.0.2", 4, 0)},
    ],
)
def test_a_start_refuses_what_the_format_does_not_allow(changes):
    with pytest.raises(ValueError):
        encode_start(job(**changes))


def test_a_preflight_refuses_a_device_glob_outside_dev_and_forbidden_names():
    base = {"user": "milo", "chips": 4, "device_glob": "/dev/accel*", "min_disk_mb": 1,
            "min_mem_mb": 1}  # fmt: skip
    assert encode_preflight(Preflight(**base)).startswith(b"tpu-portal-job-preflight 1\n")
    for bad in ({"device_glob": "/etc/*"}, {"device_glob": "/dev/../etc"},
                {"env_names": ("JAX_PROCESS_ID",)}, {"chips": -1}):  # fmt: skip
        with pytest.raises(ValueError):
            encode_preflight(Preflight(**(base | bad)))


def test_status_and_cancel_inputs_are_checked():
    assert (
        encode_status({"j1": 10})
        == b"tpu-portal-job-status 1\nmax_bytes 65536\noffset j1 10\nend\n"
    )
    assert encode_cancel("j1", 10) == b"tpu-portal-job-cancel 1\njob j1\ngrace 10\nend\n"
    for call in (lambda: encode_status({"j1": -1}), lambda: encode_cancel("j1", 601),
                 lambda: encode_status({"a b": 0})):  # fmt: skip
        with pytest.raises(ValueError):
            call()


def test_a_status_answer_parses_into_jobs_with_their_log_bytes():
    pairs = [
        ("boot_id", "b1"), ("lock", "held j2"),
        ("job", "j1 ended pid=5 boot_id=b1 started_at=1.5 ended_at=2.5 exit=- signal=KILL "
                "cancel=1 process=gone log_size=9"),
        ("log", f"j1 4 {base64.b64encode(b'tail!').decode()}"),
        ("job", "j2 running pid=7 boot_id=b1 started_at=3 ended_at=- exit=- signal=- "
                "cancel=0 process=alive log_size=0"),
    ]  # fmt: skip
    report = parse_status(pairs)
    assert report.lock_holder == "j2"
    assert (report.jobs["j1"].signal, report.jobs["j1"].log, report.jobs["j1"].log_offset) == (
        "KILL", b"tail!", 4)  # fmt: skip
    assert report.jobs["j2"].process_alive and not report.jobs["j1"].succeeded
    with pytest.raises(ValueError):
        parse_status([("lock", "free"), ("job", "j3 exploded")])


def test_preflight_checks_parse_and_versions_are_judged_against_jaxs_pin():
    report = parse_preflight(["chips ok 4 of 4", "env fail not allowed: X",
                              "python ok python=3.11.2 jax=0.10.2 jaxlib=0.10.2 libtpu=0.0.41 "
                              "requests=none libtpu_pin=libtpu==0.0.42.*"])  # fmt: skip
    assert [c.name for c in report.failures] == ["env"]
    problems = judge_versions(report.versions, need_libtpu=True)
    assert any("0.0.41 does not fit" in p for p in problems)
    assert any("requests" in p for p in problems)
    assert judge_versions(report.versions, need_libtpu=False) == []
