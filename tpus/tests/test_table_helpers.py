"""What long tables use instead of a ``{% url %}`` and a ``get_FOO_display`` a row
gives the same text."""

from __future__ import annotations

import pytest
from django.template import Context, Template
from django.urls import NoReverseMatch, reverse

from tpus.models import Membership, TpuVm


def _render(text: str, **context) -> str:
    return Template("{% load tpus_extras %}" + text).render(Context(context))


@pytest.mark.parametrize(
    ("viewname", "args"),
    [
        ("vm_detail", ["vision"]),
        ("member_grant", ["vision"]),
        ("membership_approve", ["lab-7654321"]),
        ("membership_reject", ["0"]),
    ],
)
@pytest.mark.parametrize("pk", [1, 7654321, 40001])
def test_a_row_url_is_the_url_reverse_makes(viewname, args, pk):
    rendered = _render(
        "{% row_url viewname slug as row %}{{ row|with_pk:pk }}",
        viewname=viewname,
        slug=args[0],
        pk=pk,
    )
    assert rendered == reverse(viewname, args=[*args, pk])


def test_a_row_url_needs_a_view_that_takes_a_primary_key_last():
    with pytest.raises(NoReverseMatch):
        _render('{% row_url "lab_admin" "vision" %}')


@pytest.mark.parametrize("state", [*TpuVm.State.values, "SOMETHING_NEW"])
@pytest.mark.parametrize("health", [*TpuVm.Health.values, "SOMETHING_NEW"])
def test_a_vm_label_is_what_get_display_gives(state, health):
    vm = TpuVm(state=state, health=health)
    assert _render('{{ vm.state|label:"node_state" }}', vm=vm) == vm.get_state_display()
    assert _render('{{ vm.health|label:"node_health" }}', vm=vm) == vm.get_health_display()


@pytest.mark.parametrize("role", Membership.Role.values)
@pytest.mark.parametrize("state", Membership.State.values)
def test_a_membership_label_is_what_get_display_gives(role, state):
    row = {"role": role, "state": state}  # as the member list reads it, with values()
    membership = Membership(role=role, state=state)
    assert _render('{{ m.role|label:"role" }}', m=row) == membership.get_role_display()
    assert _render('{{ m.state|label:"membership_state" }}', m=row) == (
        membership.get_state_display()
    )


@pytest.mark.parametrize(
    ("model", "field", "choices"),
    [("Grant", "state", "grant_state"), ("Job", "state", "job_state"),
     ("Worker", "host_keys_source", "host_keys_source")],
)  # fmt: skip
def test_the_access_jobs_and_workers_labels_are_what_get_display_gives(model, field, choices):
    from tpus import models

    cls = getattr(models, model)
    values = [value for value, _ in cls._meta.get_field(field).choices]
    assert values
    for value in values:
        row = cls(**{field: value})
        shown = getattr(row, f"get_{field}_display")()
        assert _render("{{ v|label:name }}", v=value, name=choices) == shown
