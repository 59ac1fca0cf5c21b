"""Removing a checkpoint's files on local disk without following a link.

A deletion checks that nothing it removes lies behind a symbolic link, then removes by
name. By path, that leaves a window: whoever can write a directory on the way (a shared
root holding the step directories) could swap a directory for a link between the check
and the removal, and the removal would land in the link's target. Here each directory is
opened by name inside the one above it, refusing a link (``O_NOFOLLOW``), and the last
name is removed inside the directory so opened: a link swapped in anywhere makes the walk
fail before anything is removed, and a link at the last name is removed itself. The
walk is :mod:`~storage.backends._local_walk`'s, which writes take too.
"""

from __future__ import annotations

import os

from storage.backends._local_walk import opened_parent


def remove_file(directory: str, name: str) -> None:
    """Remove the file ``directory/name`` (``name`` relative, ``/``-separated), never
    through a symbolic link at ``directory`` or below it (see above): a link there
    raises :class:`UnsafeCheckpointError`, a link at ``name`` is itself removed.
    ``FileNotFoundError`` if it is not there."""
    with opened_parent(directory, name) as (fd, last):
        os.unlink(last, dir_fd=fd)


def remove_dir(directory: str, name: str = "") -> None:
    """Remove the empty directory ``directory/name`` (``directory`` itself when ``name``
    is empty), walking as :func:`remove_file` does; a link there is never removed as a
    directory (``NotADirectoryError``)."""
    with opened_parent(directory, name, itself=True) as (fd, last):
        os.rmdir(last, dir_fd=fd)


def rename_in(directory: str, name: str, new_name: str) -> None:
    """Move ``directory/name`` to ``directory/new_name`` (replacing what is there),
    walking to each as :func:`remove_file` does."""
    with (
        opened_parent(directory, name) as (src, old),
        opened_parent(directory, new_name) as (dst, new),
    ):
        os.replace(old, new, src_dir_fd=src, dst_dir_fd=dst)
