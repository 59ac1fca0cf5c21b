"""Compare and swap on S3 (``storage.backends.swap``): the version is the ETag the GET
answered; the PUT carries ``If-Match`` (``If-None-Match: *`` where there was no object),
the DELETE ``If-Match``. A refused condition (412, a conflicting concurrent conditional
request, or no object left to match) is ``False``; a store that answers 501 to the
header gets the unconditional request, as before conditions were sent."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from storage.backends.s3._client import split_path
from storage.backends.s3._http import error_code
from storage.backends.s3._io import open_reader

if TYPE_CHECKING:
    from storage.backends.s3._filesystem import S3FileSystem

_REFUSED = ("PreconditionFailed", "412", "ConditionalRequestConflict")
_UNSUPPORTED = ("NotImplemented", "501")


def read_versioned(fs: S3FileSystem, path: str, limit: int) -> tuple[bytes, str]:
    """One ranged GET, as ``read_bytes``, and the ETag it answered."""
    length = fs._read_length(limit)
    reader = open_reader(fs.client, path, 0, length, window=length)
    with contextlib.closing(reader):
        return reader.readall(), reader.version or ""


def replace_if(fs: S3FileSystem, path: str, data: bytes, version: str | None) -> bool:
    """``data`` at ``path`` if its ETag is still ``version`` (``None``: no object)."""
    bucket, key = split_path(path)
    payload = bytes(data)
    condition = {"IfNoneMatch": "*"} if version is None else _matching(version)
    args = {"Bucket": bucket, "Key": key, "Body": payload, **fs.client.checksum_args(payload)}
    return _conditional(fs, "put_object", path, "publishing", condition, args)


def remove_if(fs: S3FileSystem, path: str, version: str) -> bool:
    """Delete ``path`` if its ETag is still ``version``."""
    bucket, key = split_path(path)
    args = {"Bucket": bucket, "Key": key}
    return _conditional(fs, "delete_object", path, "deleting", _matching(version), args)


def _matching(version: str) -> dict[str, str]:
    return {"IfMatch": version} if version else {}  # no ETag answered: nothing to match


def _conditional(
    fs: S3FileSystem,
    method: str,
    path: str,
    action: str,
    condition: dict[str, str],
    args: dict[str, Any],
) -> bool:
    try:
        fs._call(method, path, action, **condition, **args)
    except FileNotFoundError:
        return False  # If-Match of an object gone since (moto answers NoSuchKey)
    except OSError as exc:
        code = error_code(exc.__cause__ or exc)
        if code in _REFUSED:
            return False
        if code not in _UNSUPPORTED:
            raise
        fs._call(method, path, action, **args)
    return True
