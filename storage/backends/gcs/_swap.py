"""Compare and swap on GCS (``storage.backends.swap``): the version is the generation
the GET answered (``X-Goog-Generation``); a replacement is one multipart upload
(``uploadType=multipart``, as gcsfs's ``pipe_file`` sends) carrying
``ifGenerationMatch`` with that generation (``0`` where there was no object). GCS
refuses it with 412 when the object's live generation is another, or when there is
none (for a generation) or one (for ``0``); a refusal is ``False``, nothing written.

The JSON API documents ``ifGenerationMatch`` on every ``objects.insert``; the upload is
multipart because fake-gcs-server, which the tests run on, enforces it there and
ignores it on media and resumable uploads. Removals are not swapped: fake-gcs-server
ignores ``ifGenerationMatch`` on deletes, so a conditional delete could not be checked
(``storage.backends.swap``).

A retried upload whose first attempt landed is refused too (the generation is now its
own): ``False``, so the caller reads the object again and finds its own write."""

from __future__ import annotations

import contextlib
import functools
import json
import urllib.parse
import uuid
from typing import TYPE_CHECKING

import gcsfs

from storage.backends.cancel import Cancel, current
from storage.backends.gcs import _compat as compat
from storage.backends.gcs._read import open_reader
from storage.backends.gcs._session import request, split

if TYPE_CHECKING:
    from storage.backends.gcs._filesystem import GCSFileSystem


def read_versioned(fs: GCSFileSystem, path: str, limit: int) -> tuple[bytes, str]:
    """One ranged GET, as ``read_bytes``, and the generation it answered."""
    length = fs._read_length(limit)
    errors = functools.partial(fs._errors, path)
    window = length or fs.part_size
    reader = open_reader(fs.fs, fs._getter(), path, 0, length, errors, window=window)
    with contextlib.closing(reader):
        return reader.read(), reader.version or ""


def replace_if(fs: GCSFileSystem, path: str, data: bytes, version: str | None) -> bool:
    """``data`` at ``path`` if its generation is still ``version`` (``None``: no
    object; ``""``, no generation answered: unconditionally)."""
    condition = "0" if version is None else version
    try:
        with fs._errors(path, "publishing"):
            Cancel(current()).run(fs.fs.loop, _insert, fs.fs, path, bytes(data), condition)
    except FileExistsError:  # gcsfs's reading of 412 Precondition Failed
        return False
    return True


async def _insert(gcs: gcsfs.GCSFileSystem, path: str, data: bytes, generation: str) -> None:
    bucket, key = split(path)
    boundary = f"dcp-{uuid.uuid4().hex}"
    metadata = json.dumps({"name": key})
    head = (
        f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{metadata}\r\n"
        f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    body = b"".join((head.encode(), data, f"\r\n--{boundary}--\r\n".encode()))
    params = {"uploadType": "multipart"}
    if generation:
        params["ifGenerationMatch"] = generation
    await request(
        gcs,
        "POST",
        f"{compat.location(gcs)}/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o",
        params=params,
        headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
        data=body,
    )
