"""The latest-step pointer: a small object, ``.dcp-latest``, beside numbered
checkpoints that names the newest one committed there, read by name, so that a listing
that lags behind the store or misses objects cannot send a fresh process back to an
older step.

A listing of a root of ``step-<N>`` checkpoints is the store's index, and on some
stores (an S3-compatible store whose index lags, an eventually consistent LIST) it can
miss the newest step for a while; a process asks by name only for the steps it saw
committed itself (``siblings``), and a restarted job saw none. So each commit of a
checkpoint's ``.metadata`` into a directory named ``step-<N>`` then writes
``<parent>/.dcp-latest`` (:func:`publish`), atomically and by name, holding ``step-<N>\\n``:
after the commit marker, never before, and never naming a step below the one it already
names while that one is committed, whoever else publishes into that root at the same
time (two managers, a manager and a ``dcp.save`` of a numbered step, two jobs). Where
the backend can compare and swap (``storage.backends.swap``: local disk under a
``flock`` of the root, S3 with ``If-Match``, GCS with ``ifGenerationMatch``), the
pointer is replaced only while it is still what was read, else read and decided again:
no request more than a plain write (the condition rides on the upload). Elsewhere
(other fsspec URLs) it is read back after the write (one GET more) and written again
where a concurrent publish of a lower step undid it, which leaves a window: that
publish writing after the read-back.
:func:`unlisted` reads it back (one request) for ``siblings.names_under``, so every
step listing of a root (a manager's ``steps()``, ``latest()``, its loads, retention, an
incremental save's base) sees the pointed step when the listing misses it.

The pointer is a hint, never the commit: a step exists once its metadata does. A
pointer is trusted only for a step that is committed, asked by name; one naming an
absent or uncommitted step, one that is not ours (anything but ``step-<N>`` and an
optional line break, at most :data:`MAX_SIZE` bytes) or one that cannot be read is
logged and passed over, and the listing decides, as at a root written before the
pointer existed. A pointer that is not ours is never overwritten. A deletion of the
step it names removes it (:func:`withdraw`), where the backend swaps removals (local
disk, S3; not GCS) only while it still names that step, so a newer step published
meanwhile keeps its pointer.
Rank-local metadata (``use_collectives=False``) writes no pointer: every rank commits
its own.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading

from extensions.errors import UnsafeCheckpointError, quote
from storage.backends.base import FileSystemBase
from storage.backends.swap import Swapping, SwappingRemovals
from storage.checkpoint import heartbeat
from storage.checkpoint.layout import is_committed, parse_step, split_location

log = logging.getLogger(__name__)

#: The pointer's name, beside the ``step-<N>`` directories: ours, hidden on local disk,
#: never a user's ``latest`` (a link to the newest step, DeepSpeed's tag file).
NAME = ".dcp-latest"
# The pointer's temporary while it is written (local disk).
_TEMPORARY = re.compile(re.escape(NAME) + r"\.tmp-[0-9a-zA-Z]+")
#: Most bytes a pointer may hold (``step-`` and 20 digits, with room to spare).
MAX_SIZE = 64
#: Most reads and writes of one publish: each round that does not settle it saw another
#: publish settle in between, so more rounds than concurrent committers are never needed.
_ROUNDS = 8

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()  # (pointer URL, what was wrong): logged once
#: Past this many, what was warned about is forgotten (a pointer rewritten with new
#: content again and again would otherwise grow the set for as long as the process runs).
_MAX_WARNED = 1024


def parse(data: bytes, url: str) -> str:
    """The step directory name a pointer holding ``data`` names; raises
    :class:`UnsafeCheckpointError` for content that is not a pointer of ours."""
    text = data[:-1] if data.endswith(b"\n") else data
    try:
        name = text.decode("ascii") if len(data) <= MAX_SIZE else ""
    except UnicodeDecodeError:
        name = ""
    if parse_step(name) is None:
        raise UnsafeCheckpointError(
            f"{url} is not a latest-step pointer of dcp-storage (it holds {quote(data)}; one "
            f"holds `step-<N>`, at most {MAX_SIZE} bytes): it is ignored and never "
            "overwritten, and the listing "
            "alone finds the newest step. Remove or rename that object if it is not wanted"
        )
    return name


def read(fs: FileSystemBase, parent: str) -> str | None:
    """The step directory name the pointer under ``parent`` holds (``None``: there is no
    pointer); raises :class:`UnsafeCheckpointError` for content that is not ours, and
    the backend's error for a pointer that cannot be read. Reads at most
    :data:`MAX_SIZE` + 1 bytes."""
    path = fs.concat_path(parent, NAME)
    try:
        data = fs.read_bytes(path, limit=MAX_SIZE)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return parse(data, fs.url(path))


def _warn_once(fs: FileSystemBase, parent: str, why: str) -> None:
    key = (fs.url(fs.concat_path(parent, NAME)), why)
    with _lock:
        if key in _warned:
            return
        if len(_warned) >= _MAX_WARNED:
            _warned.clear()
        _warned.add(key)
    log.warning("%s", why)


def unlisted(fs: FileSystemBase, parent: str, names: list[str]) -> str | None:
    """The step the pointer under ``parent`` names when the listing ``names`` misses it
    and it is committed (asked by name), else ``None``. A pointer that is not ours,
    cannot be read, or names a step the listing misses that is not committed is logged
    (once per process) and passed over: the listing decides (a listed step is the
    listing's to check, as every listed step is)."""
    url = fs.url(fs.concat_path(parent, NAME))
    try:
        name = read(fs, parent)
    except IsADirectoryError:
        return None  # a directory of that name is no pointer
    except UnsafeCheckpointError as exc:
        _warn_once(fs, parent, str(exc))
        return None
    except Exception as exc:
        _warn_once(
            fs,
            parent,
            f"cannot read the latest-step pointer {url} ({type(exc).__name__}: {exc}); "
            "the listing alone finds the newest step",
        )
        return None
    if name is None or name in names:
        return None
    if is_committed(fs, fs.concat_path(parent, name)):
        return name
    _warn_once(
        fs,
        parent,
        f"the latest-step pointer {url} names {name}, which is not a committed checkpoint "
        "(deleted since, or its metadata cannot be seen yet); the listing alone finds the "
        "newest step",
    )
    return None


def _versioned(fs: FileSystemBase, parent: str) -> tuple[str | None, str | None]:
    """What :func:`read` returns, and the version read where ``fs`` swaps (else ``None``;
    ``None, None``: no pointer)."""
    if not isinstance(fs, Swapping):
        return read(fs, parent), None
    path = fs.concat_path(parent, NAME)
    try:
        data, version = fs.read_versioned(path, limit=MAX_SIZE)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    return parse(data, fs.url(path)), version


def publish(fs: FileSystemBase, directory: str) -> None:
    """After ``.metadata`` was committed in ``directory``: when it is named ``step-<N>``,
    point its parent's pointer at it, unless the pointer names a higher step that is
    still committed, or is not ours. Where ``fs`` swaps (``storage.backends.swap``) the
    pointer is replaced only while it is still what was read, else read again and
    decided again; elsewhere it is written, then read back and written again where a
    concurrent publish of a lower step undid it (the window left: that publish writing
    after this read-back). At most :data:`_ROUNDS` rounds. Never raises: a failure is
    logged (the checkpoint is committed whatever happens to the hint)."""
    location = split_location(fs, fs.own_path(directory))  # swaps take own paths only
    step = None if location is None else parse_step(location[1])
    if location is None or step is None:
        return
    parent, name = location
    path = fs.concat_path(parent, NAME)
    try:
        # In the root as the user named it (a link there followed), never through a link
        # swapped in below it (write_atomic_in).
        home = heartbeat.resolved(fs, parent)
        for _ in range(_ROUNDS):
            try:
                current, version = _versioned(fs, parent)
            except (UnsafeCheckpointError, IsADirectoryError) as exc:
                _warn_once(fs, parent, str(exc))  # what `unlisted` logs: once for both
                return
            if current is not None:
                held = parse_step(current)
                if held == step:
                    return
                newer = held is not None and held > step
                if newer and is_committed(fs, fs.concat_path(parent, current)):
                    return
            data = f"{name}\n".encode()
            if not isinstance(fs, Swapping):
                fs.write_atomic_in(home, NAME, data)  # then read back: the next round
            elif fs.replace_if(home, NAME, data, version):
                return
        raise RuntimeError(f"concurrent updates changed it {_ROUNDS} times in a row")
    except Exception as exc:
        log.warning(
            "%s is committed, but the latest-step pointer %s was not updated (%s: %s); a "
            "fresh process whose listing misses %s may resume from an older step",
            fs.url(directory),
            fs.url(path),
            type(exc).__name__,
            exc,
            name,
        )


def withdraw(fs: FileSystemBase, directory: str) -> None:
    """After the checkpoint in ``directory`` was deleted: remove its parent's pointer if
    it names it (the listing then decides, as at a root without one); where ``fs``
    swaps removals, only while it is still what was read, so a newer step published
    meanwhile keeps its pointer. Never raises."""
    location = split_location(fs, fs.own_path(directory))  # swaps take own paths only
    if location is None or parse_step(location[1]) is None:
        return
    path = fs.concat_path(location[0], NAME)
    try:
        # In the root as the user named it, never through a link swapped in since.
        home = heartbeat.resolved(fs, location[0])
        current, version = _versioned(fs, location[0])
        if current != location[1]:
            return
        if isinstance(fs, SwappingRemovals) and version is not None:
            fs.remove_if(home, NAME, version)  # False: published anew since, kept
        else:
            fs.rm_file_in(home, NAME)
    except FileNotFoundError:
        pass
    except Exception as exc:
        log.warning(
            "%s was deleted, but the latest-step pointer %s naming it stays (%s: %s); it "
            "is passed over while it names no committed step",
            fs.url(directory),
            fs.url(path),
            type(exc).__name__,
            exc,
        )


def stale_temporaries(fs: FileSystemBase, parent: str, horizon: float) -> list[str]:
    """The names of the pointer's temporaries in ``parent`` last changed before
    ``horizon`` (a ``time.time()``): what a process killed while it wrote the pointer
    left (``gc`` removes them)."""
    try:
        names = [n for n in fs.ls(parent) if _TEMPORARY.fullmatch(n)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    stale = []
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            mtime = fs.modified(fs.concat_path(parent, name))
            if mtime is not None and mtime < horizon:
                stale.append(name)
    return stale
