"""Finding people and TPU VMs inside one lab: the searches behind the admin pages'
lists and pickers, and turning what an admin typed into the one person or VM they
meant. Every query here starts from the lab, so another lab's people and VMs never
appear and cannot be chosen."""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace

from django.core.cache import cache
from django.db.models import Count, Exists, F, Max, OuterRef, Q, QuerySet

from portal import people
from tpus.models import Grant, Lab, Membership, TpuVm
from tpus.models.grants import WANTED_STATES
from tpus.services.grants import why_not_grantable

# A picker shows this many matches at most; typing more narrows them.
PICKER_LIMIT = 20
# How long readiness counts stay cached at most, should a change slip past the stamp.
READINESS_SECONDS = 300


class NoMatch(ValueError):
    """What was typed names no one (or nothing) that can be chosen; the message says
    who or what is missing and why."""


def memberships(lab: Lab, *, q: str = "", state: str = "", role: str = "") -> QuerySet[Membership]:
    """The lab's memberships matching ``q`` (part of a name, email or unix username),
    ``state`` and ``role`` (any when empty), by email. By email alone, so a page is
    read along the email index and stops after a page's worth of people, at any size
    of lab (ordering by role first sorted every member on every page)."""
    found = lab.memberships.select_related("user__unix_account")
    if state:
        found = found.filter(state=state)
    if role:
        found = found.filter(role=role)
    q = q.strip()
    if q:
        found = found.filter(
            Q(user__full_name__icontains=q)
            | Q(user__email__icontains=q)
            | Q(user__unix_account__username__icontains=q)
        )
    return found.order_by("user__email", "pk")


@dataclass(frozen=True)
class Candidate:
    """A person a picker offers: the value to submit, a label, and why they cannot be
    chosen yet ("" when they can)."""

    value: str
    label: str
    problem: str


def grantee_candidates(lab: Lab, q: str) -> list[Candidate]:
    """Up to ``PICKER_LIMIT`` approved members matching ``q``; those who cannot be
    given access yet come with the reason."""
    q = q.strip()
    if not q:
        return []
    found = memberships(lab, q=q, state=Membership.State.APPROVED).order_by(
        "user__unix_account__username", "user__email", "pk"
    )[:PICKER_LIMIT]
    candidates = []
    for membership in found:
        email = membership.user.email
        account = getattr(membership.user, "unix_account", None)
        username = account.username if account else ""
        candidates.append(
            Candidate(
                value=username or email,
                label=f"{username} ({email})" if username else email,
                problem=why_not_grantable(lab, membership),
            )
        )
    return candidates


def resolve_grantee(lab: Lab, typed: str):
    """The person ``typed`` names (their unix username or email, any case) who may be
    given access in ``lab``; ``NoMatch`` says who is missing and why."""
    typed = typed.strip()
    if not typed:
        raise NoMatch("Type a member's unix username or email address.")
    key = "user__email__iexact" if "@" in typed else "user__unix_account__username__iexact"
    membership = lab.memberships.select_related("user__unix_account").filter(**{key: typed}).first()
    if membership is None:
        raise NoMatch(f"No one in {lab.name} has the unix username or email address “{typed}”.")
    problem = why_not_grantable(lab, membership)
    if problem:
        raise NoMatch(problem)
    return membership.user


def vms(lab: Lab, *, name: str = "", zone: str = "", state: str = "", accelerator: str = ""):
    """The lab's TPU VMs whose name contains ``name``, in ``zone``, in ``state`` and of
    ``accelerator`` type (each ignored when empty), by name."""
    found = lab.vms.all()
    if name.strip():
        found = found.filter(name__icontains=name.strip())
    if zone:
        found = found.filter(zone=zone)
    if state == "missing":
        found = found.exclude(missing_since=None)
    elif state:
        found = found.filter(state=state, missing_since=None)
    if accelerator:
        found = found.filter(accelerator_type=accelerator)
    return found.order_by("name", "zone", "pk")


def vm_candidates(lab: Lab, q: str) -> list[TpuVm]:
    """Up to ``PICKER_LIMIT`` of the lab's TPU VMs (still listed by the API) whose name
    contains ``q``."""
    if not q.strip():
        return []
    return list(vms(lab, name=q).filter(missing_since=None)[:PICKER_LIMIT])


def resolve_vm(lab: Lab, typed: str) -> TpuVm:
    """The lab's TPU VM named ``typed`` (any case); ``NoMatch`` when there is none, it
    is gone from the Cloud TPU API, or the name is in several zones."""
    typed = typed.strip()
    if not typed:
        raise NoMatch("Type the name of one of the lab's TPU VMs.")
    found = list(lab.vms.filter(name__iexact=typed)[:2])
    if not found:
        raise NoMatch(f"{lab.name} has no TPU VM named “{typed}”.")
    if len(found) > 1:
        raise NoMatch(
            f"{lab.name} has a TPU VM named “{typed}” in more than one zone; "
            "give access from that VM's own page."
        )
    vm = found[0]
    if vm.missing_since is not None:
        raise NoMatch(f"{vm.name} is gone from the Cloud TPU API; access cannot be given to it.")
    return vm


@dataclass(frozen=True)
class Readiness:
    """How many of the lab's people can be given access now, and why the others not."""

    ready: int
    requested: int  # asked to join, waiting for an admin
    no_policy: int  # approved, but the lab's current policy not accepted
    no_username: int  # approved, but no unix username chosen
    no_key: int  # could be given access, but has no SSH key to log in with
    has_access: int = 0  # could be given access to the VM asked about, and has it

    @property
    def waiting(self) -> int:
        return self.requested + self.no_policy + self.no_username


def grant_readiness(lab: Lab) -> Readiness:
    """The counts, from the cache while nothing they depend on changed: the lab's
    memberships (how many, the latest change), its policy version and people's names
    and keys (``portal.people``). A hit costs one small indexed query; a miss adds the
    count over every membership, a few milliseconds at 5,000 people."""
    stamp = lab.memberships.aggregate(n=Count("pk"), last=Max("changed_at"))
    key = f"grant-readiness:{lab.pk}"
    found = cache.get_many([key, people.KEY])  # one round trip for both
    version = (stamp["n"], str(stamp["last"]), lab.policy_version, found.get(people.KEY, 0))
    cached = found.get(key)
    if cached is not None and cached[0] == version:
        return Readiness(*cached[1])
    readiness = count_readiness(lab)
    cache.set(key, (version, astuple(readiness)), READINESS_SECONDS)
    return readiness


def vm_readiness(lab: Lab, vm: TpuVm) -> Readiness:
    """``grant_readiness`` for giving access to ``vm``: those who hold access to it
    already (or are being given it: a grant pending, active or failed) are not among
    the members who *can be given* access, nor among those of them without a key;
    they are counted apart (``has_access``). One more aggregate query."""
    from accounts.models import SSHKey

    readiness = grant_readiness(lab)
    holding = Grant.objects.filter(user=OuterRef("user"), vm=vm, state__in=WANTED_STATES)
    held = (
        lab.memberships.filter(_approved() & _policy() & _named())
        .filter(Exists(holding))
        .annotate(has_key=Exists(SSHKey.objects.filter(user=OuterRef("user"))))
        .aggregate(n=Count("pk"), no_key=Count("pk", filter=Q(has_key=False)))
    )
    return replace(
        readiness,
        ready=max(readiness.ready - held["n"], 0),
        no_key=max(readiness.no_key - held["no_key"], 0),
        has_access=held["n"],
    )


def _approved() -> Q:
    return Q(state=Membership.State.APPROVED)


def _policy() -> Q:
    return Q(policy_version_accepted=F("lab__policy_version"))


def _named() -> Q:
    return Q(user__unix_account__isnull=False) & ~Q(user__unix_account__username="")


def count_readiness(lab: Lab) -> Readiness:
    """One aggregate query over the lab's memberships (fixed cost at any size)."""
    from accounts.models import SSHKey

    approved, policy, named = _approved(), _policy(), _named()
    has_key = Q(has_key=True)
    counts = lab.memberships.annotate(
        has_key=Exists(SSHKey.objects.filter(user=OuterRef("user")))
    ).aggregate(
        ready=Count("pk", filter=approved & policy & named),
        requested=Count("pk", filter=Q(state=Membership.State.REQUESTED)),
        no_policy=Count("pk", filter=approved & ~policy),
        no_username=Count("pk", filter=approved & policy & ~named),
        no_key=Count("pk", filter=approved & policy & named & ~has_key),
    )
    return Readiness(**counts)
