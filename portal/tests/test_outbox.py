"""The outbox: a message exists exactly when the change it reports committed, is sent
once, is retried with backoff while the SMTP server is away, and is given up on
visibly."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.core import mail
from django.db import connection, transaction
from django.urls import reverse
from django.utils import timezone

from portal import mail as portal_mail
from portal import outbox
from portal.models import OutboxMessage, OutboxState
from portal.tasks import send_mail as sweep
from tests.e2e import free_port


def _send(to="milo@uni.example"):
    portal_mail.send(
        "drift_found",
        [to],
        {
            "worker": {"alias": "tpu5-w0"},
            "vm": {"name": "tpu5", "pk": 5},
            "lab": {"name": "Vision", "slug": "vision"},
            "usernames": ["mallory"],
        },
    )


def _smtp_down(settings):
    """Point mail at a port where nothing listens: every attempt is refused."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = free_port()
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_TIMEOUT = 5


def _age(seconds: float) -> None:
    """Let ``seconds`` pass for the outbox: every stored time moves back."""
    delta = dt.timedelta(seconds=seconds)
    for message in OutboxMessage.objects.all():
        OutboxMessage.objects.filter(pk=message.pk).update(
            created_at=message.created_at - delta,
            next_attempt_at=message.next_attempt_at - delta,
        )


@pytest.mark.django_db(transaction=True)
def test_a_message_is_sent_when_its_transaction_commits_and_its_body_is_not_kept():
    with transaction.atomic():
        _send()
        assert not mail.outbox  # nothing leaves before the change it reports is saved
    [sent] = mail.outbox
    assert sent.to == ["milo@uni.example"]
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.SENT and row.attempts == 1 and row.sent_at
    assert row.subject == sent.subject and row.kind == "drift_found"
    assert sent.extra_headers["Message-ID"] == row.message_id
    assert row.body == ""  # it may hold a link meant for one person


@pytest.mark.django_db(transaction=True)
def test_an_email_raised_in_a_transaction_that_rolls_back_is_neither_stored_nor_resent():
    with pytest.raises(RuntimeError), transaction.atomic():
        _send()
        raise RuntimeError("the change itself failed")
    assert not OutboxMessage.objects.exists()
    assert outbox.send_due() == 0
    assert not mail.outbox


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_server_schedules_a_retry_and_the_caller_never_sees_an_error(settings):
    _smtp_down(settings)
    before = timezone.now()
    _send()  # no exception
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.PENDING and row.attempts == 1
    assert "ConnectionRefusedError" in row.last_error
    wait = (row.next_attempt_at - before).total_seconds()
    assert 15 - 1 <= wait <= 30 + 1  # half to all of PORTAL_MAIL_RETRY_SECONDS
    assert row.body  # kept until it is sent


def test_backoff_doubles_from_the_base_up_to_the_cap_with_jitter(settings):
    settings.PORTAL_MAIL_RETRY_SECONDS = 30
    settings.PORTAL_MAIL_RETRY_MAX_SECONDS = 1800
    for attempts, full in [(1, 30), (2, 60), (3, 120), (6, 960), (7, 1800), (60, 1800)]:
        waits = [outbox.backoff(attempts) for _ in range(200)]
        assert all(full / 2 <= w <= full for w in waits), (attempts, min(waits), max(waits))
        assert len({round(w, 3) for w in waits}) > 100  # spread, not in lockstep


@pytest.mark.django_db(transaction=True)
def test_the_sweep_sends_a_retry_once_it_is_due_and_then_nothing_more(settings):
    _smtp_down(settings)
    _send()
    assert outbox.claim_next_due() is None  # not due yet
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    _age(31)
    sweep()
    assert [m.to for m in mail.outbox] == [["milo@uni.example"]]
    assert "Unknown accounts on tpu5-w0" in mail.outbox[0].subject
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.SENT and row.attempts == 2 and row.last_error == ""
    _age(3600)
    sweep()
    assert len(mail.outbox) == 1


def test_a_message_whose_sender_died_is_sent_by_the_sweep_after_its_lease(db):
    # Stored, but the first attempt never ran (its process died before the commit
    # hook): the row holds a lease, then the sweep takes it over.
    _send()
    assert not mail.outbox
    assert outbox.send_due() == 0
    _age(outbox.LEASE.total_seconds() + 1)
    assert outbox.send_due() == 1
    assert len(mail.outbox) == 1
    assert outbox.send_due() == 0


def test_a_late_first_attempt_does_not_send_what_the_sweep_has_taken(db):
    message = outbox.enqueue("test", ["milo@uni.example"], "Hello", "Body")
    _age(outbox.LEASE.total_seconds() + 1)
    lease_seen_by_the_first_attempt = OutboxMessage.objects.get().next_attempt_at
    taken = outbox.claim_next_due()  # the sweep holds it, still pending
    assert taken.pk == message.pk and taken.state == OutboxState.PENDING
    outbox._first_attempt(message.pk, lease_seen_by_the_first_attempt)
    assert not mail.outbox
    assert outbox.attempt(taken)
    assert len(mail.outbox) == 1


@pytest.mark.django_db(transaction=True)
def test_a_message_still_refused_after_the_give_up_time_is_marked_failed(settings):
    _smtp_down(settings)
    settings.PORTAL_MAIL_GIVE_UP_SECONDS = 3600
    _send()
    _age(1800)
    sweep()
    assert OutboxMessage.objects.get().state == OutboxState.PENDING
    _age(1801)
    sweep()
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.FAILED
    assert "ConnectionRefusedError" in row.last_error
    _age(86400)
    assert outbox.send_due() == 0
    assert OutboxMessage.objects.get().attempts == row.attempts


@pytest.mark.django_db(transaction=True)
def test_a_recipient_refused_for_good_is_failed_at_once_and_a_busy_one_is_retried(
    smtp_settings,
):
    smtp_settings.refusing = "550 5.1.1 No such user here"
    _send("nobody@uni.example")
    smtp_settings.refusing = "451 4.3.0 Try again later"
    _send("milo@uni.example")
    gone, busy = OutboxMessage.objects.order_by("pk")
    assert gone.state == OutboxState.FAILED and "550" in gone.last_error
    assert busy.state == OutboxState.PENDING and "451" in busy.last_error
    assert not smtp_settings.messages


@pytest.mark.django_db(transaction=True)
def test_two_sweeps_at_once_send_every_message_exactly_once():
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    for i in range(40):
        outbox.enqueue("test", [f"user{i}@uni.example"], f"Message {i}", "Body")
    mail.outbox.clear()
    OutboxMessage.objects.update(
        state=OutboxState.PENDING, sent_at=None, attempts=0, next_attempt_at=timezone.now()
    )
    barrier = threading.Barrier(2)
    counts = []

    def run():
        barrier.wait()
        try:
            counts.append(outbox.send_due())
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    subjects = sorted(m.subject for m in mail.outbox)
    assert subjects == sorted(f"Message {i}" for i in range(40))
    assert sum(counts) == 40
    assert not OutboxMessage.objects.exclude(state=OutboxState.SENT).exists()
    assert set(OutboxMessage.objects.values_list("attempts", flat=True)) == {1}


def test_the_site_admin_sees_waiting_and_failed_mail_on_the_dashboard(client, cast):
    outbox.enqueue("test", ["milo@uni.example"], "Stuck", "Body")
    outbox.enqueue("test", ["ada@uni.example"], "Given up", "Body")
    _age(120)
    OutboxMessage.objects.filter(subject="Given up").update(state=OutboxState.FAILED)
    client.force_login(cast.site_admin)
    page = client.get(reverse("dashboard")).content.decode()
    assert "1 email waiting" in page and "1 email given up on" in page
    assert reverse("admin:portal_outboxmessage_changelist") + "?state__exact=failed" in page
    client.force_login(cast.admin)
    assert "email waiting" not in client.get(reverse("dashboard")).content.decode()


def test_the_admin_lists_the_outbox_read_only_by_state_and_recipient(client, cast):
    outbox.enqueue("test", ["milo@uni.example"], "About tpu5", "secret reset link")
    outbox.enqueue("test", ["ada@uni.example"], "About tpu6", "Body")
    client.force_login(cast.site_admin)
    url = reverse("admin:portal_outboxmessage_changelist")
    page = client.get(url, {"state__exact": "pending", "q": "milo"}).content.decode()
    assert "About tpu5" in page and "About tpu6" not in page
    row = OutboxMessage.objects.get(subject="About tpu5")
    detail = client.get(reverse("admin:portal_outboxmessage_change", args=[row.pk]))
    assert detail.status_code == 200
    assert "secret reset link" not in detail.content.decode()
    assert 'name="_save"' not in detail.content.decode()
    assert client.get(reverse("admin:portal_outboxmessage_add")).status_code == 403


def test_a_message_rendered_elsewhere_keeps_its_html_alternative(
    db, django_capture_on_commit_callbacks
):
    from django.core.mail import EmailMultiAlternatives

    rendered = EmailMultiAlternatives("Reset", "plain text", "Portal <p@x.example>", ["m@x.org"])
    rendered.attach_alternative("<p>html</p>", "text/html")
    with django_capture_on_commit_callbacks(execute=True):
        portal_mail.send_message("account/email/password_reset_key", rendered)
    [sent] = mail.outbox
    assert sent.body == "plain text" and sent.from_email == "Portal <p@x.example>"
    assert sent.alternatives[0][0] == "<p>html</p>"


@pytest.fixture
def smtp_hanging(settings):
    """An SMTP server that accepts connections and never says a word."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # never accepted: the kernel completes the handshake, then silence
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = server.getsockname()
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_TIMEOUT = 1
    yield server
    server.close()


@pytest.mark.django_db(transaction=True)
def test_after_a_timed_out_attempt_new_messages_wait_for_the_sweep_instead_of_the_server(
    settings, smtp_hanging
):
    _send("milo@uni.example")
    _send("ada@uni.example")  # not tried: the server just hung
    attempts = dict(OutboxMessage.objects.values_list("to", "attempts"))
    assert attempts == {"milo@uni.example": 1, "ada@uni.example": 0}
    assert "timed out" in OutboxMessage.objects.get(to="milo@uni.example").last_error
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    _age(outbox.FIRST_ATTEMPT_LEASE.total_seconds() + 1)
    sweep()  # the server is back: both go out, once each
    assert sorted(m.to[0] for m in mail.outbox) == ["ada@uni.example", "milo@uni.example"]
    sweep()
    assert len(mail.outbox) == 2


# A message written at its first attempt: this test module's renderer says what the
# "facts" dict holds then, and nothing once the fact is gone.
_FACTS: dict[str, str] = {}


def _render_fact(args: dict) -> tuple[str, str] | None:
    fact = _FACTS.get(args["fact"])
    return None if fact is None else (f"About {args['fact']}", f"It is {fact}.")


@pytest.fixture
def facts():
    outbox.register_renderer("portal.tests.fact", _render_fact)
    _FACTS.clear()
    yield _FACTS
    _FACTS.clear()


def _tell(fact: str) -> OutboxMessage:
    return outbox.enqueue(
        "fact", ["milo@uni.example"], "", "",
        render_with="portal.tests.fact", render_args={"fact": fact},
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_a_message_stored_unrendered_is_written_at_its_first_attempt_from_what_is_true_then(facts):
    with transaction.atomic():
        facts["the sky"] = "blue"
        _tell("the sky")
        row = OutboxMessage.objects.get()
        assert (row.subject, row.body, row.render_with) == ("", "", "portal.tests.fact")
        facts["the sky"] = "grey"  # changed before the commit: the email says grey
    [sent] = mail.outbox
    assert (sent.subject, sent.body) == ("About the sky", "It is grey.")
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.SENT and row.render_with == "" and row.render_args == {}


@pytest.mark.django_db(transaction=True)
def test_a_message_written_at_a_refused_attempt_is_retried_with_that_same_text(settings, facts):
    _smtp_down(settings)
    facts["the sky"] = "blue"
    _tell("the sky")
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.PENDING and row.attempts == 1
    assert (row.subject, row.body, row.render_with) == ("About the sky", "It is blue.", "")
    facts["the sky"] = "grey"  # a retry sends what the first attempt wrote, not this
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    _age(31)
    sweep()
    [sent] = mail.outbox
    assert (sent.subject, sent.body) == ("About the sky", "It is blue.")
    assert sent.extra_headers["Message-ID"] == row.message_id


@pytest.mark.django_db(transaction=True)
def test_a_message_with_nothing_true_left_to_say_at_its_first_attempt_is_dropped_unsent(facts):
    with transaction.atomic():
        facts["the sky"] = "blue"
        _tell("the sky")
        del facts["the sky"]
    assert not mail.outbox
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.DROPPED and "no longer true" in row.last_error
    _age(outbox.LEASE.total_seconds() + 3600)
    assert outbox.send_due() == 0 and not mail.outbox
    assert outbox.backlog() == {"waiting": 0, "failed": 0}


def test_a_message_stored_unrendered_by_a_process_that_died_is_written_by_the_sweep(db, facts):
    facts["the sky"] = "blue"
    _tell("the sky")  # no commit hook runs here: as if the process died after its commit
    assert not mail.outbox and OutboxMessage.objects.get().body == ""
    _age(outbox.LEASE.total_seconds() + 1)
    assert outbox.send_due() == 1
    [sent] = mail.outbox
    assert sent.body == "It is blue."


def test_a_message_whose_renderer_is_unknown_is_kept_and_retried_not_lost(db):
    outbox.enqueue(
        "fact", ["milo@uni.example"], "", "", render_with="portal.tests.nobody", render_args={}
    )
    _age(outbox.LEASE.total_seconds() + 1)
    assert outbox.send_due() == 0 and not mail.outbox
    row = OutboxMessage.objects.get()
    assert row.state == OutboxState.PENDING and row.backing_off
    assert "no renderer is registered for 'portal.tests.nobody'" in row.last_error
    assert row.render_with == "portal.tests.nobody"  # still to be written
