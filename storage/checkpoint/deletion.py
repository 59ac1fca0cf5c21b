"""Deleting checkpoint files: the rules of docs/format.md, "What deletion trusts".

Deletion trusts neither the metadata nor the directory. A file is removed only if its
name is a data file name (``layout.is_data_file_name``), whatever the metadata claims; a
committed checkpoint loses only the data files its metadata names (never those of a save
in flight), read through the one read model (``committed``): the files of metadata that
cannot be read stay for ``gc``. Nothing is deleted through a symbolic link: not a linked
checkpoint directory (:func:`refuse_link`), not a linked key-prefix directory inside one
(``prefixes.is_linked``, the check every read, write and copy path makes too). Those
checks give a clear refusal before anything is removed; every removal itself then goes
through ``rm_file_in``/``rm_dir_in``/``rename_in`` under the checkpoint directory, which
on local disk never follows a link at the checkpoint directory or below it, so a link
swapped in after the checks makes the removal fail, never land outside the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import re
import uuid
from collections.abc import Callable

from extensions.errors import UnsafeCheckpointError, quote
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.committed import CommittedCheckpoint, open_committed
from storage.checkpoint.latest import withdraw as withdraw_latest
from storage.checkpoint.layout import is_checkpoint_file_name, is_data_file_name, is_metadata_name
from storage.checkpoint.prefixes import expand, linked_prefix, remove_empty_prefixes

log = logging.getLogger(__name__)

#: A metadata file moved aside while a deletion decides (:func:`delete_checkpoint`);
#: group 1 is its own name.
MOVED_ASIDE = re.compile(r"((?:__[0-9]+)?\.metadata)\.tmp-del[0-9a-f]{12}")


def refuse_link(fs: FileSystemBase, path: str) -> None:
    """Raise :class:`UnsafeCheckpointError` if ``path`` is a symbolic link: a linked
    checkpoint belongs to someone else (a shared pretrained one, say) and deleting
    through the link would remove its files."""
    if fs.is_link(path):
        raise UnsafeCheckpointError(
            f"{fs.url(path)} is a symbolic link to a checkpoint elsewhere; it is never "
            "deleted through the link (remove the link itself if it is no longer wanted)"
        )


def delete_checkpoint(
    fs: FileSystemBase,
    path: str,
    checkpoint: CommittedCheckpoint | None = None,
    *,
    recheck: Callable[[], object] | None = None,
) -> list[str]:
    """Delete the committed checkpoint at ``path`` (``checkpoint``: its read model, if
    the caller already opened it).

    Its metadata files are removed first (so the directory stops being a checkpoint at
    once), then the data files they named. Data files no metadata named (a save in
    flight, leftovers of a failed one) stay for :func:`remove_leftovers` after a grace
    period; so do files that are not checkpoint files, and the files of a metadata that
    cannot be read. The directory goes once empty; a latest-step pointer beside it that
    names it goes too (``latest.withdraw``). Refuses, before removing anything, a
    checkpoint that is a symbolic link (:func:`refuse_link`) or whose named files lie
    under a linked prefix directory. Returns the names left in place.

    ``recheck`` (the caller's refusal run again, ``Siblings.recheck_users``) closes the
    race with an incremental save in another process that chose this checkpoint as its
    base: the metadata is first moved aside (to a temporary metadata name, so a kill
    there leaves an interrupted save for ``gc``), then ``recheck`` runs; when it raises,
    the metadata is moved back and nothing else is removed. Such a save checks its
    bases again once its own metadata landed (``commit.commit_checkpoint``), so one of
    the two always sees the other."""
    refuse_link(fs, path)
    checkpoint = checkpoint or open_committed(fs, path)
    named = checkpoint.data_files()
    linked = sorted({p for n in named if (p := linked_prefix(fs, path, n)) is not None})
    if linked:
        raise UnsafeCheckpointError(
            f"refusing to delete {fs.url(path)}: files its metadata names lie under "
            f"{', '.join(quote(p) for p in linked)}, a symbolic link out of the checkpoint, "
            "and nothing is deleted through a link; nothing was deleted. Remove the link "
            "(or replace it with a directory of its own) first"
        )
    # What the read model found by name too (a listing may miss a file), and what the
    # listing shows now.
    found = [n for n in (*checkpoint.metadata, *checkpoint.errors) if is_metadata_name(n)]
    metadata = sorted({*found, *(n for n in fs.ls(path) if is_metadata_name(n))})
    if recheck is None:
        for name in metadata:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file_in(path, name)
    else:
        _uncommit_then_recheck(fs, path, metadata, recheck)
    withdraw_latest(fs, path)  # a pointer naming it would name no checkpoint now
    for name in sorted(named):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file_in(path, name)
    return _remove_dir_or_report(fs, path)


def _uncommit_then_recheck(
    fs: FileSystemBase, path: str, metadata: list[str], recheck: Callable[[], object]
) -> None:
    """Move ``metadata`` (names under ``path``) aside, run ``recheck``, then remove what
    was moved; when ``recheck`` raises, move it back and raise."""
    token = f"del{uuid.uuid4().hex[:12]}"
    moved: list[tuple[str, str]] = []
    try:
        for name in metadata:
            aside = f"{name}.tmp-{token}"
            try:
                fs.rename_in(path, name, aside)
            except FileNotFoundError:
                continue
            moved.append((name, aside))
        recheck()
    except BaseException:
        for name, aside in moved:
            try:
                fs.rename_in(path, aside, name)
            except Exception as exc:
                log.error(
                    "could not put back the metadata of %s, moved to %s while checking "
                    "that nothing references it (%s): rename it back to %s",
                    fs.url(path),
                    fs.url(fs.concat_path(path, aside)),
                    exc,
                    quote(name),
                )
        raise
    for _, aside in moved:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file_in(path, aside)


def remove_data_files(fs: FileSystemBase, path: str, names: set[str] | frozenset[str]) -> None:
    """Best-effort removal of the data files ``names`` of the checkpoint at ``path`` (the
    files of the checkpoint a save replaced): a failure is logged, never raised, and a
    file under a linked directory stays (``rm_file_in`` refuses it, and that is logged)."""
    for name in sorted(names):
        try:
            fs.rm_file_in(path, name)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("could not remove %s: %s", fs.url(fs.concat_path(path, name)), exc)


def remove_save(fs: FileSystemBase, path: str, save_id: str) -> None:
    """Best-effort removal of what the writer of ``save_id`` left under ``path`` when it
    died before it could clean up (a persist worker killed mid-copy): the data files
    named with that save id (no committed metadata names them: that save never
    committed), its open uploads and its heartbeats; never through a linked prefix
    directory. Failures are logged, never raised; ``gc`` finds what stays."""
    suffix = f"-{save_id}{fmt.DATA_SUFFIX}"
    try:
        if fs.is_link(path):
            return  # never deleted through (the copy refused it before writing)
        names = expand(fs, path)
        uploads = fs.pending_uploads(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except Exception as exc:
        log.warning("could not list %s to remove what save %s left: %s", fs.url(path), save_id, exc)
        return
    remove_data_files(fs, path, {n for n in names if is_data_file_name(n) and n.endswith(suffix)})
    for name in names:
        if heartbeat.is_heartbeat_name(name) and name.startswith(heartbeat.PREFIX + save_id):
            with contextlib.suppress(OSError, UnsafeCheckpointError):
                fs.rm_file_in(path, name)
    for upload in uploads:
        if posixpath.basename(upload.path).endswith(suffix):
            try:
                fs.abort_upload(upload)
            except Exception as exc:
                log.warning("could not abort the upload of %s: %s", fs.url(upload.path), exc)


def remove_leftovers(fs: FileSystemBase, path: str, names: list[str]) -> list[str]:
    """Remove ``names``, the checkpoint files of an uncommitted directory that the
    caller found stale, then the directory once empty. Refuses symbolic links; a file
    under a linked prefix directory stays (``rm_file_in`` refuses it; it is reported
    with what else stays). Returns the names left in place."""
    refuse_link(fs, path)
    for name in names:
        if not is_checkpoint_file_name(name) or is_metadata_name(name):
            continue
        with contextlib.suppress(FileNotFoundError, UnsafeCheckpointError):
            fs.rm_file_in(path, name)
    return _remove_dir_or_report(fs, path)


def _remove_dir_or_report(fs: FileSystemBase, path: str) -> list[str]:
    try:
        remove_empty_prefixes(fs, path)
        kept = expand(fs, path)
    except FileNotFoundError:
        return []
    if kept:
        log.warning("%s: left %s in place", fs.url(path), kept)
        return kept
    with contextlib.suppress(OSError, UnsafeCheckpointError):  # a save may start writing here
        fs.rm_dir_in(path)
    return []
