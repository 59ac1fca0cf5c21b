"""Walking to a checkpoint's file on local disk by directory handles, never through a link.

A save or a deletion acts on ``directory/name``; by path, every directory on the way is
followed wherever it points. Whoever can write a directory on the way (a shared root
holding the step directories, a step holding key-prefix directories) could swap one for
a link after the save made it or the deletion checked it, and the write or removal would
land in the link's target. Here the parent of ``directory`` is opened as given (the
place the user chose), then ``directory`` and each directory in ``name`` are opened by
name inside the one above, refusing a link (``O_NOFOLLOW``): a link swapped in anywhere
makes the walk fail before anything is written or removed, and the caller acts on the
last name inside the directory so opened (``dir_fd``).
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
_TOP_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
# New directories get 0o777 less the umask, as ``os.makedirs`` gives them.
_DIR_MODE = 0o777

#: Whether this platform opens and removes names inside an open directory without
#: following links; where it does not, removals go by path after a check for links.
WALKS_SAFELY = (
    hasattr(os, "O_DIRECTORY")
    and hasattr(os, "O_NOFOLLOW")
    and {os.open, os.unlink, os.rmdir, os.rename, os.stat} <= os.supports_dir_fd
)
#: Whether it also creates directories and links inside an open directory: where it does
#: not, writes go by path (following the directories on the way, as before).
WRITES_SAFELY = WALKS_SAFELY and {os.mkdir, os.link} <= os.supports_dir_fd


def walk_plan(directory: str, name: str, itself: bool, action: str) -> tuple[str, list[str]]:
    """``(top, parts)``: where the walk starts (``directory``'s parent, taken as given:
    the place the user chose; ``directory`` itself where it ends in no name of its own:
    ``/``, ``.``, ``..``, or empty for the current directory) and the names to
    walk from there: ``directory``'s own, then those of ``name`` (``/``-separated,
    relative; empty only where ``itself`` allows acting on ``directory`` itself; never
    ending in ``/`` for a write, which makes a file). Refuses what would leave the
    directory (``action`` names what was refused)."""
    stripped = directory.rstrip(os.sep) or (os.sep if directory else os.curdir)
    head = os.path.basename(stripped)
    if head in (".", ".."):
        head = ""
    top = (os.path.dirname(stripped) or os.curdir) if head else stripped
    parts = [p for p in name.split("/") if p]
    done = "written" if action == "write" else "removed"
    if (
        name.startswith("/")
        or (not parts and not itself)
        or (action == "write" and name.endswith("/"))
        or any(p in (".", "..") or os.sep in p or "\0" in p for p in parts)
    ):
        raise UnsafeCheckpointError(
            f"refusing to {action} {name!r} under {directory!r}: it is not a plain relative "
            "name inside that directory (a checkpoint's names never hold '..', '.', an "
            f"absolute path or a NUL, nor a file's end in '/'); nothing was {done}"
        )
    parts = ([head] if head else []) + parts
    if not parts:
        raise UnsafeCheckpointError(
            f"refusing to {action} {directory!r} itself: it names no directory inside a "
            "parent (the file system root, '.' or '..'); nothing was " + done
        )
    return top, parts


@contextlib.contextmanager
def opened_parent(
    directory: str, name: str, *, itself: bool = False, create: bool = False, action: str = "remove"
) -> Iterator[tuple[int, str]]:
    """``(fd, last)``: the directory that holds ``directory/name``, opened by walking
    from ``directory``'s parent with no link followed at ``directory`` or below it
    (:func:`walk_plan`), and the last name to act on there. With ``create``, missing
    directories are made on the way (``directory``'s parent by path, the rest inside the
    directory above, each new name made durable there)."""
    safe = WRITES_SAFELY if create else WALKS_SAFELY
    if not safe:
        raise UnsafeCheckpointError(
            f"refusing to {action} {name or directory!r}: this platform cannot open "
            "directories without following symbolic links (os.supports_dir_fd), so it could "
            f"land outside the checkpoint; {action} the files by hand"
        )
    top, parts = walk_plan(directory, name, itself, action)
    try:
        fd = os.open(top, _TOP_FLAGS)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(top, exist_ok=True)
        fd = os.open(top, _TOP_FLAGS)
    try:
        walked = top
        for part in parts[:-1]:
            walked = os.path.join(walked, part)
            try:
                below = _open_below(fd, part, walked, create)
            except OSError as exc:  # named by its full path, not the name in its parent
                raise type(exc)(exc.errno, exc.strerror, walked) from None
            if below is None:
                raise linked_error(directory, name, walked, action)
            os.close(fd)
            fd = below
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _open_below(fd: int, part: str, walked: str, create: bool) -> int | None:
    """``part`` opened inside ``fd`` without following a link (made first where it is
    missing and ``create``); ``None`` where it is a link."""
    for _ in range(2):
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):  # made meanwhile: opened next
                os.mkdir(part, _DIR_MODE, dir_fd=fd)
                os.fsync(fd)  # the new directory's name, durable where it lives
        except OSError as exc:
            # Linux and macOS say ELOOP for a link under O_NOFOLLOW, FreeBSD EMLINK.
            if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) and is_link_at(part, fd):
                return None
            raise
    return os.open(part, _DIR_FLAGS, dir_fd=fd)


def linked_error(directory: str, name: str, walked: str, action: str) -> UnsafeCheckpointError:
    """The refusal of an ``action`` on ``directory/name`` because ``walked``, on the way
    to it, is a symbolic link."""
    done = "written" if action == "write" else "removed"
    return UnsafeCheckpointError(
        f"refusing to {action} {os.path.join(directory, name)!r}: {walked!r} is a symbolic "
        f"link where the checkpoint has a directory, and nothing is {done} through a link; "
        f"nothing was {done} there. Whoever can write its parent may have swapped it in: "
        "remove the link itself, and make that directory writable by you only"
        + (", then save again" if action == "write" else "")
    )


def is_link_at(name: str, dir_fd: int) -> bool:
    """Whether ``name`` inside the open directory ``dir_fd`` is a symbolic link."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
