"""tpus.remote against real sshd hosts of the test fleet."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from tpus.remote import (
    HostKeyMismatch,
    HostKeyPins,
    RemoteError,
    Script,
    Sessions,
    Worker,
    run_on_workers,
    run_script,
    site_login,
)

pytestmark = pytest.mark.fleet
TEST_SCRIPTS = Path(__file__).with_name("remote_scripts")


def worker_for(fleet, host, **changes) -> Worker:
    fields = {"address": host.ip, "pins": HostKeyPins.parse(fleet.host_keys(host.name)),
              "name": host.name, "login": site_login()} | changes  # fmt: skip
    return Worker(**fields)


def logins(fleet, host) -> int:
    return fleet.log(host.name).count("Accepted publickey for")


def connections(fleet, host) -> int:
    return fleet.log(host.name).count("Connection from ")


def test_whoami_runs_as_root_on_the_host_it_was_sent_to(fleet, fleet_settings, fleet_host):
    result = run_script(worker_for(fleet, fleet_host), "whoami.sh")
    assert result.values["hostname"] == fleet_host.hostname
    assert result.values["uid"] == "0"
    assert result.values["boot_id"] == fleet_host.boot_id
    assert result.values["stdin_bytes"] == "0"


HOSTILE = (
    b"$(touch /tmp/pwned-subst)\n`touch /tmp/pwned-backtick`\n"
    b"'; touch /tmp/pwned-quote; '\n\"; touch /tmp/pwned-dquote; \"\n"
    b"milo; rm -rf / --no-preserve-root\n--help\n-rf\n\\\n\x00\x01\x1b[31m\r\n\xff\xfe"
    b"0000000099not a header\n"
)


def test_data_on_stdin_arrives_byte_for_byte_and_is_never_run(fleet, fleet_settings, fleet_host):
    result = run_script(worker_for(fleet, fleet_host), "whoami.sh", HOSTILE)
    assert result.values["stdin_bytes"] == str(len(HOSTILE))
    assert result.values["stdin_sha256"] == hashlib.sha256(HOSTILE).hexdigest()
    found = fleet.exec(fleet_host.name, ["sh", "-c", "ls /tmp /root /; true"]).stdout
    assert b"pwned" not in found
    assert fleet.exec(fleet_host.name, ["test", "-d", "/usr/bin"], check=False).returncode == 0


def test_parallel_run_over_eight_hosts_uses_one_connection_each(fleet, fleet_settings, fleet_hosts):
    hosts = fleet_hosts(8)
    before = {h.name: logins(fleet, h) for h in hosts}
    outcomes = run_on_workers([worker_for(fleet, h) for h in hosts], "whoami.sh", b"same")
    assert [o.ok for o in outcomes] == [True] * 8
    assert [o.result.values["hostname"] for o in outcomes] == [h.hostname for h in hosts]
    assert {h.name: logins(fleet, h) - before[h.name] for h in hosts} == {h.name: 1 for h in hosts}


def test_each_worker_can_get_its_own_data(fleet, fleet_settings, fleet_hosts):
    hosts = fleet_hosts(3)
    outcomes = run_on_workers(
        [worker_for(fleet, h) for h in hosts], "whoami.sh", lambda w: w.name * 2
    )
    assert [o.result.values["stdin_bytes"] for o in outcomes] == [
        str(2 * len(h.name)) for h in hosts
    ]


def test_a_changed_host_key_stops_the_run_before_anything_runs(fleet, fleet_settings, fleet_host):
    pinned = worker_for(fleet, fleet_host)
    fleet.rekey(fleet_host.name)  # the VM was recreated, or someone sits on its address
    before = logins(fleet, fleet_host), connections(fleet, fleet_host)

    [outcome] = run_on_workers([pinned], "whoami.sh", b"$(touch /tmp/ran)")

    assert isinstance(outcome.error, HostKeyMismatch)
    assert outcome.error.retryable is False
    assert outcome.error.presented in fleet.host_keys(fleet_host.name)
    assert logins(fleet, fleet_host) == before[0]  # never authenticated
    assert connections(fleet, fleet_host) == before[1] + 1  # and tried once, not again
    ls = fleet.exec(fleet_host.name, ["ls", "/tmp"]).stdout
    assert b"ran" not in ls


def _ed25519_line() -> str:
    key = ed25519.Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


def test_a_host_is_let_in_under_any_pinned_key_two_of_one_type_among_them(
    fleet, fleet_settings, fleet_host
):
    """A host pinned anew may have an old and a new key of one type pinned at once;
    whichever of them it presents lets it in, and only those."""
    real = next(k for k in fleet.host_keys(fleet_host.name) if k.startswith("ssh-ed25519 "))
    before = after = None
    while before is None or after is None:  # one sorts ahead of the host's key, one behind
        line = _ed25519_line()
        if line < real:
            before = line
        else:
            after = line
    others = [before, after]
    worker = worker_for(fleet, fleet_host, pins=HostKeyPins.parse([real, *others]))
    assert run_script(worker, "whoami.sh").values["hostname"] == fleet_host.hostname

    stranger = worker_for(fleet, fleet_host, pins=HostKeyPins.parse(others))
    with pytest.raises(HostKeyMismatch):
        run_script(stranger, "whoami.sh")


def test_another_hosts_pin_is_refused_before_authentication(fleet, fleet_settings, fleet_hosts):
    target, impostor = fleet_hosts(2)
    before = fleet.log(target.name)
    wrong = worker_for(fleet, target, pins=HostKeyPins.parse(fleet.host_keys(impostor.name)))
    with pytest.raises(HostKeyMismatch) as caught:
        run_script(wrong, "whoami.sh")
    assert caught.value.kind == RemoteError.HOST_KEY
    new_log = fleet.log(target.name)[len(before) :]
    assert "Connection from " in new_log
    assert "publickey" not in new_log and "Accepted" not in new_log


def test_an_old_address_taken_over_by_another_host_is_refused(fleet, fleet_settings, fleet_hosts):
    moved, newcomer = fleet_hosts(2)
    stale = worker_for(fleet, moved)  # what the portal knew before the IP change
    fleet.move(moved.name)
    fleet.move(newcomer.name, stale.address)
    with pytest.raises(HostKeyMismatch):
        run_script(stale, "whoami.sh")


def test_a_worker_without_pinned_keys_is_never_contacted(fleet, fleet_settings, fleet_host):
    before = connections(fleet, fleet_host)
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host, pins=HostKeyPins()), "whoami.sh")
    assert caught.value.kind == RemoteError.NO_PIN and not caught.value.retryable
    time.sleep(0.2)
    assert connections(fleet, fleet_host) == before


def test_a_host_that_is_down_fails_retryably_within_the_connect_timeout(
    fleet, fleet_settings, fleet_host
):
    fleet_settings.PORTAL_REMOTE_CONNECT_TIMEOUT = 1.5
    fleet.down(fleet_host.name)
    started = time.monotonic()
    [outcome] = run_on_workers([worker_for(fleet, fleet_host)], "whoami.sh")
    assert time.monotonic() - started < 4
    assert outcome.error.retryable is True
    assert outcome.error.kind == RemoteError.TIMEOUT


def test_a_refused_connection_is_retryable(fleet, fleet_settings, fleet_host):
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host, port=2222), "whoami.sh")
    assert caught.value.kind == RemoteError.UNREACHABLE and caught.value.retryable


def test_a_failing_script_reports_its_reason_and_is_not_retryable(
    fleet, fleet_settings, fleet_host
):
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host), Script.from_path(TEST_SCRIPTS / "fails.sh"))
    error = caught.value
    assert error.kind == RemoteError.SCRIPT and not error.retryable
    assert error.exit_status == 3
    assert "no such disk: pd-missing" in str(error)


def test_a_script_that_runs_too_long_is_a_retryable_timeout(fleet, fleet_settings, fleet_host):
    fleet_settings.PORTAL_REMOTE_SCRIPT_TIMEOUT = 1
    started = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host), Script.from_path(TEST_SCRIPTS / "slow.sh"))
    assert caught.value.kind == RemoteError.TIMEOUT and caught.value.retryable
    assert time.monotonic() - started < 5


def test_a_reboot_in_the_middle_of_a_script_is_retryable(fleet, fleet_settings, fleet_host):
    rebooter = threading.Timer(1.0, fleet.reboot, args=[fleet_host.name])
    rebooter.start()
    try:
        with pytest.raises(RemoteError) as caught:
            run_script(worker_for(fleet, fleet_host), Script.from_path(TEST_SCRIPTS / "slow.sh"))
    finally:
        rebooter.join()
    assert caught.value.retryable
    assert caught.value.kind in {RemoteError.DISCONNECTED, RemoteError.TIMEOUT}


def test_lots_of_output_on_both_streams_does_not_stall(fleet, fleet_settings, fleet_host):
    script = Script.from_path(TEST_SCRIPTS / "chatty.sh")
    result = run_script(worker_for(fleet, fleet_host), script)
    assert result.values["done"] == "yes"
    assert len(result.stderr) == 3_000_000


def test_a_key_the_host_does_not_trust_is_an_auth_error(fleet, fleet_settings, fleet_host):
    stranger = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    fleet_settings.PORTAL_ADMIN_SSH_KEY_FILE = ""
    fleet_settings.PORTAL_ADMIN_SSH_KEY = stranger.decode()
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host), "whoami.sh")
    assert caught.value.kind == RemoteError.AUTH and not caught.value.retryable


def test_the_admin_key_can_be_given_as_text(fleet, fleet_settings, fleet_host):
    fleet_settings.PORTAL_ADMIN_SSH_KEY = fleet.admin_key_path.read_text()
    fleet_settings.PORTAL_ADMIN_SSH_KEY_FILE = ""
    assert run_script(worker_for(fleet, fleet_host), "whoami.sh").values["uid"] == "0"


def test_dry_run_contacts_nobody(fleet, fleet_settings, fleet_host):
    fleet_settings.PORTAL_REMOTE_DRY_RUN = True
    before = connections(fleet, fleet_host)
    result = run_script(worker_for(fleet, fleet_host), "whoami.sh")
    assert result.dry_run and result.values == {}
    time.sleep(0.2)
    assert connections(fleet, fleet_host) == before


def test_connections_send_small_packets_at_once(fleet, fleet_settings, fleet_host):
    from tpus.remote import config, ssh

    client = ssh._connect(worker_for(fleet, fleet_host), config.current())
    try:
        sock = client.get_transport().sock
        assert isinstance(sock, ssh._PromptSocket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        client.close()


def test_key_exchange_prefers_p256_and_falls_back_to_x25519(
    fleet, fleet_settings, fleet_host, caplog
):
    caplog.set_level(logging.DEBUG, logger="paramiko.transport")

    def kex_with(port: int) -> list[str]:
        caplog.clear()
        run_script(worker_for(fleet, fleet_host, port=port), "whoami.sh")
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Kex: ")]

    assert kex_with(22) == ["Kex: ecdh-sha2-nistp256"]
    # A second sshd on the same host that offers X25519 only, as some hardened hosts do.
    fleet.exec(fleet_host.name, ["/usr/sbin/sshd", "-p", "2222", "-o", "PidFile=/run/kex.pid",
                                 "-o", "KexAlgorithms=curve25519-sha256@libssh.org"])  # fmt: skip
    try:
        # sshd detaches before it binds its port: wait until it listens.
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((fleet_host.ip, 2222), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the second sshd never listened"
                time.sleep(0.02)
        assert kex_with(2222) == ["Kex: curve25519-sha256@libssh.org"]
    finally:
        fleet.exec(fleet_host.name, ["sh", "-c", 'kill "$(cat /run/kex.pid)"'])


def test_a_login_the_host_is_too_busy_to_answer_is_a_timeout_not_a_refusal(
    fleet, fleet_settings, fleet_host, monkeypatch
):
    # paramiko says "Authentication timeout." with the same exception as a refused key;
    # a host under load must be retried, not written off (its grants would fail).
    def busy(self, *args, **kwargs):
        raise paramiko.AuthenticationException("Authentication timeout.")

    monkeypatch.setattr(paramiko.SSHClient, "connect", busy)
    with pytest.raises(RemoteError) as caught:
        run_script(worker_for(fleet, fleet_host), "whoami.sh")
    assert caught.value.kind == RemoteError.TIMEOUT and caught.value.retryable


# --- two scripts in one exec ------------------------------------------------------------


def test_two_steps_run_in_one_exec_and_the_second_gets_its_own_data_on_go(
    fleet, fleet_settings, fleet_hosts
):
    hosts = fleet_hosts(3)
    before = {h.name: fleet.log(h.name).count("Starting session: command") for h in hosts}
    with Sessions([worker_for(fleet, h) for h in hosts]) as sessions:
        with sessions.begin("whoami.sh", lambda w: w.name, "whoami.sh") as held:
            first = held.first
            second = held.go(HOSTILE)
    assert [o.result.values["stdin_bytes"] for o in first] == [str(len(h.name)) for h in hosts]
    assert [o.result.values["stdin_sha256"] for o in second] == [
        hashlib.sha256(HOSTILE).hexdigest()
    ] * 3
    assert [o.result.values["hostname"] for o in second] == [h.hostname for h in hosts]
    sessions_used = {h.name: fleet.log(h.name).count("Starting session: command") - before[h.name]
                     for h in hosts}  # fmt: skip
    assert sessions_used == {h.name: 1 for h in hosts}
    assert b"pwned" not in fleet.exec(hosts[0].name, ["sh", "-c", "ls /tmp /root /"]).stdout


def test_leaving_without_the_word_runs_nothing_more_on_any_host(fleet, fleet_settings, fleet_hosts):
    hosts = fleet_hosts(2)
    marker = f"/tmp/second-{time.monotonic_ns()}"
    second = Script("touches.sh", f"set -eu\ntouch {marker}\necho touched=1\n".encode())
    with Sessions([worker_for(fleet, h) for h in hosts]) as sessions:
        with sessions.begin("whoami.sh", b"x", second) as held:
            assert all(o.ok for o in held.first)
        # The hosts were told nothing more; their exec has ended.
        again = sessions.run("whoami.sh", b"")
    assert all(o.ok for o in again)
    time.sleep(0.3)
    for host in hosts:
        assert fleet.exec(host.name, ["test", "-e", marker], check=False).returncode != 0


def test_a_first_step_that_fails_reports_it_and_leaves_nothing_waiting(
    fleet, fleet_settings, fleet_host
):
    failing = Script.from_path(TEST_SCRIPTS / "fails.sh")
    with Sessions([worker_for(fleet, fleet_host)]) as sessions:
        with sessions.begin(failing, b"", "whoami.sh") as held:
            [first] = held.first
            [second] = held.go(b"")
    assert first.error.kind == RemoteError.SCRIPT and not first.error.retryable
    assert second.error is first.error


def test_a_first_step_given_up_on_stops_waiting_for_the_slow_hosts_only(
    fleet, fleet_settings, fleet_hosts
):
    hosts = fleet_hosts(2)
    marker = f"/tmp/second-{time.monotonic_ns()}"
    # Host 0 answers at once, host 1 only after 8 s.
    slow = Script("slow.sh", b'set -eu\n[ "$(hostname)" != "' + hosts[1].hostname.encode()
                  + b'" ] || sleep 8\necho answered=1\n')  # fmt: skip
    second = Script("touches.sh", f"set -eu\ntouch {marker}\necho touched=1\n".encode())
    calls = []

    def give_up() -> bool:  # a cancel that comes 2 s in
        calls.append(time.monotonic())
        return calls[-1] - began > 2

    with Sessions([worker_for(fleet, h) for h in hosts]) as sessions:
        began = time.monotonic()
        with sessions.begin(slow, b"", second, give_up=give_up) as held:
            took = time.monotonic() - began
            fast, cut = held.first
        assert 2 < took < 5, took
        assert fast.ok and fast.result.values["answered"] == "1"
        assert cut.error is not None and cut.error.retryable
        # The cut connection is made anew by the next run on it.
        again = sessions.run("whoami.sh", b"")
    assert all(o.ok for o in again), [str(o.error) for o in again]
    time.sleep(0.3)
    for host in hosts:
        assert fleet.exec(host.name, ["test", "-e", marker], check=False).returncode != 0


def test_a_single_host_given_up_on_is_not_waited_for_either(fleet, fleet_settings, fleet_host):
    slow = Script("slow.sh", b"set -eu\nsleep 5\necho answered=1\n")
    with Sessions([worker_for(fleet, fleet_host)]) as sessions:
        began = time.monotonic()
        with sessions.begin(slow, b"", "whoami.sh", give_up=lambda: True) as held:
            took = time.monotonic() - began
            [cut] = held.first
        assert took < 3 and cut.error is not None and cut.error.retryable, took
        again = sessions.run("whoami.sh", b"")
    assert all(o.ok for o in again), [str(o.error) for o in again]


def test_a_connection_that_closed_before_the_exec_is_a_retryable_disconnect(
    fleet, fleet_settings, fleet_host
):
    # The host went away between the login and the exec (a node deleted under a job
    # pass): a RemoteError like any broken connection, not an error of the door itself.
    from tpus.remote import ssh
    from tpus.remote.scripts import load

    connection = ssh.Connection(worker_for(fleet, fleet_host))
    connection.run(load("whoami.sh"))
    connection.client.get_transport().close()
    with pytest.raises(RemoteError) as caught:
        ssh._Exec(connection.client, "true", 5, connection.worker)
    assert caught.value.kind == RemoteError.DISCONNECTED and caught.value.retryable
    connection.close()
