"""Connections kept open between runs (``tpus.remote.kept``), against real sshd hosts
of the test fleet: reused while alive and under the same address, login, pins and
generation; closed when idle too long; replaced when they died."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from tpus.remote import HostKeyPins, Login, RemoteError, Sessions, run_on_workers, run_script
from tpus.remote.kept import kept
from tpus.remote.scripts import load
from tpus.tests.test_remote_transport import logins, worker_for

pytestmark = pytest.mark.fleet


def _other_host_key() -> str:
    key = ed25519.Ed25519PrivateKey.generate().public_key()
    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return line.decode()


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.05)


def test_a_second_script_to_the_same_worker_reuses_the_connection(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    before, made = logins(fleet, fleet_host), kept.counts.made

    first = run_script(worker, "whoami.sh")
    second = run_script(worker, "whoami.sh", b"again")
    outcomes = run_on_workers([worker], "whoami.sh")

    assert first.values["hostname"] == second.values["hostname"] == fleet_host.hostname
    assert second.values["stdin_bytes"] == "5" and outcomes[0].ok
    assert kept.counts.made - made == 1
    _wait_for(lambda: logins(fleet, fleet_host) - before >= 1, 5, "sshd's log line")
    assert logins(fleet, fleet_host) - before == 1


def test_a_pass_over_a_pod_logs_in_once_per_worker_for_every_step(
    fleet, fleet_settings, fleet_hosts
):
    hosts = fleet_hosts(4)
    workers = [worker_for(fleet, h) for h in hosts]
    before = {h.name: logins(fleet, h) for h in hosts}
    for _ in range(3):  # three passes: a poll, a pre-flight and start, a poll
        with Sessions(workers) as sessions:
            with sessions.begin("whoami.sh", b"", "whoami.sh") as held:
                assert all(o.ok for o in held.first)
                assert all(o.ok for o in held.go(b""))
            assert all(o.ok for o in sessions.run("whoami.sh", b""))
    time.sleep(0.3)  # sshd writes its line after the client's last packet
    assert {h.name: logins(fleet, h) - before[h.name] for h in hosts} == {h.name: 1 for h in hosts}


def test_an_idle_connection_is_closed_after_the_keep_time(fleet, fleet_settings, fleet_host):
    fleet_settings.PORTAL_REMOTE_KEEP_SECONDS = 1
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    [key] = kept.idle()
    assert key.address == fleet_host.ip
    closed = kept.counts.closed_idle

    _wait_for(lambda: not kept.idle(), 10, "the idle connection to close")

    assert kept.counts.closed_idle == closed + 1
    before = logins(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    _wait_for(lambda: logins(fleet, fleet_host) > before, 5, "a new login")


def test_nothing_is_kept_with_a_keep_time_of_zero(fleet, fleet_settings, fleet_host):
    fleet_settings.PORTAL_REMOTE_KEEP_SECONDS = 0
    worker = worker_for(fleet, fleet_host)
    made = kept.counts.made
    run_script(worker, "whoami.sh")
    run_script(worker, "whoami.sh")
    assert kept.idle() == []
    assert kept.counts.made - made == 2


def test_other_pins_a_new_generation_or_another_login_never_reuse_a_connection(
    fleet, fleet_settings, fleet_host
):
    pins = fleet.host_keys(fleet_host.name)
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    made = kept.counts.made

    # The same host with one more key pinned (the host still presents a pinned one).
    repinned = worker_for(fleet, fleet_host, pins=HostKeyPins.parse([*pins, _other_host_key()]))
    run_script(repinned, "whoami.sh")
    assert kept.counts.made - made == 1
    # The one kept under the old pins was closed when the new one was made.
    assert [k.pins for k in kept.idle()] == [repinned.pins.keys]

    forgotten = worker_for(fleet, fleet_host, pins=repinned.pins, generation=1)
    run_script(forgotten, "whoami.sh")
    assert kept.counts.made - made == 2
    assert [k.generation for k in kept.idle()] == [1]

    # Another lab's key, which the host does not trust: refused, not let in on ours.
    stranger = Login(worker.login.user, _stranger_key())
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host, pins=repinned.pins, generation=1,
                              login=stranger), "whoami.sh")  # fmt: skip
    assert caught.value.kind == RemoteError.AUTH


def _stranger_key():
    from tpus.remote.config import private_key_from_text

    text = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    return private_key_from_text(text.decode())


def test_a_changed_host_key_is_refused_even_with_a_connection_kept_under_the_old_one(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    fleet.rekey(fleet_host.name)  # a new machine at the address: its sshd restarted
    new_pins = HostKeyPins.parse(fleet.host_keys(fleet_host.name))
    assert new_pins != worker.pins

    # The old pins: the kept connection died with the old sshd, and a new one meets
    # a key that is not pinned.
    with pytest.raises(RemoteError) as caught:
        run_script(worker, "whoami.sh")
    assert caught.value.kind == RemoteError.HOST_KEY


def test_a_connection_whose_host_rebooted_is_replaced_and_the_run_succeeds(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    made = kept.counts.made
    boot_id = fleet.reboot(fleet_host.name)  # every process of the host, sshd too

    result = run_script(worker, "whoami.sh")

    assert result.values["boot_id"] == boot_id
    assert kept.counts.made - made == 1


def test_a_kept_connection_that_died_unseen_is_replaced_before_the_script_gets_input(
    fleet, fleet_settings, fleet_host
):
    # The connection looks alive but its channel cannot open (the host's side was
    # torn down under it): the script runs once, on a new connection. (Each run in an
    # exec of its own here; a kept shell's: test_remote_kept_shell.)
    from tpus.remote import ssh

    fleet_settings.PORTAL_REMOTE_KEEP_SHELL = False
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    [key] = kept.idle()
    client = kept.take(key)
    transport = client.get_transport()
    transport.open_session = _refused  # what a half-dead transport answers
    kept.give_back(key, client, keep_seconds=60, dead_after=5)
    made = kept.counts.made

    with ssh.Connection(worker) as connection:
        result = connection.run(load("whoami.sh"), b"once")
        assert connection.reused is False

    assert result.values["stdin_bytes"] == "4"
    assert kept.counts.made - made == 1
    assert not transport.is_active()


def _refused(*args, **kwargs):
    import paramiko

    raise paramiko.SSHException("Unable to open channel.")


def test_a_host_that_hangs_under_a_kept_connection_fails_within_the_connect_timeout(
    fleet, fleet_settings, fleet_host
):
    fleet_settings.PORTAL_REMOTE_CONNECT_TIMEOUT = 2
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    assert kept.idle()
    fleet.down(fleet_host.name, hang=True)  # a dead VM: packets vanish, nothing answers

    started = time.monotonic()
    [outcome] = run_on_workers([worker], "whoami.sh")
    took = time.monotonic() - started

    assert outcome.error is not None and outcome.error.retryable
    assert outcome.error.kind == RemoteError.TIMEOUT
    assert took < 2 + 1.5, took  # the connect timeout, not the script's 60 s
    assert kept.idle() == []
    fleet.start(fleet_host.name)
    assert run_script(worker, "whoami.sh").values["hostname"] == fleet_host.hostname


def test_an_idle_connection_to_a_host_that_went_away_dies_by_itself(
    fleet, fleet_settings, fleet_host
):
    # Keepalives while idle, and the kernel gives up on them after the connect timeout.
    fleet_settings.PORTAL_REMOTE_CONNECT_TIMEOUT = 1
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    [key] = kept.idle()
    client = kept._idle[key].client
    fleet.down(fleet_host.name, hang=True)

    _wait_for(lambda: not client.get_transport().is_active(), 20, "the transport to end")

    fleet.start(fleet_host.name)
    assert run_script(worker, "whoami.sh").values["hostname"] == fleet_host.hostname


def test_a_check_of_the_login_never_uses_a_kept_connection(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    made = kept.counts.made
    [outcome] = run_on_workers([worker], "whoami.sh", keep=False)
    assert outcome.ok
    assert kept.counts.made - made == 1
    assert len(kept.idle()) == 1  # the kept one stays; the check's own was closed
