"""The portal's token API: one door, one ``httpx.Client`` with a timeout. Every error
becomes a ``CliError`` with the portal's own words and an exit code; an ended sign-in
says to log in again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx

from tpu_cli import __version__
from tpu_cli.errors import SIGNED_OUT, UNREACHABLE, ApiError, CliError

TIMEOUT = httpx.Timeout(30.0, connect=10.0)


def normal_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise CliError("Give the portal's address, such as https://tpu.example.edu.", 2)
    if "://" not in url:
        url = "https://" + url
    if not url.startswith(("http://", "https://")):
        raise CliError(f"{url} is not an http(s) address.", 2)
    return url


class Api:
    def __init__(self, url: str, token: str | None = None):
        self.url = normal_url(url)
        headers = {"User-Agent": f"tpu-cli/{__version__}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.token = token
        self.client = httpx.Client(base_url=self.url + "/api/v1", headers=headers, timeout=TIMEOUT)

    def close(self) -> None:
        self.client.close()

    def send(self, method: str, path: str, **kwargs) -> httpx.Response:
        """The answer to one request, retried a few times on 429 and 503 (a proxy or a
        restarting portal), honouring ``Retry-After``."""
        delay = 1.0
        for attempt in range(4):
            try:
                response = self.client.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise CliError(f"Cannot reach {self.url}: {exc}", UNREACHABLE) from None
            if response.status_code not in (429, 503) or attempt == 3:
                break
            wait = response.headers.get("Retry-After", "")
            time.sleep(float(wait) if wait.isdigit() else delay)
            delay = min(delay * 2, 30)
        if response.status_code == 401 and self.token:
            raise CliError(signed_out_message(self.url, response), SIGNED_OUT)
        if response.status_code >= 400:
            raise error_of(response)
        return response

    def get(self, path: str, **params) -> Any:
        return self.send("GET", path, params=params or None).json()

    def post(self, path: str, body: Any = None) -> Any:
        response = self.send("POST", path, json=body if body is not None else {})
        return response.json() if response.content else None

    def delete(self, path: str) -> None:
        self.send("DELETE", path)

    def text(self, path: str) -> str:
        return self.send("GET", path).text

    def pages(self, path: str, **params) -> Iterator[dict]:
        """Every row of a paged list, following ``next`` one page after another."""
        params.setdefault("limit", 200)
        page = self.get(path, **params)
        while True:
            yield from page["items"]
            if not page.get("next"):
                return
            page = self.send("GET", page["next"]).json()


def signed_out_message(url: str, response: httpx.Response) -> str:
    """Why the token stopped working: its lifetime ended (the portal says when), or it
    was revoked."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("error") == "token_expired":
        when = str(body.get("expired_at") or "")[:10] or "its end date"
        return f"Your login to {url} expired on {when}; run `tpu login` again."
    return f"Your sign-in to {url} has ended; run `tpu login` again."


def error_of(response: httpx.Response) -> CliError:
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = ""
    errors = {}
    if isinstance(body, dict):
        errors = body.get("errors") or {}
        raw = body.get("detail")
        if isinstance(raw, str):
            detail = raw
        elif isinstance(raw, list):  # a 422: [{"loc": [...], "msg": "..."}]
            detail = "; ".join(
                f"{'.'.join(str(p) for p in item.get('loc', [])[1:])}: {item.get('msg')}"
                for item in raw
                if isinstance(item, dict)
            )
    if not detail:
        detail = f"The portal answered {response.status_code} {response.reason_phrase}."
    error = ApiError(response.status_code, detail, errors if isinstance(errors, dict) else {})
    # RFC 8628's answers while a device code waits: {"error": "authorization_pending"}.
    code = body.get("error") if isinstance(body, dict) else None
    error.error_code = code if isinstance(code, str) else ""
    return error
