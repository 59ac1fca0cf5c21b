"""The commit transaction: the one way a save, a copy or a tier's local save commits.

A checkpoint exists once its metadata does. Data files are written first under names
unique to the save; :func:`commit_checkpoint` then checks that every base its items
reference still holds their files, publishes the metadata (:func:`publish_metadata`:
data made durable, metadata published atomically, the files of the checkpoint it
replaced removed) and, when that fails, rolls back: it removes the new files only when
:func:`metadata_may_name` proves its metadata did not land; everything else stays for
the manager's cleanup. On many ranks only the committing rank can tell: it marks its
error (:func:`mark_may_have_landed`), the error travels to every rank (DCP's
``CheckpointException``, the tiers' ``gather_errors``), and each rank follows it
(:func:`commit_may_have_landed`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

from extensions.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStorageError,
)
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.committed import own_files, read_metadata_file
from storage.checkpoint.deadline import Budget, DeadlineExceededError
from storage.checkpoint.deletion import remove_data_files
from storage.checkpoint.incremental import check_referenced_files
from storage.checkpoint.latest import publish as point_latest
from storage.checkpoint.prefixes import absent
from storage.checkpoint.siblings import refuse_if_referenced, saw

# Set on the coordinator's error when its metadata may have landed; it travels with the
# error (pickled in DCP's CheckpointException) to the other ranks.
_MAY_HAVE_LANDED = "dcp_storage_commit_may_have_landed"

log = logging.getLogger(__name__)


def commit_checkpoint(
    fs: FileSystemBase,
    directory: str,
    meta_name: str,
    payload: bytes | Callable[[], bytes],
    *,
    save_id: str,
    infos: Iterable[Any],
    overwrite: bool,
    sync: bool,
    new_files: Collection[str] | None = None,
    budget: Budget | None = None,
    home: str | None = None,
) -> None:
    """Commit the checkpoint in ``directory`` whose data files are all written, or
    roll back.

    ``home``: ``directory`` as the save resolved it once at its start (``SaveAttempt.home``:
    a link the user named at ``directory`` itself followed, nothing below it), where the
    metadata is written and a rollback removes, never through a link swapped in since
    (``write_atomic_in``, ``rm_file_in``); default: resolved now.

    ``infos``: the storage index the metadata records; ``payload``: that metadata,
    serialized (or the function that serializes it: a failure there rolls back too);
    ``new_files``: the data files this commit publishes (default: every file ``infos``
    names for its own items), checked present before the publish and removed after a
    failure. The steps: every base that an item references still holds the file
    (``incremental.check_referenced_files``), then :func:`publish_metadata` as
    ``meta_name``. On failure the error is raised after the rollback: ``new_files`` are
    removed unless this save's metadata may have landed (:func:`metadata_may_name`);
    then, and when ``budget`` (the writer's deadline, which bounds the whole commit)
    ran out, since a publish left running may still land, nothing is removed and the
    error is marked (:func:`mark_may_have_landed`) so that no rank removes its files.
    Once committed, a ``.metadata`` in a ``step-<N>`` directory points its parent's
    latest-step pointer at it (``latest.publish``; outside the deadline, and a failure
    there is logged, never raised: the checkpoint is committed)."""
    meta_path = fs.concat_path(directory, meta_name)
    home = heartbeat.resolved(fs, directory) if home is None else home
    infos = list(infos)
    if new_files is None:
        new_files = {i.relative_path for i in infos if fmt.stored_item(i).ref is None}
    referencing = any(fmt.stored_item(i).ref is not None for i in infos)
    landed = False

    def attempt() -> None:
        nonlocal landed
        try:
            data = payload() if callable(payload) else payload
            check_referenced_files(fs, directory, infos)
            publish_metadata(
                fs,
                directory,
                meta_path,
                data,
                new_files=set(new_files),
                overwrite=overwrite,
                sync=sync,
                home=home,
            )
            if referencing:
                recheck_bases(fs, directory, meta_name, save_id, infos)
        except BaseException as exc:
            landed = commit_may_have_landed(exc) or metadata_may_name(fs, meta_path, save_id)
            if not landed:
                remove_data_files(fs, home, set(new_files))  # never through a link below
            raise

    try:
        if budget is None:
            attempt()
        else:
            budget.call(
                attempt,
                action="saving",
                location=fs.url(directory),
                item=meta_name,
                url=fs.url(meta_path),
            )
    except BaseException as exc:
        if landed or isinstance(exc, DeadlineExceededError):
            mark_may_have_landed(exc)
        raise
    if meta_name == fmt.METADATA_NAME:
        point_latest(fs, directory)  # after the commit marker, never before; never raises


def recheck_bases(
    fs: FileSystemBase, directory: str, meta_name: str, save_id: str, infos: list[Any]
) -> None:
    """After an incremental save's metadata landed: its bases are checked again, and
    when one lost a file the metadata is withdrawn (only while it is still this save's)
    and the check's error raised. A deletion in another process (retention, ``gc``,
    ``rm``) may have decided on the base between the first check and the publish; it
    moves the base's metadata aside and looks for new references before it removes any
    file (``deletion.delete_checkpoint``), so either it sees this metadata and keeps the
    base, or this check sees the base gone."""
    try:
        check_referenced_files(fs, directory, infos)
    except CheckpointNotFoundError as exc:
        if metadata_may_name(fs, fs.concat_path(directory, meta_name), save_id):
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file_in(directory, meta_name)
        raise CheckpointNotFoundError(
            f"{exc}; its metadata had landed and was withdrawn, so no checkpoint refers "
            "to the lost bytes"
        ) from None


def publish_metadata(
    fs: FileSystemBase,
    directory: str,
    meta_path: str,
    payload: bytes,
    *,
    new_files: set[str],
    overwrite: bool,
    sync: bool,
    home: str | None = None,
) -> None:
    """Commit a checkpoint whose data files are all written: make them durable, check
    that they are all still there, publish the metadata atomically (a conditional create
    unless ``overwrite``; in ``home``, ``directory`` as resolved at the save's start, never
    through a link swapped in below it: :func:`commit_checkpoint`), then remove the files
    of the checkpoint it replaced that the new one does not use (unless ``directory`` is a
    symbolic link: nothing is deleted through one).

    The check makes a save fail, rather than report success for a checkpoint that does
    not load, when something removed its files meanwhile (a ``gc`` whose grace is
    shorter than the save); for its bases, a removal between the check and the publish
    is caught after it (:func:`recheck_bases`).
    A replaced metadata that cannot be read keeps its files (for ``gc``), and the
    overwrite is refused while a checkpoint beside this one might reference them."""
    try:
        old = read_metadata_file(fs, meta_path)
        replaced, known = (own_files(old, fs.url(meta_path)) if old else frozenset()), True
    except Exception as exc:
        log.warning("cannot read %s (%s); the files it names stay", fs.url(meta_path), exc)
        replaced, known = frozenset(), False
    if replaced or not known:  # its files go once we land: none may be another's base
        refuse_if_referenced(fs, directory, "overwrite")
    if sync:
        fs.sync_dir(directory)
    # An incremental save in which nothing changed wrote no data file: there is nothing
    # to check, and an object store has nothing to list under a prefix holding no object.
    missing = absent(fs, directory, new_files) if new_files else []
    if missing:
        raise CheckpointNotFoundError(
            f"{fs.url(directory)}: {len(missing)} data file(s) of this save vanished before "
            f"its metadata was published (first: {missing[0]!r}); something deleted them "
            "meanwhile (a gc with too short a grace?). Nothing was committed"
        )
    try:
        home = heartbeat.resolved(fs, directory) if home is None else home
        fs.write_atomic_in(home, meta_path.rsplit("/", 1)[-1], payload, exclusive=not overwrite)
    except FileExistsError as exc:
        raise CheckpointExistsError(
            f"Checkpoint already exists at {fs.url(directory)}: another save committed "
            "there first and overwrite=False; nothing of this save was kept"
        ) from exc
    saw(fs, directory)  # beside it from now on, even where a listing lags behind
    if replaced - new_files and fs.is_link(directory):
        # Someone else's checkpoint linked in (a shared one as `step-0`): never deleted
        # through the link, as `rm` and retention refuse to.
        log.warning(
            "%s is a symbolic link: the files of the checkpoint this save replaced there "
            "are kept, never deleted through the link",
            fs.url(directory),
        )
        return
    if replaced - new_files:
        shown_back(fs, home, meta_path, payload)
        remove_data_files(fs, directory, replaced - new_files)


class NotShownError(CheckpointStorageError):
    """The store acknowledged a checkpoint's metadata but serves other bytes at its name
    (:func:`shown_back`); ``payload`` is the metadata that was published. Marked as a
    commit that may have landed: no file of either checkpoint is removed."""

    def __init__(self, payload: bytes, message: str) -> None:
        super().__init__(message)
        self.payload = payload

    def __reduce__(self) -> Any:  # pickled across ranks and processes, its mark kept
        return (type(self), (self.payload, str(self)), self.__dict__)


def shown_back(fs: FileSystemBase, home: str, meta_path: str, payload: bytes) -> None:
    """Before the files of a replaced checkpoint go: the metadata just published is
    read back from ``home``. A store that acknowledged the write but serves the old
    metadata (it kept the old object, a cache answers for it) would otherwise have the
    old files removed while that metadata, naming them, is what every reader finds: the
    checkpoint replaced lost, the new one not there. Raises :class:`NotShownError`,
    marked as a commit that may have landed (:func:`mark_may_have_landed`), so that
    neither checkpoint's files are removed: whichever metadata the store settles on
    loads, and ``gc`` removes the other's files as orphans."""
    name = meta_path.rsplit("/", 1)[-1]
    url = fs.url(meta_path)
    try:
        found: bytes | None = fs.read_bytes(fs.concat_path(home, name), limit=len(payload))
    except FileNotFoundError:
        found = None
    if found == payload:
        return
    seen = "no object" if found is None else f"{len(found)} bytes of other content"
    error = NotShownError(
        payload,
        f"{url}: the store acknowledged this save's metadata but serves {seen} there (it kept "
        "an older object, or a cache answers for it; or another save to this checkpoint "
        "published meanwhile); the files of the checkpoint it replaces were kept, and so "
        "were this save's: check the store's consistency, then save or copy again (gc "
        "removes the files no metadata names)",
    )
    mark_may_have_landed(error)
    raise error


def metadata_may_name(fs: FileSystemBase, meta_path: str, save_id: str) -> bool:
    """After a failed commit: could the metadata at ``meta_path`` be this save's?

    A publish can land and still raise (a lost response, a failed directory fsync);
    deleting the data files then would break the checkpoint it just published. Only a
    missing file or another save's metadata proves it did not land."""
    try:
        meta = read_metadata_file(fs, meta_path)
    except Exception:
        return True
    return meta is not None and getattr(meta.storage_meta, "save_id", None) == save_id


def mark_may_have_landed(error: BaseException) -> None:
    """Record on ``error`` that the metadata may have landed, for every rank to see."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _MAY_HAVE_LANDED, True)


def commit_may_have_landed(error: BaseException | None) -> bool:
    """Whether ``error`` (this rank's, or DCP's ``CheckpointException`` carrying the
    coordinator's) says the commit may have landed: then no rank may delete its files."""
    if error is None:
        return False
    if getattr(error, _MAY_HAVE_LANDED, False):
        return True
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if getattr(inner, _MAY_HAVE_LANDED, False):
            return True
    return False


def remove_quietly(fs: FileSystemBase, directory: str, names: list[str]) -> None:
    """Best-effort removal of ``names`` under ``directory`` for cleanup paths, never
    through a link (``rm_file_in``): a failure is logged, never raised."""
    for name in names:
        try:
            fs.rm_file_in(directory, name)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("could not remove %s: %s", fs.url(fs.concat_path(directory, name)), exc)
