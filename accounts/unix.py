"""Use cases about a person's unix account on the lab's machines: the UID, allocated
once and never given to anyone else, and the username, chosen by the person and fixed
once the account exists on a host."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Max, OuterRef, Q, Subquery
from django.utils import timezone

from accounts.models import SSHKey, UidAllocation, UnixAccount, User
from accounts.usernames import suggest_username, validate_unix_username
from portal import audit, people
from portal.audit import AuditAction

# Concurrent allocations that lose a race try again with the next number; each loss
# means another allocation won, so this bounds only pathological contention.
_ALLOCATION_ATTEMPTS = 100


class UnixAccountError(ValueError):
    """A unix account change was refused. ``code`` is a stable slug for programs;
    ``message`` is the explanation for the person."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def uid_range() -> tuple[int, int]:
    """The configured UID range, inclusive (``PORTAL_UID_MIN``..``PORTAL_UID_MAX``)."""
    return settings.PORTAL_UID_MIN, settings.PORTAL_UID_MAX


def _allocate_uid(user: User) -> int:
    """The next UID above every UID ever allocated in the range, recorded for good.
    Two allocations that pick the same number collide on the primary key; the loser
    reads the new highest number and tries the one after it."""
    low, high = uid_range()
    for _ in range(_ALLOCATION_ATTEMPTS):
        top = UidAllocation.objects.filter(uid__gte=low, uid__lte=high).aggregate(Max("uid"))
        uid = low if top["uid__max"] is None else top["uid__max"] + 1
        if uid > high:
            raise UnixAccountError(
                "no_uids_left",
                "The portal has no unix UIDs left to give. Ask the site admin to widen "
                "its UID range.",
            )
        try:
            with transaction.atomic():
                UidAllocation.objects.create(uid=uid, user=user)
        except IntegrityError:
            continue
        return uid
    raise UnixAccountError("busy", "The portal is busy allocating accounts. Try again.")


def ensure_unix_account(user: User) -> UnixAccount:
    """``user``'s unix account, made (with a newly allocated UID) the first time it is
    needed. Calling it again returns the same account."""
    account = UnixAccount.objects.filter(user=user).first()
    if account is not None:
        return account
    with transaction.atomic():
        # Serialise per person, so two first requests make one account, one UID.
        User.objects.select_for_update().filter(pk=user.pk).first()
        account = UnixAccount.objects.filter(user=user).first()
        if account is None:
            # Someone whose account was removed and made again keeps their old UID,
            # so their files on shared disks are still theirs.
            previous = UidAllocation.objects.filter(user=user).order_by("-uid").first()
            uid = previous.uid if previous is not None else _allocate_uid(user)
            account = UnixAccount.objects.create(user=user, uid=uid)
    return account


def choose_username(user: User, name: str, request=None) -> UnixAccount:
    """Set ``user``'s unix username to ``name``, or raise ``UnixAccountError`` with
    one of ``validate_unix_username``'s codes, ``taken`` (someone has it, in any
    letter case) or ``locked`` (the account already exists on a host). Choosing the
    current name again changes nothing."""
    if not isinstance(name, str):
        name = ""
    try:
        validate_unix_username(name)
    except ValidationError as exc:
        raise UnixAccountError(exc.code or "invalid", exc.messages[0]) from None
    with transaction.atomic():
        account = ensure_unix_account(user)
        account = UnixAccount.objects.select_for_update().get(pk=account.pk)
        if account.username == name:
            return account
        if account.locked:
            raise UnixAccountError(
                "locked",
                f"Your username is already “{account.username}” on the lab's machines, "
                "so it can no longer change.",
            )
        if _name_in_use(name, user):
            raise _taken(name)
        try:
            with transaction.atomic():
                # Conditional, so a host that provisions the account meanwhile wins.
                updated = UnixAccount.objects.filter(pk=account.pk, provisioned_at=None).update(
                    username=name
                )
        except IntegrityError:
            raise _taken(name) from None
        if not updated:
            raise UnixAccountError("locked", "Your account already exists on a lab machine.")
        previous, account.username = account.username, name
        people.changed()
        audit.record(
            AuditAction.UNIX_USERNAME_CHOSEN,
            actor=user,
            target_user=user,
            summary=name,
            data={"username": name, "previous": previous, "uid": account.uid},
            request=request,
        )
    return account


def _name_in_use(name: str, user: User) -> bool:
    """Whether anyone but ``user`` has ``name`` (in any letter case): as their account's
    username, or as the name their UID went to hosts with, which outlives the person.
    One query: every account's UID has an allocation row of the same person."""
    return (
        UidAllocation.objects.filter(
            Q(username__iexact=name) | Q(user__unix_account__username__iexact=name)
        )
        .exclude(user=user)
        .exists()
    )


def _taken(name: str) -> UnixAccountError:
    return UnixAccountError("taken", f"“{name}” is taken. Choose another username.")


def mark_provisioned(user: User) -> None:
    """Record that ``user``'s account now exists on at least one host, which fixes
    the username; calling it again keeps the first time."""
    account = UnixAccount.objects.filter(user=user).exclude(username="").first()
    if account is not None:
        mark_names_provisioned([account.username])


def mark_names_provisioned(usernames: list[str]) -> bool:
    """The accounts with these usernames are about to be written to hosts: their
    usernames are fixed from now on, and reserved for their UIDs for good (a deleted
    person's name is never given to anyone else). Accounts already marked keep their
    first time. Call inside the transaction that reads the desired state.

    False when one of the names is no longer any account's: it was changed after the
    caller read it, and the caller must read the state again rather than send it."""
    with transaction.atomic():
        fresh = UnixAccount.objects.filter(username__in=usernames, provisioned_at=None)
        # Locked, so a name cannot change between marking and sending it (choose_username
        # locks the account row too, and refuses once it is marked).
        named = list(fresh.select_for_update().values_list("pk", "uid"))
        if named:
            UnixAccount.objects.filter(pk__in=[pk for pk, _ in named]).update(
                provisioned_at=timezone.now()
            )
            # One UPDATE for all of them: each UID's row takes its account's name.
            UidAllocation.objects.filter(uid__in=[uid for _, uid in named], username="").update(
                username=Subquery(
                    UnixAccount.objects.filter(uid=OuterRef("uid")).values("username")[:1]
                )
            )
        fixed = UnixAccount.objects.filter(username__in=usernames).exclude(provisioned_at=None)
        return fixed.count() == len(set(usernames))


def suggested_username(user: User) -> str | None:
    """A free username to offer ``user``: from their first key's comment
    (``milo@laptop`` → ``milo``), else from their email address; a number is added
    when the plain name is taken. None when nothing sensible comes out."""
    first = SSHKey.objects.filter(user=user).exclude(comment="").first()
    source = first.comment if first is not None else user.email
    taken: list[str] = []
    for _ in range(5):
        name = suggest_username(source, taken)
        if name is None:
            return None
        if not _name_in_use(name, user):
            return name
        taken.append(name)
    return None
