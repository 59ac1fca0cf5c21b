"""Data files under several key prefixes (``CheckpointWriter(key_prefixes=N)``).

An object store serves a bounded request rate per key-prefix partition (S3: about
3,500 PUT and 5,500 GET per second); a 1,000-rank save that puts every data file
under one checkpoint prefix asks one partition for all of them. With ``key_prefixes``
each rank's data files go one directory level down, under a short hexadecimal prefix
(``<checkpoint>/0a/__10_0-<save_id>.distcp``), ``rank % N``, so the files and their
requests are spread evenly over N prefixes the store can split into partitions
(docs/scale.md has the figures and the limits).

The prefix is part of the item's ``relative_path`` in the metadata, so stock readers
(``FileSystemReader``, ``FsspecReader``: they join ``relative_path`` onto the
checkpoint path) load such a checkpoint too. The one form allowed besides a plain file
name is :data:`PREFIX` (1 to 8 lowercase hex digits), then ``/``, then a plain name:
``validate.check_relative_path`` accepts exactly that, and every deletion path
recognises data files by name with or without it (``layout``).

A prefix directory is a checkpoint's own directory, never a symbolic link: no path under
a checkpoint is followed through a link, on any read, write, copy, drain or delete path.
:func:`is_linked` is the one check they all make (the backends refuse a link as the last
component of a path they read; removing a link removes only the link). It is made just
before the path is used: a link swapped in between is not caught there, but every
deletion removes through ``rm_file_in``/``rm_dir_in``, which on local disk never follows
a link below the checkpoint directory and so fails instead.
"""

from __future__ import annotations

import contextlib
import re

from extensions.errors import UnsafeCheckpointError, quote
from storage.backends.base import FileSystemBase

#: The one sub-directory form a ``relative_path`` may have.
PREFIX = re.compile(r"[0-9a-f]{1,8}")
#: Most prefixes a writer spreads over (4096: three hex digits).
MAX_PREFIXES = 4096


def check_key_prefixes(value: object) -> int:
    """``key_prefixes`` (0 or 1: no prefix directories) if valid."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_PREFIXES:
        raise TypeError(f"key_prefixes must be an int in [0, {MAX_PREFIXES}], got {value!r}")
    return value


def place(name: str, rank: int, key_prefixes: int) -> str:
    """The ``relative_path`` of data file ``name`` written by ``rank``."""
    if key_prefixes <= 1:
        return name
    width = max(2, len(f"{key_prefixes - 1:x}"))
    return f"{rank % key_prefixes:0{width}x}/{name}"


def split(relative_path: str) -> tuple[str | None, str]:
    """``(prefix, name)`` of a ``relative_path`` (``prefix`` is ``None`` for a plain
    name); it does not validate (``validate.check_relative_path`` does)."""
    prefix, sep, name = relative_path.rpartition("/")
    return (prefix, name) if sep else (None, relative_path)


def is_prefix(name: str) -> bool:
    return PREFIX.fullmatch(name) is not None


def is_linked(fs: FileSystemBase, path: str, prefix: str) -> bool:
    """Whether the prefix directory ``prefix`` of the checkpoint at ``path`` is a
    symbolic link (never, on backends without links)."""
    return fs.is_link(fs.concat_path(path, prefix))


def linked_prefix(fs: FileSystemBase, path: str, relative_path: str) -> str | None:
    """The prefix directory of ``relative_path`` (a file of the checkpoint at ``path``)
    if it is a symbolic link, else ``None``."""
    prefix, _ = split(relative_path)
    return prefix if prefix is not None and is_linked(fs, path, prefix) else None


def refuse_linked_prefix(fs: FileSystemBase, path: str, relative_path: str) -> None:
    """Raise :class:`UnsafeCheckpointError` if ``relative_path`` lies under a prefix
    directory that is a symbolic link: the file would lie outside the checkpoint."""
    prefix = linked_prefix(fs, path, relative_path)
    if prefix is not None:
        raise UnsafeCheckpointError(
            f"{fs.url(path)}: {quote(relative_path)} lies under {quote(prefix)}, a symbolic "
            "link; a checkpoint's prefix directories must be its own directories, and "
            "nothing is read, written or deleted through a link (replace the link with a "
            "directory holding copies of the files, or remove it)"
        )


def expand(fs: FileSystemBase, path: str, only: set[str] | None = None) -> list[str]:
    """The names under ``path``, with each prefix directory (those in ``only``, if
    given) replaced by its entries as ``prefix/name``: every checkpoint file, prefixed
    or not, in one list. A prefix directory that is a symbolic link stays one name, never
    listed through (so no caller deletes or reads through it). Costs one listing per
    prefix directory."""
    names = []
    for name in fs.ls(path):
        if is_prefix(name) and (only is None or name in only) and not is_linked(fs, path, name):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                names += [f"{name}/{n}" for n in fs.ls(fs.concat_path(path, name))]
                continue
        names.append(name)
    return sorted(names)


def absent(fs: FileSystemBase, path: str, names: set[str]) -> list[str]:
    """Those of ``names`` (files under ``path``, under a key prefix or not) that are not
    there, sorted: one listing (:func:`expand`, into the prefix directories they use),
    then a look by name for each one it misses, since a listing may lag behind the store
    or miss an object; never through a linked prefix directory."""
    used = {p for p, _ in map(split, names) if p is not None}
    try:
        present = set(expand(fs, path, only=used))
    except (FileNotFoundError, NotADirectoryError):
        present = set()
    return sorted(
        n
        for n in names - present
        if linked_prefix(fs, path, n) is not None or not fs.exists(fs.concat_path(path, n))
    )


def remove_empty_prefixes(fs: FileSystemBase, path: str) -> None:
    """Remove the prefix directories under ``path`` that are empty (local disk keeps
    empty directories; object stores have none); a linked one stays."""
    for name in fs.ls(path):
        if not is_prefix(name) or is_linked(fs, path, name):
            continue
        with contextlib.suppress(OSError, UnsafeCheckpointError):
            if not fs.ls(fs.concat_path(path, name)):
                fs.rm_dir_in(path, name)  # never through a link swapped in meanwhile
