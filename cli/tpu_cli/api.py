"""The portal's token API: one door, one ``httpx.Client`` with a timeout. Every error
becomes a ``CliError`` with the portal's own words and an exit code; an ended sign-in
says to log in again."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise CliError(f"{url} is not a web address the client can use.", 2) from None
    if not host or any(ch.isspace() or ord(ch) < 0x20 for ch in url) or parts.query:
        raise CliError(f"{url} is not a web address the client can use.", 2)
    if parts.scheme == "http" and not is_loopback(host):
        secure = "https" + url[len("http") :]
        raise CliError(
            f"{url} is not encrypted: your token and the addresses and host keys of your TPU "
            f"VMs would cross the network for anyone to read or change. Use {secure} (plain "
            "http only for a portal on this machine: localhost, 127.0.0.1, ::1).",
            2,
        )
    return url


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1: a portal on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin(url: httpx.URL | str) -> tuple:
    url = httpx.URL(str(url))
    return (url.scheme, url.host, url.port or {"http": 80, "https": 443}.get(url.scheme))


def portal_of(target: httpx.URL) -> str:
    """The portal's address in a URL of its API (what comes before ``/api/v1/``)."""
    at = target.path.find("/api/v1")
    prefix = target.path[:at] if at >= 0 else ""
    return f"{target.scheme}://{target.netloc.decode()}{prefix}".rstrip("/")


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

    def send(
        self,
        method: str,
        path: str,
        *,
        file: Path | None = None,
        chunks: Callable[[], Iterator[bytes]] | None = None,
        **kwargs,
    ) -> httpx.Response:
        """The answer to one request, retried a few times on 429 and 503 (a proxy or a
        restarting portal), honouring ``Retry-After``. ``file``: the body, streamed
        from disk (opened again for each try); ``chunks``: the body as it is made, a
        new one for each try."""
        delay = 1.0
        for attempt in range(4):
            try:
                if chunks is not None:
                    response = self._followed(method, path, content=chunks(), **kwargs)
                elif file is None:
                    response = self._followed(method, path, **kwargs)
                else:
                    with open(file, "rb") as body:
                        response = self._followed(method, path, content=body, **kwargs)
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

    def _followed(self, method: str, path: str, **kwargs) -> httpx.Response:
        """The answer to one request, after the portal's redirects within its own origin
        (``/me`` to ``/me/``; a GET, or a 307/308 that keeps the method and body). A
        redirect elsewhere, over http, or of a POST that would become a GET is not
        followed (the token would go with it): the person is told where it points."""
        response = self.client.request(method, path, **kwargs)
        for _ in range(5):
            if not response.is_redirect:
                return response
            target = response.request.url.join(response.headers["Location"])
            same = origin(target) == origin(self.url)
            keeps = method == "GET" or response.status_code in (307, 308)
            if not same or not keeps:
                where = portal_of(target)
                raise CliError(
                    f"The portal at {self.url} redirects to {target}; use {where} as the "
                    f"portal address (tpu login {where}).",
                    UNREACHABLE,
                )
            response = self.client.request(method, target, **kwargs)
        raise CliError(f"The portal at {self.url} redirects in a loop.", UNREACHABLE)

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("Content-Type", "no type").split(";")[0]
            raise CliError(
                f"{self.url} answered {response.request.url.path} with something that is not "
                f"the portal's API ({kind}, not JSON): is {self.url} the portal's address?",
                UNREACHABLE,
            ) from None

    def get(self, path: str, **params) -> Any:
        return self._json(self.send("GET", path, params=params or None))

    def post(self, path: str, body: Any = None) -> Any:
        response = self.send("POST", path, json=body if body is not None else {})
        return self._json(response) if response.content else None

    def put_file(self, path: str, file: Path) -> Any:
        """PUT a file's bytes as they are (``application/octet-stream``), read from disk
        in chunks as they go, never whole into memory."""
        headers = {"Content-Type": "application/octet-stream"}
        response = self.send("PUT", path, file=file, headers=headers)
        return self._json(response) if response.content else None

    def post_chunks(self, path: str, chunks: Callable[[], Iterator[bytes]], length: int) -> Any:
        """POST a body of ``length`` bytes made as it goes (``application/octet-stream``),
        never whole in memory."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}
        response = self.send("POST", path, chunks=chunks, headers=headers)
        return self._json(response) if response.content else None

    def delete(self, path: str) -> None:
        self.send("DELETE", path)

    def text(self, path: str) -> str:
        return self.send("GET", path).text

    def pages(self, path: str, **params) -> Iterator[dict]:
        """Every row of a paged list, following ``next`` one page after another."""
        params.setdefault("limit", 200)
        page = self.get(path, **params)
        while True:
            if not isinstance(page, dict) or not isinstance(page.get("items"), list):
                raise CliError(f"{self.url} answered {path} with something that is not a "
                               "list of the portal's API.", UNREACHABLE)  # fmt: skip
            yield from page["items"]
            if not page.get("next"):
                return
            # The next page on this portal's own origin whatever host the link names (a
            # portal behind a proxy may write http://): the token goes nowhere else.
            link = httpx.URL(str(page["next"]))
            here = httpx.URL(self.url)
            page = self._json(self.send("GET", here.copy_with(path=link.path, query=link.query)))


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
    error.body = body if isinstance(body, dict) else {}
    # RFC 8628's answers while a device code waits: {"error": "authorization_pending"}.
    code = body.get("error") if isinstance(body, dict) else None
    error.error_code = code if isinstance(code, str) else ""
    return error
