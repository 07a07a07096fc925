from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from accounts.usernames import (
    RESERVED_USERNAMES,
    is_reserved,
    normalise,
    suggest_username,
    validate_unix_username,
)


def refusal(name: str, **kwargs) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate_unix_username(name, **kwargs)
    return info.value


def rendered(error: ValidationError) -> str:
    return error.messages[0]


# (name, code, words the message must use)
REFUSED = [
    ("", "required", "Choose a username"),
    ("Milo", "uppercase", "“milo”"),
    ("MILO", "uppercase", "“milo”"),
    ("Milo_Smith", "uppercase", "lowercase"),
    ("1milo", "start_letter", "“1”"),
    ("-rf", "start_letter", "“-”"),
    ("_apt", "start_letter", "“_”"),
    (" milo", "start_letter", "a space"),
    ("émile", "start_letter", "U+00E9"),
    ("milo.smith", "invalid_character", "Use a hyphen"),
    ("milo_smith", "invalid_character", "Use a hyphen"),
    ("milo smith", "invalid_character", "a space"),
    ("milo;rm", "invalid_character", "“;”"),
    ("milo/../root", "invalid_character", "“/”"),
    ("milo\n", "invalid_character", "U+000A"),
    ("milo\x00", "invalid_character", "U+0000"),
    ("milö", "invalid_character", "U+00F6"),
    ("mi\u200blo", "invalid_character", "U+200B"),
    ("a" * 32, "too_long", "at most 31 characters long (this one has 32)"),
    ("milo-", "trailing_hyphen", "cannot end with a hyphen"),
    ("pc01$", "machine_account", "machine accounts"),
    ("root", "reserved", "“root”"),
    ("daemon", "reserved", "system"),
    ("nobody", "reserved", "system"),
    ("nogroup", "reserved", "system"),
    ("sudo", "reserved", "system"),
    ("adm", "reserved", "system"),
    ("www-data", "reserved", "system"),
    ("sshd", "reserved", "system"),
    ("ubuntu", "reserved", "system"),
    ("admin", "reserved", "system"),
    ("google-sudoers", "reserved", "system"),
    ("systemd-network", "reserved", "system"),
    ("systemd-anything-new", "reserved", "system"),
    ("docker", "reserved", "system"),
    ("postgres", "reserved", "system"),
    ("kvm", "reserved", "system"),
    ("ec2-user", "reserved", "system"),
    ("tpu-portal", "reserved", "portal"),
]


def test_there_are_enough_refused_usernames_to_trust_the_rules():
    assert len(REFUSED) >= 30


@pytest.mark.parametrize(
    ("name", "code", "fragment"), REFUSED, ids=[r[0] or "empty" for r in REFUSED]
)
def test_each_unsuitable_username_is_refused_with_the_rule_it_breaks(name, code, fragment):
    error = refusal(name)
    assert error.code == code
    assert fragment in rendered(error)


@pytest.mark.parametrize(
    "name", ["milo", "m", "milo-smith", "ms2", "a" * 31, "m-1-2", "rooty", "admins", "test"]
)
def test_ordinary_usernames_are_accepted(name):
    validate_unix_username(name)


def test_the_portal_admin_account_from_settings_is_reserved(settings):
    settings.PORTAL_ADMIN_SSH_USER = "tpuadmin"
    assert refusal("tpuadmin").code == "reserved"


def test_the_portal_admin_account_defaults_to_admin(settings):
    if hasattr(settings, "PORTAL_ADMIN_SSH_USER"):
        del settings.PORTAL_ADMIN_SSH_USER
    assert is_reserved("admin")


def test_callers_can_reserve_names_the_hosts_already_use():
    assert refusal("labbot", extra_reserved=["LabBot"]).code == "reserved"
    validate_unix_username("labbot", extra_reserved=["otherbot"])


def test_reserved_names_are_matched_ignoring_case():
    assert is_reserved("ROOT") and is_reserved(" Ubuntu ")


def test_the_reserved_list_includes_every_debian_base_user_and_group():
    base = (
        "root daemon bin sys sync games man lp mail news uucp proxy www-data backup list "
        "irc gnats nobody adm tty disk kmem dialout fax voice cdrom floppy tape sudo audio "
        "dip operator src shadow utmp video sasl plugdev staff users nogroup _apt"
    ).split()
    assert set(base) <= RESERVED_USERNAMES


def test_the_reserved_list_is_lowercase_so_lookups_can_normalise():
    assert all(name == name.lower() for name in RESERVED_USERNAMES)


def test_normalise_lowercases_and_trims_for_case_insensitive_comparison():
    assert normalise("  Milo-Smith ") == "milo-smith"
    assert normalise("milo") == normalise("MILO")


# --- suggestions from key comments ---------------------------------------------------

SUGGESTIONS = [
    ("milo@laptop", "milo"),
    ("Milo.Smith@MacBook-Pro.local", "milo-smith"),
    ("milo_smith@host", "milo-smith"),
    ("CORP\\José@DESKTOP-1", "jose"),
    ("  milo  ", "milo"),
    ("Milo Smith's key", "milo"),
    ("42milo@x", "milo"),
    ("root@tpu-vm", "root2"),
    ("ubuntu@ip-10-0-0-1", "ubuntu2"),
    ("a" * 40 + "@h", "a" * 31),
    ("milo--@h", "milo"),
]


@pytest.mark.parametrize(("comment", "expected"), SUGGESTIONS)
def test_a_username_is_suggested_from_the_key_comment(comment, expected):
    assert suggest_username(comment) == expected


@pytest.mark.parametrize(
    "comment",
    ["", "   ", "@laptop", "1234@host", "---", "王小明@pc", "rsa-key-20240101", "systemd-x@h"],
)
def test_no_suggestion_when_nothing_sensible_can_be_made(comment):
    assert suggest_username(comment) is None


def test_a_suggestion_avoids_names_the_caller_reserves():
    assert suggest_username("milo@laptop", extra_reserved=["milo"]) == "milo2"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_every_suggestion_is_a_valid_username(comment):
    suggestion = suggest_username(comment)
    if suggestion is not None:
        validate_unix_username(suggestion)
