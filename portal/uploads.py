"""Uploads are refused at a size limit before they are read whole or written to disk.

Django keeps small uploads in memory and writes big ones to a temporary file as they
arrive. ``CappedUploadHandler`` comes first in ``FILE_UPLOAD_HANDLERS``, so it sees
every chunk before the handlers that store it:

- a multipart body whose ``Content-Length`` is over the file limit plus the room Django
  allows for ordinary form fields is refused up front (400) without reading it;
- a file that grows past ``PORTAL_UPLOAD_MAX_BYTES`` is dropped at the first chunk
  that crosses the limit, the rest of it is read and discarded, and the form learns
  which field was refused from ``refused_uploads(request)``.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.files.uploadhandler import FileUploadHandler, SkipFile


def upload_limit() -> int:
    """The most bytes one uploaded file may have."""
    return settings.PORTAL_UPLOAD_MAX_BYTES


def body_limit() -> int | None:
    """The largest multipart body worth reading at all, or None when form fields are
    not capped (``DATA_UPLOAD_MAX_MEMORY_SIZE = None``)."""
    fields = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return None if fields is None else upload_limit() + fields


def refused_uploads(request) -> dict[str, int]:
    """Field name → the limit its file was refused at, for this request."""
    return getattr(request, "_refused_uploads", {})


def kib(size: int) -> str:
    return f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} bytes"


class CappedUploadHandler(FileUploadHandler):
    def handle_raw_input(self, input_data, META, content_length, boundary, encoding=None):
        limit = body_limit()
        if limit is not None and content_length > limit:
            # Answered as 400 by Django, before a byte of the body is read.
            raise RequestDataTooBig(
                f"The upload is larger than {kib(upload_limit())}; nothing was read."
            )
        return None  # let Django parse it, chunk by chunk, through this handler

    def new_file(self, field_name, file_name, content_type, content_length, charset=None,
                 content_type_extra=None):  # fmt: skip
        super().new_file(
            field_name, file_name, content_type, content_length, charset, content_type_extra
        )
        if content_length is not None and content_length > upload_limit():
            self._refuse()

    def receive_data_chunk(self, raw_data, start):
        if start + len(raw_data) > upload_limit():
            self._refuse()
        return raw_data

    def file_complete(self, file_size):
        return None  # the handlers after this one store the file

    def _refuse(self):
        if self.request is not None:
            refused = dict(refused_uploads(self.request))
            refused[self.field_name] = upload_limit()
            self.request._refused_uploads = refused
        # Django closes (and so deletes) what later handlers started and discards the
        # rest of this file as it arrives.
        raise SkipFile
