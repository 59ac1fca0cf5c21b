"""Folders of arbitrary files, committed to a bucket as checkpoints and restored from it.

Frameworks that save a folder of their own files (the Transformers ``Trainer``'s
``checkpoint-N``: safetensors, ``optimizer.pt``, JSON; Accelerate's ``save_state``
output) keep saving it locally; :class:`FolderCheckpoints` then commits it under a
bucket root as ``root/step-N``, one dcp-storage checkpoint per folder:

* each file is one item, named by its path inside the folder (``/`` separators), its
  bytes a 1-D ``uint8`` tensor memory-mapped from the file (read once, by the upload);
* the checkpoint's metadata, published last and atomically, is the manifest: every
  file's name, size and the CRC-32C of its stored bytes. A folder exists in the bucket
  once it is complete, never half; a failed upload removes what it wrote and leaves the
  committed steps alone;
* transforms (zstd, AES-256-GCM), retention (``keep_last``, ``keep_every``) and safe
  deletion are the :class:`~storage.CheckpointManager`'s.

:func:`restore_folder` downloads one into a new local directory: the files are written
in a temporary directory beside it, each item's checksum verified as it streams in, then
made durable and renamed into place, so the directory appears complete or not at all.
The listing is checked before anything is written (:mod:`._folder_listing`): a plain
relative path, no ``..``, no absolute path, no control character, no component longer
than the destination's file system takes, no file and directory at one name; where the
destination's file system takes names that differ only in letter case or Unicode
normalization for one (macOS, Windows, a casefolded ext4: probed there), no two such
names (``A.txt`` and ``a.txt``, ``é`` composed and decomposed), which would restore one
file over the other; and files that fit in the space free at the destination. Only
regular files are saved; a link or special file in the folder is refused, and empty
directories are not kept.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from extensions.base import Keys
from extensions.errors import (
    CheckpointNotFoundError,
)
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint.writer import CheckpointWriter
from storage.integrations import _folder_listing as listing
from storage.integrations._solo import load_alone, reader_alone, save_alone
from storage.ops.manager import CheckpointManager


class FolderCheckpoints:
    """Local checkpoint folders drained to ``root_url/step-N`` (module docstring).

    :meth:`save` maps the folder's files at once (the folder may be deleted as soon as
    it returns: the mappings keep the bytes) and uploads them in a background thread,
    one folder at a time; ``blocking=True`` uploads before returning. Its files must
    not be rewritten in place (truncated) until the upload is done (:meth:`wait`): a
    mapping cannot read past a file's new end. :meth:`wait`
    waits for the upload in flight and raises its error, as does the next :meth:`save`.
    ``keep_last``/``keep_every``, ``storage_options``, ``transforms``, ``keys``,
    ``registry``, ``require_encryption``, ``filesystem`` and writer options
    (``thread_count``, ...) are those of :class:`~storage.CheckpointManager`.

    Saves and restores are made by the calling process alone, even under
    ``torch.distributed``: call them on one process (the frameworks' main process).
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        blocking: bool = False,
        storage_options: dict[str, Any] | None = None,
        transforms: Sequence[Any] | None = None,
        keys: Keys | None = None,
        registry: ExtensionRegistry | None = None,
        require_encryption: bool | None = None,
        filesystem: FileSystemBase | None = None,
        **writer_options: Any,
    ) -> None:
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, got {blocking!r}")
        self.blocking = blocking
        self.manager = CheckpointManager(
            root_url,
            keep_last=keep_last,
            keep_every=keep_every,
            storage_options=storage_options,
            transforms=transforms,
            keys=keys,
            registry=registry,
            require_encryption=require_encryption,
            filesystem=filesystem,
            coordinator=True,  # one process drains: it applies retention too
            **writer_options,
        )
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[None] | None = None
        self._pid = os.getpid()

    @property
    def url(self) -> str:
        return self.manager.url

    def steps(self) -> list[int]:
        """Committed steps under the root, ascending."""
        return self.manager.steps()

    def save(self, folder: str | os.PathLike[str], step: int) -> None:
        """Commit the files under ``folder`` as ``root/step-{step}`` (replacing a
        committed step of that number, unless that step is a symbolic link:
        ``CheckpointManager.save`` refuses it), then apply retention."""
        self.wait()
        self.manager.location.refuse_link(step)
        files = read_folder(folder)
        url = self.manager.step_url(step)
        if self.blocking:
            self._commit(step, url, files)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="dcp-storage-folder"
            )
        self._pending = self._executor.submit(self._commit, step, url, files)

    def _commit(self, step: int, url: str, files: dict[str, torch.Tensor]) -> None:
        m = self.manager
        writer = CheckpointWriter(url, filesystem=m.fs, transforms=m.transforms, **m.writer_options)
        save_alone(writer, files)
        m.retention.after_save(step)

    def wait(self) -> None:
        """Wait for the upload in flight, if any; raise its error."""
        if self._pid != os.getpid():
            # A child made with fork: the parent's upload thread is not here (an upload
            # queued to it never ran), and its upload in flight is the parent's.
            self._pid, self._executor, self._pending = os.getpid(), None, None
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """:meth:`wait`, then stop the upload thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None

    def pick(self, step: int | None = None) -> int:
        """``step``, or the newest committed step when ``None``; raises
        :class:`CheckpointNotFoundError` when there is none. The upload in flight, if
        any, lands first (a restore right after a save sees that save)."""
        self.wait()
        if step is not None:
            return step
        latest = self.manager.latest()
        if latest is None:
            raise CheckpointNotFoundError(
                f"no committed folder checkpoint under {self.url} (looked for step-<N>); "
                "save one first or check the root URL"
            )
        return latest

    def restore(self, dest: str | os.PathLike[str], step: int | None = None) -> str:
        """Download ``step`` (default: the newest committed one) into the new directory
        ``dest`` (see :func:`restore_folder`); returns its path."""
        m = self.manager
        return restore_folder(
            m.step_url(self.pick(step)),
            dest,
            filesystem=m.fs,
            **m.reader_options.as_kwargs(),
        )


def read_folder(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The regular files under ``folder`` as ``{relative/path: uint8 tensor}``, each
    memory-mapped read-only (no copy). Raises for a link or special file inside it."""
    root = os.fspath(folder)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root} is not a directory; nothing to save")
    files: dict[str, torch.Tensor] = {}
    for parent, dirs, names in os.walk(root):
        dirs.sort()
        for name in [*dirs, *sorted(names)]:
            path = os.path.join(parent, name)
            mode = os.lstat(path)
            if stat.S_ISDIR(mode.st_mode):
                continue
            if not stat.S_ISREG(mode.st_mode):
                raise ValueError(
                    f"{path} is not a regular file (a link or a special file); a folder "
                    "checkpoint holds regular files only: copy its target in, or remove it"
                )
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            files[rel] = _mapped(path, mode.st_size)
    if not files:
        raise FileNotFoundError(f"{root} holds no files; nothing to save")
    return files


def restore_folder(
    url: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    filesystem: FileSystemBase | None = None,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    require_encryption: bool | None = None,
) -> str:
    """Download the folder checkpoint at ``url`` into ``dest``, which must not exist.

    Every file's checksum is verified as it streams in; the files are written under a
    temporary directory beside ``dest``, fsynced, and the directory is renamed to
    ``dest`` last, so a failed restore leaves nothing there. Returns ``dest``."""
    dest = os.path.abspath(os.fspath(dest))
    if os.path.lexists(dest):
        raise FileExistsError(
            f"{dest} exists; restoring {os.fspath(url)} needs a new directory: restore into "
            "one that does not exist (nothing was written)"
        )
    options: dict[str, Any] = {
        "storage_options": storage_options,
        "filesystem": filesystem,
        "keys": keys,
        "registry": registry,
        "require_encryption": require_encryption,
    }
    reader = reader_alone(url, **options)
    sizes = listing.listed_files(reader.read_metadata(), reader.url)
    listing.check_room(sizes, dest, reader.url)
    listing.check_folding(sizes, dest, reader.url)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.restoring-", dir=parent)
    try:
        targets = {}
        for name, size in sizes.items():
            path = os.path.join(staging, *name.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "xb") as f:
                f.truncate(size)
            targets[name] = _mapped(path, size, writable=True)
        load_alone(reader_alone(url, **options), targets)
        del targets  # unmapped: the bytes are in the files
        _sync_tree(staging)
        _publish(staging, dest, reader.url)
        _sync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _publish(staging: str, dest: str, where: str) -> None:
    """Rename the restored ``staging`` to ``dest``, which must still not exist: one made
    meanwhile (a directory, a file, a link) is kept, never replaced."""
    if os.path.lexists(dest):
        raise FileExistsError(
            f"{dest} appeared while {where} was restored into a temporary directory beside "
            "it; it is left as it is and the restore removed: restore into a new directory"
        )
    try:
        os.rename(staging, dest)  # an empty directory made since the look above is replaced
    except OSError as exc:  # ENOTEMPTY, EEXIST, ENOTDIR: something is there now
        if not os.path.lexists(dest):
            raise
        raise FileExistsError(
            f"{dest} appeared while {where} was restored ({exc}); it is left as it is and "
            "the restore removed: restore into a new directory"
        ) from None


def _mapped(path: str, size: int, *, writable: bool = False) -> torch.Tensor:
    if size == 0:  # mmap cannot map nothing
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=writable, size=size, dtype=torch.uint8)


def _sync_tree(root: str) -> None:
    for parent, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(parent)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
