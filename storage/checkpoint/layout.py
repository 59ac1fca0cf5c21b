"""What is, and is not, a checkpoint on storage.

A checkpoint is a directory (or prefix) holding ``.metadata`` (or rank-local
``__{rank}.metadata``) and ``*.distcp`` data files; it exists once its metadata does.
:func:`committing_metadata` is the one rule for which metadata files make it: every
listing (:func:`metadata_names`, :func:`is_committed`) and the read model of a committed
checkpoint (``committed``, which reader tools, copies and deletions use) ask it.
The manager, the CLI and the recovery transport use these rules to list checkpoints
and to delete only what they recognise (``deletion``): directories named exactly
``step-<N>`` (``N`` in canonical decimal form) and, inside them, only checkpoint files
(:func:`is_data_file_name`: ``[<key prefix>/]__{rank}_{n}[-{save_id}].distcp``; listings
see into key prefix directories through ``prefixes.expand``).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass

from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.heartbeat import is_heartbeat_name
from storage.checkpoint.prefixes import PREFIX, expand

STEP_PREFIX = "step-"
_STEP_NAME = re.compile(r"step-(0|[1-9][0-9]*)")
_METADATA_NAME = re.compile(r"(__[0-9]+)?\.metadata")
_RANK_METADATA = re.compile(r"__([0-9]+)\.metadata")
_METADATA_TMP = re.compile(r"(__[0-9]+)?\.metadata\.tmp-[0-9a-zA-Z]+")
# Ours (``__0_3-<save_id>.distcp``) and stock DCP's (``__0_3.distcp``).
# Either may sit under one key prefix directory (``0a/__10_0-<save_id>.distcp``).
_DATA_NAME = re.compile(
    r"(" + PREFIX.pattern + r"/)?__[0-9]+_[0-9]+(-[0-9a-zA-Z]+)?" + re.escape(fmt.DATA_SUFFIX)
)


def parse_step(name: str) -> int | None:
    """The step of a directory named ``step-<N>`` (canonical decimal), else ``None``."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def is_metadata_name(name: str) -> bool:
    """``.metadata`` or a rank-local ``__{rank}.metadata``."""
    return _METADATA_NAME.fullmatch(name) is not None


def is_data_file_name(name: str) -> bool:
    """``__{rank}_{n}.distcp`` (stock DCP) or ``__{rank}_{n}-{save_id}.distcp`` (ours),
    either alone or under one key prefix (``0a/...``, ``prefixes.PREFIX``): the only
    names any deletion path removes as data files."""
    return _DATA_NAME.fullmatch(name) is not None


def is_metadata_temporary(name: str) -> bool:
    """A metadata file's temporary (``.metadata.tmp-<random>``): what a save killed
    between writing it and renaming it into place leaves, and a deletion's move aside."""
    return _METADATA_TMP.fullmatch(name) is not None


def is_checkpoint_file_name(name: str) -> bool:
    """A file a checkpoint save writes: metadata, its temporaries, a data file, or the
    heartbeat of a writer (``heartbeat``)."""
    return (
        is_metadata_name(name)
        or _METADATA_TMP.fullmatch(name) is not None
        or is_data_file_name(name)
        or is_heartbeat_name(name)
    )


def metadata_rank(name: str) -> int | None:
    """The rank of a rank-local ``__{rank}.metadata``; ``None`` for ``.metadata``."""
    match = _RANK_METADATA.fullmatch(name)
    return int(match.group(1)) if match else None


def committing_metadata(names: list[str]) -> list[str]:
    """Of the file names in one directory, the metadata that commit it: ``.metadata``
    when present (it wins, as in torch's load), else every rank-local
    ``__{rank}.metadata`` (a save with ``use_collectives=False``) by rank."""
    if fmt.METADATA_NAME in names:
        return [fmt.METADATA_NAME]
    ranked = sorted((rank, n) for n in names if (rank := metadata_rank(n)) is not None)
    return [n for _, n in ranked]


def present_metadata(
    fs: FileSystemBase, path: str, names: list[str], *, global_absent: bool = False
) -> list[str]:
    """The metadata files in the directory at ``path`` whose listing is ``names``: the
    listed ones and those a listing that lags or misses objects may not show, asked for
    by name. Without ``.metadata`` listed, it is asked for (unless ``global_absent``:
    the caller just did); without it found, each rank's ``__{rank}.metadata`` from rank
    0 up, through the highest rank listed and on while each is found: two looks for a
    directory without metadata, one more than the listing for a rank-local checkpoint.
    A rank's metadata is missed only where the listing misses it and no rank below has
    one (a rank-local save that failed on a lower rank)."""
    listed = [n for n in names if is_metadata_name(n)]
    if fmt.METADATA_NAME in listed:
        return listed
    if not global_absent and fs.exists(fs.concat_path(path, fmt.METADATA_NAME)):
        return [fmt.METADATA_NAME, *listed]
    top = max((r for n in listed if (r := metadata_rank(n)) is not None), default=-1)
    found, rank = list(listed), 0
    while True:
        name = fmt.metadata_name(rank)
        if name not in listed:
            if fs.exists(fs.concat_path(path, name)):
                found.append(name)
            elif rank > top:
                return found
        rank += 1


def metadata_names(fs: FileSystemBase, path: str) -> list[str]:
    """The metadata files that commit the checkpoint at ``path`` (see
    :func:`committing_metadata`; a listing that misses some is not trusted:
    :func:`present_metadata`); empty when it is not a committed checkpoint."""
    if fs.exists(fs.concat_path(path, fmt.METADATA_NAME)):
        return [fmt.METADATA_NAME]  # the common case costs one request, not a listing
    try:
        names = fs.ls(path)
    except FileNotFoundError:
        names = []  # a listing that lags may not show the directory yet
    except NotADirectoryError:
        return []
    return committing_metadata(present_metadata(fs, path, names, global_absent=True))


def is_committed(fs: FileSystemBase, path: str) -> bool:
    """Whether ``path`` holds a committed checkpoint (global or rank-local metadata)."""
    return bool(metadata_names(fs, path))


def make_directory(fs: FileSystemBase, path: str) -> None:
    """Create the checkpoint directory ``path`` (and its parents) before anything is
    written into it, refusing a plain file in its place (or above it) with the built-in
    error ``mkdir`` raises, naming the path and the fix."""
    try:
        fs.mkdir(path)
    except FileExistsError as exc:
        raise FileExistsError(
            errno.EEXIST,
            f"{fs.url(path)} is a file, not a checkpoint directory; nothing was written: "
            "move or remove that file, or save under another path (another step)",
        ) from exc
    except NotADirectoryError as exc:
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"a directory above {fs.url(path)} is a file, so the checkpoint directory cannot "
            "be made; nothing was written: move or remove that file, or save elsewhere",
        ) from exc


def split_location(fs: FileSystemBase, path: str) -> tuple[str, str] | None:
    """``(parent, name)`` of the checkpoint at ``path``, or ``None`` if it has no parent
    under which siblings could live (a bucket's root)."""
    trimmed = path.rstrip("/")
    parent, sep, name = trimmed.rpartition("/")
    if not sep or not parent or not name or fs.concat_path(parent, name) != trimmed:
        return None
    return parent, name


@dataclass(frozen=True)
class StepInfo:
    """One checkpoint directory: ``step`` is ``None`` for names that are not
    ``step-<N>``; ``committed`` is whether its metadata exists; ``size`` and ``files``
    count its checkpoint files; ``modified`` is the newest file time (``None`` where the
    backend cannot tell); ``tiers`` names the tiers of a tiered manager that hold a
    committed copy (``"local"``, ``"durable"``)."""

    name: str
    step: int | None
    url: str
    committed: bool
    files: int
    size: int
    modified: float | None
    tiers: tuple[str, ...] = ()


def directory_info(
    fs: FileSystemBase, path: str, name: str, step: int | None = None
) -> StepInfo | None:
    """Facts about the checkpoint directory at ``path`` (``None`` if it is not a directory)."""
    try:
        names = expand(fs, path)
    except (FileNotFoundError, NotADirectoryError):
        return None  # e.g. a plain file named like a step: not ours
    size, newest, files = 0, None, [n for n in names if is_checkpoint_file_name(n)]
    for n in files:
        file_path = fs.concat_path(path, n)
        try:
            size += fs.size(file_path)
            mtime = fs.modified(file_path)
        except FileNotFoundError:
            continue
        if mtime is not None:
            newest = mtime if newest is None else max(newest, mtime)
    committed = bool(committing_metadata(names))
    return StepInfo(name, step, fs.url(path), committed, len(files), size, newest)
