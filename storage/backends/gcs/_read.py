"""GCS reads: the source of the shared object reader (``_object_read``): ranged GETs
pinned to the object's generation, through the direct path (``_direct``) where the
client's configuration allows it, else through gcsfs's session
(``_session.StreamedGet``); the reader does not care which."""

from __future__ import annotations

import contextlib

import gcsfs
from gcsfs.retry import validate_response

from storage.backends._object_read import Errors, ObjectReader, Opened, VersionGone
from storage.backends.cancel import Cancel
from storage.backends.gcs._session import Get, policy


class GCSObject:
    """One GCS object as the reader's source: every GET is one attempt (the reader
    retries opening it as gcsfs retries requests, :func:`_session.policy`); a version
    is a generation; errors read as the filesystem's ``errors`` says."""

    backend = "gcs"

    def __init__(self, gcs: gcsfs.GCSFileSystem, get: Get, path: str, errors: Errors) -> None:
        self._get = get
        self._path = path
        self.url = f"gs://{path}"
        self.retry = policy(gcs)
        self._errors = errors

    def errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return self._errors(action)

    def get(
        self, first: int | None, last: int | None, version: str | None, cancel: Cancel
    ) -> Opened | None:
        answer = self._get(self._path, first, last, version, cancel)
        if answer.status == 416:  # the range starts past the end
            answer.close()
            return None
        if answer.status == 404 and version is not None:
            answer.close()
            raise VersionGone
        if answer.status >= 400:
            validate_response(answer.status, answer.error_body(), self._path)
        return Opened(
            status=answer.status,
            content_range=answer.header("Content-Range"),
            version=answer.header("X-Goog-Generation"),
            body=answer,
            encoding=answer.encoding,
        )


def open_reader(
    gcs: gcsfs.GCSFileSystem,
    get: Get,
    path: str,
    offset: int,
    length: int | None,
    errors: Errors,
    *,
    window: int,
) -> ObjectReader:
    """``[offset, offset + length)`` of ``path`` (``length=None``: to its end) in windows
    of ``window`` bytes, its first GET sent (a missing object fails here)."""
    return ObjectReader.opened(GCSObject(gcs, get, path, errors), offset, length, window=window)
