"""The staging areas of consolidating saves: ``<model>/.dcp-staging-<save id>/``, their
heartbeats, their removal after the commit, and the sweep of those a killed save left.

A consolidating :class:`SafetensorsWriter` save stages each rank's shards in
``rank-<R>.bin`` objects of its own area and removes the area once the index is
published. While a rank stages and while the coordinator assembles the files, each keeps
a heartbeat (``checkpoint.heartbeat``) in the area. A save killed in between leaves the
area behind; it is swept by the next save to the same model folder and by
``dcp-storage gc``, under the rule ``gc`` applies to interrupted checkpoint saves: an
area is stale when it has no live heartbeat and every object in it is older than the
grace period (choose more than your longest save). An area whose age the backend cannot
tell, that holds anything but staging objects and heartbeats, or that is a symbolic
link, is kept; the area of the sweeping save itself is never looked at.

The same sweep removes the temporaries of a model file killed mid-write on local disk
(``model-00001-of-00004.safetensors.tmp-<id>``: ``files.publish_file`` writes there and
renames into place): stale when older than the grace period, its age known, and not a
symbolic link. Nothing else removes them, and each is up to a shard's size.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Iterable, Iterator

from extensions.errors import UnsafeCheckpointError
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat
from storage.checkpoint.commit import remove_quietly

log = logging.getLogger(__name__)

STAGING_PREFIX = ".dcp-staging-"
#: Seconds after which the next save removes an abandoned area (``gc``'s default grace).
STALE_AFTER = 3600.0
_AREA = re.compile(re.escape(STAGING_PREFIX) + r"[0-9a-f]+")
_OBJECT = re.compile(r"rank-[0-9]{5}\.bin")
_MODEL_FILE = re.compile(r"model(-([0-9a-f]{8}-)?[0-9]{5}-of-[0-9]{5})?\.safetensors")
_TEMPORARY = re.compile(_MODEL_FILE.pattern + r"\.tmp-[0-9a-f]{12}")


def new_area() -> str:
    """A fresh staging area's name, unique to one save."""
    return f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"


def object_name(area: str, rank: int) -> str:
    """The staging object of ``rank`` in ``area``, relative to the model's root."""
    return f"{area}/rank-{rank:05d}.bin"


def is_area_name(name: str) -> bool:
    return _AREA.fullmatch(name) is not None


def is_model_file_name(name: str) -> bool:
    """Whether ``name`` is a model file an export or a save writes (``model.safetensors``,
    ``model-00001-of-00004.safetensors``, ``model-1a2b3c4d-00001-of-00004.safetensors``):
    what ``gc`` lists the open uploads of, and what replacing a model removes."""
    return _MODEL_FILE.fullmatch(name) is not None


def is_staging_object(path: str) -> bool:
    """Whether ``path`` (any form, ``/``-separated) is a staging object of an area."""
    parts = path.rstrip("/").rsplit("/", 2)
    return len(parts) >= 2 and is_area_name(parts[-2]) and _OBJECT.fullmatch(parts[-1]) is not None


@contextlib.contextmanager
def beating(fs: FileSystemBase, root: str, area: str, *, home: str | None = None) -> Iterator[None]:
    """Keep a heartbeat in ``root/area`` while the block runs: the sweep's proof that
    the save is alive, whatever the store's dates say; written in ``home/area`` where
    given (``root`` as the save resolved it when it began)."""
    where = None if home is None else fs.concat_path(home, area)
    with heartbeat.beating(fs, fs.concat_path(root, area), uuid.uuid4().hex[:12], home=where):
        yield


def remove_staging(fs: FileSystemBase, root: str, objects: Iterable[str]) -> None:
    """Remove the staging objects (relative to ``root``) and their areas, quietly (an
    area left behind is swept later); in the directory ``root`` resolves to where the
    user named a link to their own directory (:func:`heartbeat.resolved`)."""
    root = heartbeat.resolved(fs, root)
    areas = set()
    for name in set(objects):
        areas.add(name.rsplit("/", 1)[0])
        with contextlib.suppress(FileNotFoundError, UnsafeCheckpointError):
            fs.rm_file_in(root, name)  # a link swapped in is refused; the sweep reports it
    for area in areas:
        try:
            fs.rm_dir_in(root, area)
        except (OSError, UnsafeCheckpointError) as exc:
            log.warning("could not remove %s (swept later): %s", fs.url(root) + "/" + area, exc)


def sweep(
    fs: FileSystemBase, root: str, grace_seconds: float, *, dry_run: bool = False
) -> list[str]:
    """The stale staging areas in ``root`` (see the module docstring), removed unless
    ``dry_run``; their URLs. A failure to remove one is logged, never raised."""
    if not isinstance(grace_seconds, (int, float)) or grace_seconds < 0:
        raise ValueError(f"grace_seconds must be a number >= 0, got {grace_seconds!r}")
    try:
        listed = fs.ls(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = [n for n in listed if is_area_name(n)]
    found = _sweep_temporaries(
        fs, root, [n for n in listed if _TEMPORARY.fullmatch(n)], grace_seconds, dry_run
    )
    for name in names:
        area = fs.concat_path(root, name)
        doomed = _stale(fs, area, grace_seconds)
        if doomed is None:
            continue
        found.append(fs.url(area))
        if dry_run:
            continue
        log.info("%s: removing the staging area of an interrupted safetensors save", fs.url(area))
        try:
            for entry in doomed:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file_in(root, f"{name}/{entry}")
            fs.rm_dir_in(root, name)
        except Exception as exc:
            log.warning("could not remove %s: %s", fs.url(area), exc)
    return found


def _sweep_temporaries(
    fs: FileSystemBase, root: str, names: list[str], grace_seconds: float, dry_run: bool
) -> list[str]:
    """The stale model-file temporaries among ``names`` in ``root`` (see the module
    docstring), removed unless ``dry_run``; their URLs."""
    horizon = time.time() - grace_seconds
    found = []
    for name in names:
        path = fs.concat_path(root, name)
        try:
            if fs.is_link(path):
                continue
            stamp = fs.modified(path)
        except FileNotFoundError:
            continue
        if stamp is None or stamp >= horizon:
            continue
        found.append(fs.url(path))
        if dry_run:
            continue
        log.info("%s: removing the temporary of an interrupted safetensors write", fs.url(path))
        remove_quietly(fs, root, [name])
    return found


def _stale(fs: FileSystemBase, area: str, grace_seconds: float) -> list[str] | None:
    """The names in ``area`` if it is stale, else ``None``."""
    if fs.is_link(area):
        log.warning("%s is a symbolic link: kept, never deleted through", fs.url(area))
        return None
    try:
        names = fs.ls(area)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if heartbeat.live(fs, area, grace_seconds)[0]:
        return None  # a save is staging or assembling from here
    if not all(_OBJECT.fullmatch(n) or heartbeat.is_heartbeat_name(n) for n in names):
        log.info("%s: not cleaned up, it holds files that are not ours", fs.url(area))
        return None
    horizon = time.time() - grace_seconds
    try:
        times = [fs.modified(fs.concat_path(area, n)) for n in names] or [fs.modified(area)]
    except FileNotFoundError:
        return None
    return names if all(t is not None and t < horizon for t in times) else None
