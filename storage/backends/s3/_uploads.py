"""Incomplete multipart uploads under a prefix: listed page by page, and aborted
(``S3FileSystem.pending_uploads`` / ``abort_upload``, what ``dcp-storage gc
--abort-uploads`` runs)."""

from __future__ import annotations

from typing import Any

from storage.backends.base import PendingUpload
from storage.backends.s3._client import S3Client, split_path
from storage.backends.s3._http import error_code


def pending(client: S3Client, path: str) -> list[PendingUpload]:
    """Every incomplete multipart upload under ``path``, oldest first."""
    bucket, key = split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    found: list[PendingUpload] = []
    markers: dict[str, Any] = {}
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
            stamp = upload.get("Initiated")
            started = float(stamp.timestamp()) if stamp is not None else None
            found.append(PendingUpload(f"{bucket}/{upload['Key']}", upload["UploadId"], started))
        if not page.get("IsTruncated"):
            break
        markers = {
            "KeyMarker": page["NextKeyMarker"],
            "UploadIdMarker": page["NextUploadIdMarker"],
        }
    return sorted(found, key=lambda u: (u.started is None, u.started or 0.0, u.path))


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
