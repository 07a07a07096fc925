"""A token whose lifetime ended: the portal answers `token_expired` with the date, and
every `tpu` command says the login expired then and to run `tpu login` again, ending
with the signed-out exit code."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

from django.utils import timezone

from accounts.models import ApiToken
from accounts.services import create_token

TPU = str(Path(sys.executable).parent / "tpu")


def _signed_in_laptop(home: Path, url: str, token: str) -> dict:
    config = home / ".config" / "tpu-portal"
    config.mkdir(parents=True, mode=0o700)
    saved = {"url": url, "token": token, "email": "milo@uni.example"}
    (config / "credentials.json").write_text(json.dumps(saved))
    (config / "credentials.json").chmod(0o600)
    return {"PATH": os.environ["PATH"], "HOME": str(home), "no_proxy": "127.0.0.1,localhost"}


def test_the_client_says_when_its_login_expired(live_server, make_user, tmp_path):
    milo = make_user("milo@uni.example", password="a long passphrase 42")
    token, raw = create_token(milo, "milo-laptop")
    env = _signed_in_laptop(tmp_path, live_server.url, raw)
    works = subprocess.run([TPU, "ls"], env=env, capture_output=True, text=True, timeout=60)
    assert works.returncode == 0, works.stderr

    ended = timezone.now() - dt.timedelta(hours=1)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=ended)
    lapsed = subprocess.run([TPU, "ls"], env=env, capture_output=True, text=True, timeout=60)
    assert lapsed.returncode == 3
    assert (
        f"Your login to {live_server.url} expired on {ended.date().isoformat()}; "
        "run `tpu login` again." in lapsed.stderr
    )


def test_a_revoked_token_still_reads_as_an_ended_sign_in(live_server, make_user, tmp_path):
    milo = make_user("milo@uni.example", password="a long passphrase 42")
    token, raw = create_token(milo, "milo-laptop")
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    env = _signed_in_laptop(tmp_path, live_server.url, raw)
    ended = subprocess.run([TPU, "ls"], env=env, capture_output=True, text=True, timeout=60)
    assert ended.returncode == 3
    assert "has ended; run `tpu login` again." in ended.stderr
