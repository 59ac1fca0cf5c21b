"""The commit protocol's storage steps, shared by the writer and ``dcp-storage cp``.

A checkpoint exists once its metadata does. Data files are written first under names
unique to the save; :func:`publish_metadata` then makes them durable, publishes the
metadata atomically and removes the files of the checkpoint it replaced. A failed save
removes its own files only when :func:`metadata_may_name` proves its metadata did not
land; everything else stays for the manager's cleanup.
"""

from __future__ import annotations

import logging

from extensions.errors import CheckpointExistsError
from storage.backends.base import FileSystemBase
from storage.checkpoint import format as fmt

log = logging.getLogger(__name__)


def publish_metadata(
    fs: FileSystemBase,
    directory: str,
    meta_path: str,
    payload: bytes,
    *,
    new_files: set[str],
    overwrite: bool,
    sync: bool,
) -> None:
    """Commit a checkpoint whose data files are all written: make them durable, publish
    the metadata atomically (a conditional create unless ``overwrite``), then remove the
    files of the checkpoint it replaced that the new one does not use."""
    replaced = committed_files(fs, meta_path)
    if sync:
        fs.sync_dir(directory)
    try:
        fs.write_atomic(meta_path, payload, exclusive=not overwrite)
    except FileExistsError as exc:
        raise CheckpointExistsError(
            f"Checkpoint already exists at {fs.url(directory)}: another save committed "
            "there first and overwrite=False; nothing of this save was kept"
        ) from exc
    remove_quietly(fs, [fs.concat_path(directory, f) for f in sorted(replaced - new_files)])


def metadata_may_name(fs: FileSystemBase, meta_path: str, save_id: str) -> bool:
    """After a failed commit: could the metadata at ``meta_path`` be this save's?

    A publish can land and still raise (a lost response, a failed directory fsync);
    deleting the data files then would break the checkpoint it just published. Only a
    missing file or another save's metadata proves it did not land."""
    try:
        meta = fmt.load_metadata(fs.read_bytes(meta_path), fs.url(meta_path))
    except FileNotFoundError:
        return False
    except Exception:
        return True
    return getattr(meta.storage_meta, "save_id", None) == save_id


def committed_files(fs: FileSystemBase, meta_path: str) -> set[str]:
    """Data files named by the metadata at ``meta_path`` (none if absent or unreadable)."""
    try:
        old = fmt.load_metadata(fs.read_bytes(meta_path), fs.url(meta_path))
    except FileNotFoundError:
        return set()
    except Exception as exc:  # an unreadable old checkpoint is simply replaced
        log.warning("cannot read the checkpoint being replaced (%s); its files stay", exc)
        return set()
    return {info.relative_path for info in (old.storage_data or {}).values()}


def remove_quietly(fs: FileSystemBase, paths: list[str]) -> None:
    """Best-effort removal for cleanup paths: a failure is logged, never raised."""
    for path in paths:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("could not remove %s: %s", fs.url(path), exc)
