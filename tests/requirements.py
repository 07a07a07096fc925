"""Tests that need something this machine may lack (root, a service, a browser) call
``need(...)``: outside CI they skip with the reason; with ``CI`` set they fail, because
CI must run every test."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in {"", "0", "false", "no"}


def need(condition: bool, reason: str) -> None:
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI must run this test, but: {reason}", pytrace=False)
    pytest.skip(reason)
