"""Removing a checkpoint's files on local disk without following a link.

A deletion checks that nothing it removes lies behind a symbolic link, then removes by
name. By path, that leaves a window: whoever can write a directory on the way (a shared
root holding the step directories) could swap a directory for a link between the check
and the removal, and the removal would land in the link's target. Here each directory is
opened by name inside the one above it, refusing a link (``O_NOFOLLOW``), and the last
name is removed inside the directory so opened: a link swapped in anywhere makes the walk
fail before anything is removed, and a link at the last name is removed itself. The
walk is :mod:`~storage.backends._local_walk`'s, which writes take too.

Where the platform cannot walk (``WALKS_SAFELY`` false: no ``dir_fd``), a removal goes
by path as writes there do: its names refused as the walk refuses them, each directory
below ``directory`` checked not to be a link just before. That leaves the window above
open, but refusing instead would leave every heartbeat and overwritten data file behind
on such a platform, with no way for ``gc`` to remove them.
"""

from __future__ import annotations

import os

from storage.backends import _local_walk
from storage.backends._local_walk import opened_parent


def remove_file(directory: str, name: str) -> None:
    """Remove the file ``directory/name`` (``name`` relative, ``/``-separated), never
    through a symbolic link at ``directory`` or below it (see above): a link there
    raises :class:`UnsafeCheckpointError`, a link at ``name`` is itself removed.
    ``FileNotFoundError`` if it is not there."""
    if not _local_walk.WALKS_SAFELY:
        os.unlink(_by_path(directory, name, itself=False))
        return
    with opened_parent(directory, name) as (fd, last):
        os.unlink(last, dir_fd=fd)


def remove_dir(directory: str, name: str = "") -> None:
    """Remove the empty directory ``directory/name`` (``directory`` itself when ``name``
    is empty), walking as :func:`remove_file` does; a link there is never removed as a
    directory (``NotADirectoryError``)."""
    if not _local_walk.WALKS_SAFELY:
        path = _by_path(directory, name, itself=True)
        if os.path.islink(path):
            raise NotADirectoryError(f"{path!r} is a symbolic link, not a directory")
        os.rmdir(path)
        return
    with opened_parent(directory, name, itself=True) as (fd, last):
        os.rmdir(last, dir_fd=fd)


def rename_in(directory: str, name: str, new_name: str) -> None:
    """Move ``directory/name`` to ``directory/new_name`` (replacing what is there),
    walking to each as :func:`remove_file` does."""
    if not _local_walk.WALKS_SAFELY:
        old = _by_path(directory, name, itself=False)
        os.replace(old, _by_path(directory, new_name, itself=False))
        return
    with (
        opened_parent(directory, name) as (src, old),
        opened_parent(directory, new_name) as (dst, new),
    ):
        os.replace(old, new, src_dir_fd=src, dst_dir_fd=dst)


def _by_path(directory: str, name: str, *, itself: bool) -> str:
    """``directory/name`` for a removal by path (see the module docstring): its names
    refused as the walk refuses them, and none of the directories from ``directory``
    down to the last name a symbolic link right now."""
    top, parts = _local_walk.walk_plan(directory, name, itself, "remove")
    walked = top
    for part in parts[:-1]:
        walked = os.path.join(walked, part)
        if os.path.islink(walked):
            raise _local_walk.linked_error(directory, name, walked, "remove")
    return os.path.join(top, *parts)
