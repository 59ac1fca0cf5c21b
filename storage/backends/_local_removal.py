"""Removing a checkpoint's files on local disk without following a link.

A deletion checks that nothing it removes lies behind a symbolic link, then removes by
name. By path, that leaves a window: whoever can write a directory on the way (a shared
root holding the step directories) could swap a directory for a link between the check
and the removal, and the removal would land in the link's target. Here each directory is
opened by name inside the one above it, refusing a link (``O_NOFOLLOW``), and the last
name is removed inside the directory so opened: a link swapped in anywhere makes the walk
fail before anything is removed, and a link at the last name is removed itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from extensions.errors import UnsafeCheckpointError

_DIR_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_DIRECTORY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


#: Whether this platform opens and removes names inside an open directory without
#: following links; where it does not, local deletion refuses instead of racing.
WALKS_SAFELY = (
    hasattr(os, "O_DIRECTORY")
    and hasattr(os, "O_NOFOLLOW")
    and {os.open, os.unlink, os.rmdir, os.rename, os.stat} <= os.supports_dir_fd
)


def _walk_plan(directory: str, name: str, itself: bool) -> tuple[str, list[str]]:
    """``(top, parts)``: where the walk starts (``directory``'s parent, taken as given:
    the place the user chose; ``directory`` itself when it is ``/``) and the names to
    walk from there: ``directory``'s own, then those of ``name`` (``/``-separated,
    relative; empty only where ``itself`` allows acting on ``directory`` itself).
    Refuses what would leave the directory."""
    stripped = directory.rstrip(os.sep) or os.sep
    head = os.path.basename(stripped)
    top = (os.path.dirname(stripped) or os.curdir) if head else stripped
    parts = [p for p in name.split("/") if p]
    if (
        name.startswith("/")
        or head in (".", "..")
        or (not parts and not itself)
        or any(p in (".", "..") or os.sep in p or "\0" in p for p in parts)
    ):
        raise UnsafeCheckpointError(
            f"refusing to remove {name!r} under {directory!r}: it is not a plain relative "
            "name inside that directory (a checkpoint's names never hold '..', '.', an "
            "absolute path or a NUL); nothing was removed"
        )
    parts = ([head] if head else []) + parts
    if not parts:
        raise UnsafeCheckpointError(f"refusing to remove the file system root {directory!r}")
    return top, parts


@contextlib.contextmanager
def _opened_parent(directory: str, name: str, *, itself: bool = False) -> Iterator[tuple[int, str]]:
    """``(fd, last)``: the directory that holds ``directory/name``, opened by walking
    from ``directory``'s parent with no link followed at ``directory`` or below it
    (:func:`_walk_plan`), and the last name to act on there."""
    if not WALKS_SAFELY:
        raise UnsafeCheckpointError(
            f"refusing to remove {name or directory!r}: this platform cannot open "
            "directories without following symbolic links (os.supports_dir_fd), so a "
            "removal could land outside the checkpoint; remove the files by hand"
        )
    top, parts = _walk_plan(directory, name, itself)
    fd = os.open(top, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        walked = top
        for part in parts[:-1]:
            walked = os.path.join(walked, part)
            try:
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) and _is_link_at(
                    part, fd
                ):
                    raise UnsafeCheckpointError(
                        f"refusing to remove {os.path.join(directory, name)!r}: {walked!r} "
                        "is a symbolic link where the checkpoint has a directory, and "
                        "nothing is removed through a link; nothing was removed there. "
                        "Whoever can write its parent may have swapped it in: remove the "
                        "link itself, and make that directory writable by you only"
                    ) from None
                raise
            os.close(fd)
            fd = below
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _is_link_at(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def remove_file(directory: str, name: str) -> None:
    """Remove the file ``directory/name`` (``name`` relative, ``/``-separated), never
    through a symbolic link at ``directory`` or below it (see above): a link there
    raises :class:`UnsafeCheckpointError`, a link at ``name`` is itself removed.
    ``FileNotFoundError`` if it is not there."""
    with _opened_parent(directory, name) as (fd, last):
        os.unlink(last, dir_fd=fd)


def remove_dir(directory: str, name: str = "") -> None:
    """Remove the empty directory ``directory/name`` (``directory`` itself when ``name``
    is empty), walking as :func:`remove_file` does; a link there is never removed as a
    directory (``NotADirectoryError``)."""
    with _opened_parent(directory, name, itself=True) as (fd, last):
        os.rmdir(last, dir_fd=fd)


def rename_in(directory: str, name: str, new_name: str) -> None:
    """Move ``directory/name`` to ``directory/new_name`` (replacing what is there),
    walking to each as :func:`remove_file` does."""
    with (
        _opened_parent(directory, name) as (src, old),
        _opened_parent(directory, new_name) as (dst, new),
    ):
        os.replace(old, new, src_dir_fd=src, dst_dir_fd=dst)
