"""Following a symbolic link at a checkpoint path on local disk only where it is trusted.

A save, a deletion or a safetensors write resolves the checkpoint path once as it
begins (a user may make it a link: ``/scratch/ckpt -> /data/run``), then acts below what
it resolved without following a link there (:mod:`~storage.backends._local_walk`); a
load checks it the same way before it reads anything.
Whoever else can write the directory that holds the path (a shared ``/scratch``) can put
a link of their own there: on many ranks, a rank that begins after another made the
directory would follow a link swapped in meanwhile into a directory of their choosing.
Here a link is followed only as the kernel's ``protected_symlinks`` follows one in a
sticky world-writable directory: where it is owned by this process's effective user, by
root, or by the owner of the directory that holds it (who could replace anything there
anyway), or where that directory is writable by its owner only (only they or root put a
name there, whoever the link's owner); each link of a chain so. Any other raises
``UnsafeCheckpointError`` naming the link, its owner and the fix. The directories above
the checkpoint path (and above each link's target) are taken as given, as the walk takes
them; the last name the chain leads to is returned unresolved, so a link swapped in
there later fails the walk.
"""

from __future__ import annotations

import errno
import os
import stat

from extensions.errors import UnsafeCheckpointError, quote

# What the kernel follows before it says ELOOP.
_MAX_LINKS = 40
# A directory only its owner can write: only they (or root) put a name there.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH
_HOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def trusted_target(path: str) -> str:
    """``path`` itself where it is no symbolic link; where it is one, what it leads to
    (the directories on the way resolved, the last name kept), each link of the chain
    checked as the module docstring says. Where the platform has no user ids (Windows),
    the link is followed as ``os.path.realpath`` follows it."""
    if not hasattr(os, "geteuid"):
        return os.path.realpath(path) if os.path.islink(path) else path
    current = path
    for _ in range(_MAX_LINKS):
        target = _trusted_link(path, current)
        if target is None:
            break
        holder = os.path.dirname(current.rstrip(os.sep)) or os.curdir
        current = os.path.join(holder, target)
    else:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    if current == path:
        return path
    head, name = os.path.split(current.rstrip(os.sep) or os.sep)
    if name in ("", ".", ".."):
        return os.path.realpath(current)
    return os.path.join(os.path.realpath(head or os.curdir), name)


def _trusted_link(path: str, link: str) -> str | None:
    """The target of ``link`` (on the way from the checkpoint path ``path``) where it is
    a link this process may follow; ``None`` where it is no link (or missing);
    ``UnsafeCheckpointError`` where it is someone else's."""
    holder_path, name = os.path.split(link.rstrip(os.sep) or os.sep)
    if name in ("", ".", ".."):
        return None
    try:
        holder = os.open(holder_path or os.curdir, _HOLDER_FLAGS)
    except OSError:
        return None  # missing: nothing to follow, the save makes it
    try:
        before = os.stat(name, dir_fd=holder, follow_symlinks=False)
        if not stat.S_ISLNK(before.st_mode):
            return None
        target = os.readlink(name, dir_fd=holder)
        after = os.stat(name, dir_fd=holder, follow_symlinks=False)
        held_by = os.fstat(holder)
    except FileNotFoundError:
        return None
    finally:
        os.close(holder)
    if (after.st_dev, after.st_ino, after.st_uid) != (before.st_dev, before.st_ino, before.st_uid):
        raise UnsafeCheckpointError(
            f"refusing to follow the checkpoint path {path!r}: the symbolic link {link!r} "
            "was replaced while it was read, which only someone racing this process does; "
            f"nothing was read, written or removed. Make {holder_path or os.curdir!r} "
            "writable by you only, then try again"
        )
    owner = held_by.st_uid
    if before.st_uid in (os.geteuid(), 0, owner) or not held_by.st_mode & _SHARED_WRITE:
        return target
    through = "" if link == path else f" leads through {link!r}, which"
    raise UnsafeCheckpointError(
        f"refusing to follow the checkpoint path {path!r}: it{through} is a symbolic link "
        f"of user id {before.st_uid}'s (to {quote(target)}), in {holder_path or os.curdir!r}, "
        f"a directory of user id {owner}'s that others can write; a link there is "
        "followed only where it is yours, root's or the directory owner's (as the "
        "kernel's protected_symlinks follows links), since anyone else who can write that "
        "directory may have put it there to redirect what is saved or loaded; nothing was "
        "read, written or removed. Remove the link, or "
        "make it yourself (ln -sfn TARGET PATH) if you trust its target, and make that "
        "directory writable by you only"
    )
