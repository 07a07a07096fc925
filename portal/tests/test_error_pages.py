"""Error pages use the site's layout, say what happened and where to go next."""

from __future__ import annotations

import logging

from django.test import Client
from django.urls import reverse


def test_a_404_is_a_page_of_the_site_with_a_way_on(client, db):
    response = client.get("/no/such/page/")
    assert response.status_code == 404
    body = response.content.decode()
    assert 'class="topbar"' in body and "Nothing here" in body
    assert reverse("account_login") in body


def test_a_403_shows_its_reason_without_a_traceback_in_the_log(client, cast, caplog):
    caplog.set_level(logging.WARNING, logger="django.request")
    client.force_login(cast.member)
    response = client.get(reverse("lab_admin", args=[cast.lab.slug]))
    assert response.status_code == 403
    body = response.content.decode()
    assert "Only the lab&#x27;s admins can do that." in body and 'class="topbar"' in body
    [record] = [r for r in caplog.records if r.name == "django.request"]
    assert record.exc_info is None and "Traceback" not in caplog.text


def test_a_500_is_a_page_of_the_site(db, settings):
    from django.urls import include, path

    def broken(request):
        raise RuntimeError("boom")

    urls = [path("boom/", broken), path("", include("portal.urls"))]
    settings.ROOT_URLCONF = type("urls", (), {"urlpatterns": urls})
    response = Client(raise_request_exception=False).get("/boom/")
    assert response.status_code == 500
    body = response.content.decode()
    assert "Something went wrong on our side" in body and "boom" not in body


def test_browsers_asking_for_favicon_ico_get_the_icon(client, db):
    response = client.get("/favicon.ico")
    assert response.status_code == 301 and response["Location"].endswith(".svg")


def test_the_500_page_needs_no_static_files_even_when_their_manifest_is_missing(
    db, settings, tmp_path
):
    settings.STATIC_ROOT = tmp_path / "static"  # collectstatic never ran here
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
    }
    # The sign-in page links the stylesheet through the manifest: it cannot render.
    response = Client(raise_request_exception=False).get(reverse("account_login"))
    assert response.status_code == 500
    body = response.content.decode()
    assert "Something went wrong on our side" in body
    assert "<style>" in body and "/static/" not in body
