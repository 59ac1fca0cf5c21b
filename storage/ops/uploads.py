"""Uploads that interrupted saves left behind under a root.

A save killed in the middle of a multipart upload (S3) leaves the upload open: its
parts are stored and billed, yet no listing of objects shows them, so neither the
commit protocol's cleanup nor the manager's sees them. :func:`stale_uploads` finds
those of checkpoint files under a root that began more than a grace period ago (choose
more than your longest save, as for ``cleanup``) and, when asked, aborts them; a
bucket lifecycle rule (``AbortIncompleteMultipartUpload``) does the same on a timer.
Backends without such uploads have none to list (``FileSystemBase.pending_uploads``).

The store's date of an upload is not trusted alone (moto dates every one 2010-11-10):
an upload in a checkpoint directory where a writer's heartbeat is live (``heartbeat``:
every save, ``cp`` and drain keeps one while it writes) is never stale, however old
the store says it is. The uploads of safetensors model files (an export, a
``SafetensorsWriter`` save, killed mid-upload) are listed too; no heartbeat is kept
beside them, so the store's date is all there is: on a store that misdates uploads, do
not abort uploads under a model folder being written.
"""

from __future__ import annotations

import posixpath
import time

from storage.backends.base import FileSystemBase, PendingUpload
from storage.checkpoint import heartbeat
from storage.checkpoint.layout import is_checkpoint_file_name
from storage.checkpoint.prefixes import is_prefix
from storage.checkpoint.safetensors.staging import is_model_file_name, is_staging_object


def stale_uploads(
    fs: FileSystemBase, root: str, grace_seconds: float, *, abort: bool = False
) -> list[PendingUpload]:
    """The uploads of checkpoint files (and of safetensors model files and a
    consolidating safetensors save's staging objects) under ``root`` begun more than
    ``grace_seconds``
    ago and never completed, oldest first, except those in a directory with a live
    heartbeat (see the module docstring); with ``abort``, each is aborted. An upload
    whose start the store does not report is never counted as stale."""
    if not isinstance(grace_seconds, (int, float)) or grace_seconds < 0:
        raise ValueError(f"grace_seconds must be a number >= 0, got {grace_seconds!r}")
    horizon = time.time() - grace_seconds
    live: dict[str, bool] = {}

    def written_now(path: str) -> bool:
        directory = posixpath.dirname(path)
        # The checkpoint's directory, and the one above in case this is a key prefix's.
        places = [directory]
        if is_prefix(posixpath.basename(directory)):
            places.append(posixpath.dirname(directory))
        for place in places:
            if place not in live:
                live[place] = bool(heartbeat.live(fs, place, grace_seconds)[0])
        return any(live[p] for p in places)

    stale = [
        upload
        for upload in fs.pending_uploads(root)
        if upload.started is not None
        and upload.started < horizon
        and (
            is_checkpoint_file_name(posixpath.basename(upload.path))
            or is_staging_object(upload.path)
            or is_model_file_name(posixpath.basename(upload.path))  # an export's, a save's
        )
        and not written_now(upload.path)
    ]
    if abort:
        for upload in stale:
            fs.abort_upload(upload)
    return stale
