"""The root shell kept open on a kept connection (``tpus.remote.ssh``, the module's
docstring), against real sshd hosts of the test fleet: later runs of the connection
go to it instead of an exec with its own sudo each; its framing cannot be faked by a
script; nothing of one run reaches the next; a shell that broke is never used again."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from tpus.remote import Login, RemoteError, Script, Sessions, run_on_workers, run_script, ssh
from tpus.remote.kept import kept
from tpus.remote.scripts import load
from tpus.tests.test_remote_transport import HOSTILE, TEST_SCRIPTS, logins, worker_for

pytestmark = pytest.mark.fleet


def sessions_started(fleet, host) -> int:
    """Channels the host's sshd ran a command in (an exec, or a kept shell's start)."""
    return fleet.log(host.name).count("Starting session: command")


def _settled(fleet, host, count) -> int:
    """The count once sshd has written the lines of what already happened."""
    time.sleep(0.3)
    return count(fleet, host)


def test_runs_on_a_kept_connection_go_to_one_shell(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    before = sessions_started(fleet, fleet_host), logins(fleet, fleet_host)
    counts = kept.counts.shells, kept.counts.shell_runs

    results = [run_script(worker, "whoami.sh", HOSTILE) for _ in range(3)]
    outcomes = run_on_workers([worker], "whoami.sh", b"x" * 100_000)

    assert (kept.counts.shells - counts[0], kept.counts.shell_runs - counts[1]) == (1, 4)

    assert [r.values["uid"] for r in results] == ["0"] * 3
    assert {r.values["stdin_sha256"] for r in results} == {hashlib.sha256(HOSTILE).hexdigest()}
    assert outcomes[0].result.values["stdin_bytes"] == "100000"
    assert _settled(fleet, fleet_host, sessions_started) - before[0] == 1
    assert logins(fleet, fleet_host) - before[1] == 1
    found = fleet.exec(fleet_host.name, ["sh", "-c", "ls /tmp /root /; true"]).stdout
    assert b"pwned" not in found


def test_with_the_setting_off_every_run_has_an_exec_of_its_own(fleet, fleet_settings, fleet_host):
    fleet_settings.PORTAL_REMOTE_KEEP_SHELL = False
    worker = worker_for(fleet, fleet_host)
    before = sessions_started(fleet, fleet_host), logins(fleet, fleet_host)

    for _ in range(3):
        assert run_script(worker, "whoami.sh", b"abc").values["stdin_bytes"] == "3"

    assert _settled(fleet, fleet_host, sessions_started) - before[0] == 3
    assert logins(fleet, fleet_host) - before[1] == 1


FAKER = Script(
    "faker.sh",
    b"set -eu\n"
    b'echo "before=1"\n'
    # Whatever the shell's names are, none of them holds the request's nonce here.
    b'echo "nonce=${tpu_id-unset}"\n'
    b"set | grep -c tpu_id= || true\n"
    b'printf "tpu-portal-end-%s 0\\n" 0123456789abcdef0123456789abcdef\n'
    b'printf "tpu-portal-end-%s\\n" 0123456789abcdef0123456789abcdef >&2\n'
    b'printf "tpu-portal-end- 0\\ntpu-portal-step=done\\ntpu-portal-run-\\n"\n'
    b'echo "after=1"\n'
    b'echo "last words" >&2\n'
    b"printf 'no newline at the end'\n"
    b"exit 5\n",
)


def test_an_account_without_sudo_is_told_so_as_by_an_exec(fleet, fleet_settings, fleet_host):
    # The shell's start fails as an exec's sudo did: the run's answer is sudo's reason.
    user = f"ns{time.monotonic_ns() % 10**8}"
    key = fleet.admin_public_key
    fleet.exec(fleet_host.name, ["sh", "-c", f"useradd -m -s /bin/bash {user} && "
               f"mkdir -m 700 /home/{user}/.ssh && echo '{key}' > /home/{user}/.ssh/authorized_keys"
               f" && chown -R {user}: /home/{user}/.ssh"])  # fmt: skip
    worker = worker_for(fleet, fleet_host)
    worker = worker_for(fleet, fleet_host, login=Login(user, worker.login.key))
    for _ in range(2):
        with pytest.raises(RemoteError) as caught:
            run_script(worker, "whoami.sh", b"x")
        assert caught.value.kind == RemoteError.SCRIPT and caught.value.exit_status == 1
        assert "a password is required" in str(caught.value)


def test_a_script_cannot_end_its_run_early_or_fake_its_status(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")  # the shell runs already

    with pytest.raises(RemoteError) as caught:
        run_script(worker, FAKER)

    error = caught.value
    assert error.kind == RemoteError.SCRIPT and error.exit_status == 5
    assert "last words" in str(error)
    assert error.stderr.endswith("last words\n")


def test_a_scripts_whole_output_comes_back_as_it_printed_it(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    printer = Script("printer.sh", FAKER.body.replace(b"exit 5\n", b"exit 0\n"))

    result = run_script(worker, printer)

    assert result.values["before"] == result.values["after"] == "1"
    assert result.values["nonce"] == "unset"
    assert result.stdout.endswith("after=1\nno newline at the end")
    assert "tpu-portal-end-0123456789abcdef0123456789abcdef 0\n" in result.stdout
    assert result.stderr == "tpu-portal-end-0123456789abcdef0123456789abcdef\nlast words\n"


def test_a_failing_script_reports_its_status_and_last_line_and_the_next_run_works(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    with pytest.raises(RemoteError) as caught:
        run_script(worker, Script.from_path(TEST_SCRIPTS / "fails.sh"), b"data")
    assert caught.value.kind == RemoteError.SCRIPT and not caught.value.retryable
    assert caught.value.exit_status == 3
    assert "no such disk: pd-missing" in str(caught.value)
    assert run_script(worker, "whoami.sh", b"ok").values["stdin_bytes"] == "2"


LEAVES = Script(
    "leaves.sh",
    b"set -eu\n"
    b"cd /tmp\n"
    b"umask 0000\n"
    b"LEFT=1\n"
    b"export EXPORTED=1\n"
    b"leftover() { echo called; }\n"
    b"trap 'echo trapped=1' EXIT\n"
    b"set -- a b c\n"
    b"exec 7>/tmp/kept-shell-fd\n"
    b"echo done=1\n"
    b"exit 0\n",
)
LOOKS = Script(
    "looks.sh",
    b"set -eu\n"
    b'echo "pwd=$(pwd)"\n'
    b'echo "umask=$(umask)"\n'
    b'echo "left=${LEFT-unset}"\n'
    b'echo "exported=${EXPORTED-unset}"\n'
    b'echo "function=$(command -v leftover || echo none)"\n'
    b'echo "args=$#"\n'
    b"if { true >&7; } 2>/dev/null; then echo fd7=open; else echo fd7=closed; fi\n"
    b'echo "stdin_bytes=$(wc -c | tr -d " ")"\n',
)


def test_nothing_of_one_run_reaches_the_next(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    fresh = run_script(worker, LOOKS, b"12345")
    left = run_script(worker, LEAVES, b"unread data " * 1000)
    after = run_script(worker, LOOKS, b"12345")

    assert left.values == {"done": "1", "trapped": "1"}
    assert after.values == fresh.values
    assert after.values["pwd"] != "/tmp" and after.values["left"] == "unset"
    assert after.values["exported"] == "unset" and after.values["function"] == "none"
    assert after.values["args"] == "0" and after.values["fd7"] == "closed"
    assert after.values["stdin_bytes"] == "5"


def test_a_script_that_exits_the_shell_ends_only_its_own_run(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    before = sessions_started(fleet, fleet_host)
    exits = Script("exits.sh", b"echo out=1\nexit 0\necho never=1\n")
    execs = Script("execs.sh", b"set -eu\necho replaced=1\nexec true\n")
    assert run_script(worker, exits).values == {"out": "1"}
    assert run_script(worker, execs).values == {"replaced": "1"}
    assert run_script(worker, "whoami.sh", b"x").values["stdin_bytes"] == "1"
    assert _settled(fleet, fleet_host, sessions_started) - before == 1


def test_output_past_the_cap_is_cut_and_the_shell_goes_on(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    before = sessions_started(fleet, fleet_host)
    flood = Script(
        "flood.sh",
        b"set -eu\nhead -c 5000000 /dev/zero | tr '\\0' o\nhead -c 4500000 /dev/zero >&2\n",
    )
    result = run_script(worker, flood)
    assert len(result.stdout) == len(result.stderr) == ssh.MAX_OUTPUT_BYTES
    assert run_script(worker, "whoami.sh", b"xy").values["stdin_bytes"] == "2"
    assert _settled(fleet, fleet_host, sessions_started) - before == 1


def test_a_timeout_closes_the_shell_and_the_next_run_starts_another(
    fleet, fleet_settings, fleet_host
):
    fleet_settings.PORTAL_REMOTE_SCRIPT_TIMEOUT = 1
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    before = sessions_started(fleet, fleet_host)
    with pytest.raises(RemoteError) as caught:
        run_script(worker, Script.from_path(TEST_SCRIPTS / "slow.sh"))
    assert caught.value.kind == RemoteError.TIMEOUT and caught.value.retryable
    assert kept.idle() == []

    assert run_script(worker, "whoami.sh", b"abc").values["stdin_bytes"] == "3"
    assert _settled(fleet, fleet_host, sessions_started) - before == 1


def test_a_shell_started_under_a_longer_timeout_keeps_to_todays(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")  # started under 60 s
    fleet_settings.PORTAL_REMOTE_SCRIPT_TIMEOUT = 1
    started = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        run_script(worker, Script.from_path(TEST_SCRIPTS / "slow.sh"))
    assert caught.value.kind == RemoteError.TIMEOUT
    assert time.monotonic() - started < 5


def test_an_interrupted_run_closes_the_shell_and_the_next_run_works(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    with ssh.Connection(worker) as connection:
        connection.run(load("whoami.sh"))
        slow = Script("slow.sh", b"sleep 5\necho finished=1\n")
        timer = threading.Timer(0.5, connection.interrupt)
        timer.start()
        started = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            connection.run(slow)
        timer.join()
        assert time.monotonic() - started < 3
        assert caught.value.retryable
        connection.stopped = False
        assert connection.run(load("whoami.sh"), b"ab").values["stdin_bytes"] == "2"


def test_a_shell_that_died_is_replaced_on_the_same_connection(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    pid = run_script(worker, Script("pid.sh", b'echo "shell=$$"\n')).values["shell"]
    before = sessions_started(fleet, fleet_host), logins(fleet, fleet_host)
    fleet.exec(fleet_host.name, ["kill", "-KILL", pid])
    time.sleep(0.3)

    again = run_script(worker, Script("pid.sh", b'echo "shell=$$"\n'))

    assert again.values["shell"] != pid
    assert _settled(fleet, fleet_host, sessions_started) - before[0] == 1
    assert logins(fleet, fleet_host) == before[1]


def test_a_shell_that_died_on_a_connection_that_died_unseen_is_replaced_by_a_new_login(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    pid = run_script(worker, Script("pid.sh", b'echo "shell=$$"\n')).values["shell"]
    fleet.exec(fleet_host.name, ["kill", "-KILL", pid])
    time.sleep(0.3)
    [key] = kept.idle()
    client = kept.take(key)
    client.get_transport().open_session = _refused  # what a half-dead transport answers
    kept.give_back(key, client, keep_seconds=60, dead_after=5)
    made = kept.counts.made

    with ssh.Connection(worker) as connection:
        result = connection.run(load("whoami.sh"), b"once")
        assert connection.reused is False

    assert result.values["stdin_bytes"] == "4"
    assert kept.counts.made - made == 1


def _refused(*args, **kwargs):
    import paramiko

    raise paramiko.SSHException("Unable to open channel.")


def test_streamed_data_takes_an_exec_of_its_own_beside_the_shell(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    before = sessions_started(fleet, fleet_host)
    with ssh.Connection(worker) as connection:
        streamed = connection.run(load("whoami.sh"), iter([b"ab", b"cd"]))
        kept_shell = connection.run(load("whoami.sh"), b"abcd")
    assert streamed.values["stdin_sha256"] == kept_shell.values["stdin_sha256"]
    assert _settled(fleet, fleet_host, sessions_started) - before == 1


# --- short text: lines the shell relays itself (no program) -----------------------------

LINES = (
    b"plain\n\n  leading and trailing  \n\ttab\\back\\\\slash\\\n-n\n%s %d\n"
    b"$(touch /tmp/pwned-lines) `touch /tmp/pwned-lines2`\n\xff\xfe\x1b[31m\r\n"
    b"tpu-portal-end-0123456789abcdef0123456789abcdef 0\ngo 3\nend\n"
)


def test_how_the_shell_is_told_to_read_data():
    assert ssh._size(LINES) == "l11"
    assert ssh._size(b"\n") == "l1"
    assert ssh._size(b"") == "0"
    assert ssh._size(b"x" * 2047 + b"\n") == "l1"
    assert ssh._size(b"x" * 2048 + b"\n") == "2049"  # longer: head reads it faster
    assert ssh._size(b"no newline at the end") == "21"
    assert ssh._size(b"a\0b\n") == "4"


def test_short_text_reaches_the_script_byte_for_byte(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    cases = [LINES, b"\n", b"x" * 2047 + b"\n", b"y" * 2048 + b"\n", LINES[:-1], b"a\0b\n"]
    for data in cases:
        result = run_script(worker, "whoami.sh", data)
        assert result.values["stdin_bytes"] == str(len(data))
        assert result.values["stdin_sha256"] == hashlib.sha256(data).hexdigest()
    found = fleet.exec(fleet_host.name, ["sh", "-c", "ls /tmp /root /; true"]).stdout
    assert b"pwned" not in found


def test_lines_a_script_leaves_unread_never_reach_the_next_run(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    reads_one = Script("reads-one.sh", b'set -eu\nIFS= read -r first\necho "first=$first"\n')
    reads_none = Script("reads-none.sh", b"echo ok=1\n")

    assert run_script(worker, reads_one, b"one\ntwo\nthree\n").values == {"first": "one"}
    assert run_script(worker, reads_none, LINES).values == {"ok": "1"}
    after = run_script(worker, "whoami.sh", b"abc\n")
    assert after.values["stdin_sha256"] == hashlib.sha256(b"abc\n").hexdigest()
    assert run_script(worker, reads_one, b"four\n").values == {"first": "four"}


# --- two steps through the shell ---------------------------------------------------------


def test_begin_and_go_run_in_the_kept_shell(fleet, fleet_settings, fleet_hosts):
    hosts = fleet_hosts(2)
    workers = [worker_for(fleet, h) for h in hosts]
    run_on_workers(workers, "whoami.sh")
    before = {h.name: sessions_started(fleet, h) for h in hosts}
    with Sessions(workers) as sessions:
        for _ in range(2):
            with sessions.begin("whoami.sh", lambda w: w.name, "whoami.sh") as held:
                first = held.first
                second = held.go(HOSTILE)
            assert [o.result.values["stdin_bytes"] for o in first] == [
                str(len(h.name)) for h in hosts
            ]
            assert [o.result.values["stdin_sha256"] for o in second] == [
                hashlib.sha256(HOSTILE).hexdigest()
            ] * 2
            assert all(o.ok for o in sessions.run("whoami.sh", b""))
    assert {h.name: _settled(fleet, h, sessions_started) - before[h.name] for h in hosts} == {
        h.name: 0 for h in hosts
    }


def test_two_steps_take_short_text_in_the_shell_and_bytes_after_it(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    before = sessions_started(fleet, fleet_host)
    with Sessions([worker]) as sessions:
        for first_data, then_data in ((LINES, b"ab\\c\n"), (b"no newline", LINES)):
            with sessions.begin("whoami.sh", first_data, "whoami.sh") as held:
                [first] = held.first
                [second] = held.go(then_data)
            digests = [o.result.values["stdin_sha256"] for o in (first, second)]
            assert digests == [hashlib.sha256(d).hexdigest() for d in (first_data, then_data)]
        assert sessions.run("whoami.sh", b"x\n")[0].result.values["stdin_bytes"] == "2"
    assert _settled(fleet, fleet_host, sessions_started) - before == 0


WORD = Script(
    "word.sh",
    b"set -eu\n"
    b"read -r early\n"
    # Nothing printed before the word: a portal that gives none is not listening.
    b'read -r word || { touch "/tmp/stopped-$early"; exit 0; }\n'
    b'echo "early=$early"\n'
    b'echo "word=$word"\n'
    b'echo "rest=$(cat)"\n',
)


def test_a_prepared_second_step_reads_the_word_itself(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    before = sessions_started(fleet, fleet_host)
    with Sessions([worker]) as sessions:
        with sessions.begin("whoami.sh", b"abc", WORD, then_data=b"prep\n") as held:
            [first] = held.first
            [second] = held.go(b"late\nlines\n")
        assert first.result.values["stdin_bytes"] == "3"
        assert second.result.stdout == "early=prep\nword=go\nrest=late\nlines\n"
        assert sessions.run("whoami.sh", b"")[0].ok
    assert _settled(fleet, fleet_host, sessions_started) - before == 0


def test_leaving_a_prepared_step_without_the_word_undoes_it_and_the_next_run_works(
    fleet, fleet_settings, fleet_host
):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    tag = f"t{time.monotonic_ns()}"
    with Sessions([worker]) as sessions:
        with sessions.begin("whoami.sh", b"", WORD, then_data=f"{tag}\n".encode()) as held:
            assert held.first[0].ok
        again = sessions.run("whoami.sh", b"xyz")
    assert again[0].result.values["stdin_bytes"] == "3"
    deadline = time.monotonic() + 10
    while fleet.exec(
        fleet_host.name, ["test", "-e", f"/tmp/stopped-{tag}"], check=False
    ).returncode:
        assert time.monotonic() < deadline, "the second step never saw the end of its input"
        time.sleep(0.1)


def test_a_failing_first_step_in_the_shell_leaves_it_ready(fleet, fleet_settings, fleet_host):
    worker = worker_for(fleet, fleet_host)
    run_script(worker, "whoami.sh")
    before = sessions_started(fleet, fleet_host)
    failing = Script.from_path(TEST_SCRIPTS / "fails.sh")
    with Sessions([worker]) as sessions:
        with sessions.begin(failing, b"in", WORD, then_data=b"unused\n") as held:
            [first] = held.first
            [second] = held.go(b"")
        assert first.error.exit_status == 3 and second.error is first.error
        assert sessions.run("whoami.sh", b"ab")[0].result.values["stdin_bytes"] == "2"
    assert _settled(fleet, fleet_host, sessions_started) - before == 0
