"""Heartbeats: a writer's own record, under the checkpoint directory it writes in, that
it is writing there now.

A save (each rank's data phase), a ``cp`` and a drain keep a small object
``.heartbeat-<token>`` in the checkpoint directory while they write data files there:
written before the first data file is opened, rewritten with the writer's wall clock
every :data:`INTERVAL` seconds, removed once their data files are written or removed.
``gc`` trusts it rather than the store's own dates: an upload under a directory with a
live heartbeat is never aborted (``ops.uploads``), and no data file of a checkpoint with
one is swept as an orphan, whatever the store says of their age (some stores misdate
uploads: moto dates every one 2010-11-10).

A heartbeat is live while the time it holds is less than ``max(grace, LIFETIME)``
seconds behind the reader's clock (one ahead of it is live). What is trusted: the
writer's and ``gc``'s wall clocks agree to within that, and a live writer rewrites the
object at least once per :data:`LIFETIME` (a store stalled longer than that, with the
writer still alive, can lose it the protection). A heartbeat whose content cannot be
read is aged by the store's modification time, and is live where the store cannot
tell. A killed writer leaves its heartbeat behind: it goes stale after
:data:`LIFETIME` and ``gc`` removes it like any leftover of an interrupted save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

from storage.backends.base import FileSystemBase

log = logging.getLogger(__name__)

#: Seconds between two rewrites of a heartbeat.
INTERVAL = 30.0
#: Seconds after its last rewrite that a heartbeat counts as live, at least.
LIFETIME = 300.0
PREFIX = ".heartbeat-"
_NAME = re.compile(re.escape(PREFIX) + r"[0-9a-zA-Z]+")
_MAX_SIZE = 4096  # what we write is ~60 bytes; anything bigger is not ours to parse


def name_of(token: str) -> str:
    """The heartbeat file name of ``token`` (letters and digits)."""
    name = PREFIX + token
    if not _NAME.fullmatch(name):
        raise ValueError(f"a heartbeat token is letters and digits, got {token!r}")
    return name


def is_heartbeat_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


Guard = Callable[[Callable[[], None]], object]


def _direct(request: Callable[[], None]) -> None:
    request()


@contextlib.contextmanager
def beating(
    fs: FileSystemBase,
    path: str,
    token: str,
    *,
    guard: Guard = _direct,
    home: str | None = None,
) -> Iterator[None]:
    """Keep ``path/.heartbeat-<token>`` live while the block runs (see the module
    docstring): written before the block starts, removed when it ends, however it ends.
    ``guard(request)`` runs those two requests (a save's deadline: one that cannot be
    removed in time stays for ``gc``). A failed rewrite is logged and retried at the next
    beat, never raised: the protection it buys is gc's, not the write's. The marker is
    written and removed in ``home``, ``path`` as the writer resolved it once at its start
    (:func:`resolved`: a link the user named at ``path`` itself is followed, none below
    it; default: resolved now), never through a link (``create_stream_in``,
    ``rm_file_in``)."""
    name = name_of(token)
    marker = fs.concat_path(path, name)
    path = resolved(fs, path) if home is None else home
    guard(lambda: _beat(fs, path, name))  # a write creates its parents: no mkdir request
    stop = threading.Event()
    thread = threading.Thread(
        target=_keep_beating, args=(fs, path, name, stop), daemon=True, name="dcp-heartbeat"
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()  # a beat in flight removes the marker itself once it lands
        try:
            guard(lambda: fs.rm_file_in(path, name))
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("could not remove %s (gc removes it once stale): %s", fs.url(marker), exc)


def resolved(fs: FileSystemBase, path: str) -> str:
    """The directory a checkpoint path the user named resolves to where it is itself a
    symbolic link the user may follow (its files were written through it), else
    ``path``: what the writes and removals of a checkpoint's files act on, never through
    a link below it. A neighbour's link there raises ``UnsafeCheckpointError``
    (``FileSystemBase.resolve_link``: the one place that decides)."""
    return fs.resolve_link(path)


def live(fs: FileSystemBase, path: str, grace_seconds: float) -> tuple[list[str], list[str]]:
    """The heartbeat names in ``path``, as ``(live, stale)`` by ``grace_seconds`` (see
    the module docstring). A missing directory has none."""
    try:
        names = [n for n in fs.ls(path) if is_heartbeat_name(n)]
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    horizon = time.time() - max(grace_seconds, LIFETIME)
    fresh: list[str] = []
    stale: list[str] = []
    for name in names:
        try:
            stamp = _stamp(fs, fs.concat_path(path, name))
        except FileNotFoundError:
            continue  # removed meanwhile: its writer is done
        (fresh if stamp is None or stamp > horizon else stale).append(name)
    return fresh, stale


def _stamp(fs: FileSystemBase, marker: str) -> float | None:
    """The writer's time in ``marker``; the store's modification time when the content is
    not a heartbeat we wrote; ``None`` when neither says."""
    if fs.size(marker) <= _MAX_SIZE:
        # Whoever can write the directory can write this file: 3 KiB of "[" raises
        # RecursionError in the JSON decoder, which failed every gc of the root. The
        # size may understate it (a lying HEAD, a file replaced since): read within it.
        with contextlib.suppress(ValueError, TypeError, KeyError, RecursionError):
            data = fs.read_bytes(marker, limit=_MAX_SIZE)
            stamp = json.loads(data)["time"] if len(data) <= _MAX_SIZE else None
            if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
                return float(stamp)
    return fs.modified(marker)


def _beat(fs: FileSystemBase, path: str, name: str) -> None:
    # Not durable, not atomic on local disk: a torn one is aged by its file time.
    with fs.create_stream_in(path, name) as out:
        out.write(json.dumps({"time": time.time(), "interval": INTERVAL}).encode())


def _keep_beating(fs: FileSystemBase, path: str, name: str, stop: threading.Event) -> None:
    while not stop.wait(INTERVAL):
        try:
            _beat(fs, path, name)
        except Exception as exc:
            marker = fs.url(fs.concat_path(path, name))
            log.warning("could not refresh %s (retried in %.0f s): %s", marker, INTERVAL, exc)
        if stop.is_set():  # the holder finished while this beat was in flight
            _remove(fs, path, name)


def _remove(fs: FileSystemBase, path: str, name: str) -> None:
    try:
        fs.rm_file_in(path, name)
    except FileNotFoundError:
        pass
    except Exception as exc:
        marker = fs.url(fs.concat_path(path, name))
        log.warning("could not remove %s (gc removes it once stale): %s", marker, exc)
