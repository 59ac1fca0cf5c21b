"""Uploads that interrupted saves left behind under a root.

A save killed in the middle of a multipart upload (S3) leaves the upload open: its
parts are stored and billed, yet no listing of objects shows them, so neither the
commit protocol's cleanup nor the manager's sees them. :func:`stale_uploads` finds
those of checkpoint files under a root that began more than a grace period ago (choose
more than your longest save, as for ``cleanup``) and, when asked, aborts them; a
bucket lifecycle rule (``AbortIncompleteMultipartUpload``) does the same on a timer.
Backends without such uploads have none to list (``FileSystemBase.pending_uploads``).
"""

from __future__ import annotations

import posixpath
import time

from storage.backends.base import FileSystemBase, PendingUpload
from storage.checkpoint.layout import is_checkpoint_file_name


def stale_uploads(
    fs: FileSystemBase, root: str, grace_seconds: float, *, abort: bool = False
) -> list[PendingUpload]:
    """The uploads of checkpoint files under ``root`` begun more than ``grace_seconds``
    ago and never completed, oldest first; with ``abort``, each is aborted. An upload
    whose start the store does not report is never counted as stale."""
    if not isinstance(grace_seconds, (int, float)) or grace_seconds < 0:
        raise ValueError(f"grace_seconds must be a number >= 0, got {grace_seconds!r}")
    horizon = time.time() - grace_seconds
    stale = [
        upload
        for upload in fs.pending_uploads(root)
        if upload.started is not None
        and upload.started < horizon
        and is_checkpoint_file_name(posixpath.basename(upload.path))
    ]
    if abort:
        for upload in stale:
            fs.abort_upload(upload)
    return stale
