"""What a folder checkpoint's listing must be before :func:`~.folders.restore_folder`
writes anything (see that module's docstring): plain relative file names, chunks that
cover each file exactly once, no file and directory at one name, no two names the
destination's file system takes for one, names and sizes the destination can take."""

from __future__ import annotations

import errno
import os
import tempfile
import unicodedata

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from extensions.errors import IntegrityError, UnsafeCheckpointError, quote


def listed_files(metadata: Metadata, where: str) -> dict[str, int]:
    """The files a folder checkpoint lists, ``{name: size}``; refuses items that are not
    files, names that would land outside the destination, names with control
    characters (escape sequences or line breaks, which whoever lists the folder later
    would see as such), and files whose stored chunks do not cover them exactly once."""
    sizes: dict[str, int] = {}
    for name, md in metadata.state_dict_metadata.items():
        if not (
            isinstance(md, TensorStorageMetadata)
            and md.properties.dtype == torch.uint8
            and len(md.size) == 1
        ):
            raise UnsafeCheckpointError(
                f"{where}: item {quote(name)} is not a file (a 1-D uint8 tensor); this is not "
                "a folder checkpoint: load it with storage.load"
            )
        parts = name.split("/")
        if (
            not name
            or name.startswith("/")
            or "\\" in name
            or not name.isprintable()  # control characters (NUL too): a terminal's, a script's
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise UnsafeCheckpointError(
                f"{where}: item {quote(name)} is not a plain relative file path; refusing to "
                f"restore it (nothing was written): {_FORGED}"
            )
        sizes[name] = int(md.size[0])  # in [0, 2**62]: the metadata's reader checks
        if not _tiled(md):
            raise IntegrityError(
                f"{where}: item {quote(name)} is listed as {sizes[name]} bytes but its stored "
                "chunks do not cover them exactly once; its metadata is damaged or forged (the "
                "file would be restored with zeros where no chunk is): nothing was written. "
                "Restore the checkpoint from a good copy, or save the folder again"
            )
    clash = sorted(_directories(sizes) & set(sizes))
    if clash:
        raise UnsafeCheckpointError(
            f"{where}: {quote(clash[0])} is listed both as a file and as a directory; "
            f"refusing to restore it (nothing was written): {_FORGED}"
        )
    return sizes


def _directories(sizes: dict[str, int]) -> set[str]:
    return {"/".join(name.split("/")[:i]) for name in sizes for i in range(1, name.count("/") + 1)}


def check_folding(sizes: dict[str, int], dest: str, where: str) -> None:
    """Refuse, before anything is written, two names that the file system at ``dest``
    takes for one (:func:`folds`): one file would be restored over the other."""
    existing = _existing(dest)
    if not folds(existing):
        return
    same = _clash([*sizes, *_directories(sizes)])
    if same is not None:
        raise UnsafeCheckpointError(
            f"{where}: items {quote(same[0])} and {quote(same[1])} differ only in letter "
            f"case or Unicode normalization, and the file system at {existing} takes them "
            "for one name: one would be restored over the other, so nothing was written. "
            "Restore onto a case-sensitive file system, or load the items with "
            "storage.load and write them under names of your own"
        )


def folds(directory: str) -> bool:
    """Whether the file system at ``directory`` takes names that differ only in letter
    case or Unicode normalization for one (macOS, Windows, a casefolded ext4): a
    temporary file made there is looked up under its twins. False where none can be
    made (the restore then fails making its own)."""
    try:
        fd, path = tempfile.mkstemp(prefix=".dcp-names-caf\u00e9-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    try:
        name = os.path.basename(path)
        twins = {name.swapcase(), unicodedata.normalize("NFD", name)} - {name}
        return any(os.path.lexists(os.path.join(directory, twin)) for twin in twins)
    finally:
        os.unlink(path)


#: The fix for a listing FolderCheckpoints.save never writes.
_FORGED = (
    "its metadata is damaged or forged (FolderCheckpoints.save never lists that); "
    "restore the checkpoint from a good copy, or save the folder again"
)
#: Bytes a name may take, and a path, where the file system does not say (Linux's).
_NAME_MAX, _PATH_MAX = 255, 4096
#: What the temporary directory beside the destination adds to its name at most.
_STAGING_EXTRA = len(".restoring-") + 1 + 16


def _clash(names: list[str]) -> tuple[str, str] | None:
    """Two of ``names`` that differ only in letter case or Unicode normalization (the
    same name on macOS and Windows), if any."""
    seen: dict[str, str] = {}
    for name in sorted(names):
        key = unicodedata.normalize("NFC", name).casefold()
        if seen.setdefault(key, name) != name:
            return seen[key], name
    return None


def check_room(sizes: dict[str, int], dest: str, where: str) -> None:
    """Refuse, before anything is written, a listing the destination cannot take: a
    name component or a path longer than its file system allows (``ENAMETOOLONG``
    half-way through), or files that need more bytes than are free there (a forged size
    would otherwise be allocated first: a huge sparse file, then a read that fails)."""
    existing = _existing(dest)
    name_max = _limit(existing, "PC_NAME_MAX", _NAME_MAX)
    room = _limit(existing, "PC_PATH_MAX", _PATH_MAX) - len(os.fsencode(dest)) - _STAGING_EXTRA
    for name in sorted(sizes):
        long = max(name.split("/"), key=lambda p: len(os.fsencode(p)))
        if len(os.fsencode(long)) > name_max:
            raise UnsafeCheckpointError(
                f"{where}: item {quote(name)} has a name component of "
                f"{len(os.fsencode(long))} bytes, more than the {name_max} the file system "
                f"at {existing} takes; nothing was written. Restore onto a file system that "
                "takes longer names, or load the items with storage.load"
            )
        if len(os.fsencode(name)) >= room:
            raise UnsafeCheckpointError(
                f"{where}: item {quote(name)} would be a path longer than the file system "
                f"at {existing} takes under {dest}; nothing was written. Restore into a "
                "shorter destination path"
            )
    total = sum(sizes.values())
    usage = os.statvfs(existing)
    free = usage.f_bavail * usage.f_frsize
    if usage.f_blocks and total > free:  # some FUSE mounts report no size at all: unknown
        largest = max(sizes, key=lambda n: sizes[n])
        raise OSError(
            errno.ENOSPC,
            f"{where}: its files take {total} bytes (the largest, item {quote(largest)}, "
            f"{sizes[largest]}), more than the {free} bytes free at {existing}; nothing was "
            "written. Free space there or restore elsewhere; a size far beyond what the "
            f"checkpoint stores means {_FORGED}",
        )


def _existing(dest: str) -> str:
    """The nearest directory at or above ``dest`` that exists."""
    existing = dest
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    return existing


def _limit(path: str, name: str, default: int) -> int:
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return default
    return value if value > 0 else default


def _tiled(md: TensorStorageMetadata) -> bool:
    """Whether the chunks of the 1-D item ``md`` cover each of its bytes exactly once."""
    cursor = 0
    for offsets, sizes in sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks):
        if len(offsets) != 1 or len(sizes) != 1 or offsets[0] != cursor:
            return False
        cursor += sizes[0]
    return cursor == md.size[0]
