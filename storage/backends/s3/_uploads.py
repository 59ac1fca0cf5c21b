"""Incomplete multipart uploads under a prefix: listed page by page, and aborted
(``S3FileSystem.pending_uploads`` / ``abort_upload``, what ``dcp-storage gc
--abort-uploads`` runs)."""

from __future__ import annotations

import logging
from typing import Any

from extensions.errors import printable
from storage.backends.base import PendingUpload
from storage.backends.s3._client import S3Client, split_path
from storage.backends.s3._http import error_code

log = logging.getLogger(__name__)


def next_page(marker: object, seen: set[object], path: str) -> Any:
    """``marker``, where a truncated listing of ``path`` goes on from: refused when the
    store gave none or one it gave before (no progress: listing on would never end, and
    what a page lists would pile up without end)."""
    if marker is None or marker == "" or marker in seen:
        what = "no" if marker is None or marker == "" else "an already used"
        raise OSError(
            f"s3://{path}: the store answered a truncated listing with {what} marker to go on "
            "from; refusing to list on (the listing would not end): check the store"
        )
    seen.add(marker)
    return marker


def pending(client: S3Client, path: str) -> list[PendingUpload]:
    """Every incomplete multipart upload under ``path``, oldest first."""
    bucket, key = split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    found: list[PendingUpload] = []
    strays: list[str] = []
    markers: dict[str, Any] = {}
    seen: set[object] = set()
    while True:
        page = client.call(
            "list_multipart_uploads",
            path,
            "listing incomplete multipart uploads",
            Bucket=bucket,
            Prefix=prefix,
            **markers,
        )
        for upload in page.get("Uploads", []):
            key = upload["Key"]
            if not _under(key, prefix):  # another's upload: never ours to abort
                strays.append(key)
                continue
            stamp = upload.get("Initiated")
            started = float(stamp.timestamp()) if stamp is not None else None
            found.append(PendingUpload(f"{bucket}/{key}", upload["UploadId"], started))
        if not page.get("IsTruncated"):
            break
        key_marker, upload_marker = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
        next_page((key_marker, upload_marker) if key_marker else None, seen, path)
        markers = {"KeyMarker": key_marker, "UploadIdMarker": upload_marker or ""}
    if strays:
        log.warning(
            "s3://%s: the listing of incomplete uploads named %d key(s) that are not under "
            "it, left out (the store or a proxy answers listings wrongly): %s",
            path,
            len(strays),
            printable(repr(strays[:3]), 200),
        )
    return sorted(found, key=lambda u: (u.started is None, u.started or 0.0, u.path))


def _under(key: object, prefix: str) -> bool:
    """Whether ``key`` names an object under ``prefix`` (no ``.`` or ``..`` part after it)."""
    if not isinstance(key, str) or not key.startswith(prefix):
        return False
    return not any(part in (".", "..") for part in key[len(prefix) :].split("/"))


def abort(client: S3Client, upload: PendingUpload) -> None:
    """Abort ``upload``; one that completed or was aborted meanwhile is no error."""
    bucket, key = split_path(upload.path)
    try:
        client.call(
            "abort_multipart_upload",
            upload.path,
            "aborting an incomplete multipart upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload.upload_id,
        )
    except OSError as exc:
        gone = isinstance(exc, FileNotFoundError) or error_code(exc) == "NoSuchUpload"
        if not gone:
            raise
