"""A Hub-layout model on any backend: its files written and its commit (``reading``
reads it).

The commit protocol: the model in a folder is ``model.safetensors`` where that file is
there, else the files ``model.safetensors.index.json`` names, as transformers'
``from_pretrained`` chooses; every reader here (``reading.read_model``, so ``load``,
``verify`` and the CLI) chooses the same way. Shard files are written first and the
index last, so an export that stopped half way has no index and is never taken for a
model; a single file is published whole (object stores publish an upload whole, local
disk writes a temporary name and renames it); the index is published whole too.
Replacing a model keeps it whole until the new one is committed: the new files never
take the old ones' names (:func:`new_names`), and the commit (:func:`commit_model`)
is one step: a model in several files replacing several is committed by its index
replacing the old one; replacing a single file, by that file's removal once the index
is published (the old index, if any, is then stale); a single file, by its
publication (over the old one, or beside an old index it makes stale, removed next,
once the file is read back carrying the write's id).
Only then are the old model's files, and those of a write killed half way, removed. A
write that stops half way leaves the old model, plus unreferenced files (a stale index
among them) the next write removes. Loaders that glob the folder's files and keep
those an index names (vLLM's) follow the index wherever there is one, so they disagree
in the two states a killed write leaves with both there, until the next write: several
files over a single file, killed between the index and that file's removal (vLLM reads
the new shards; transformers and our readers the old file), and a single file over
several, killed before the old index's removal (vLLM the old shards; the others the
new file).

Each write (a save, an export) records one random id in every file's header and in the
index (:data:`~storage.checkpoint.safetensors.header.WRITE_KEY`): two writes to one
folder at once publish the same names, each file whole, so the folder may end with
files of both under one index; ``reading.read_model`` refuses such a mix (every reader and
``verify`` go through it). Models that record no id (other writers, ours before ids)
are not checked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO

import crc32c
import torch

from extensions.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    UnsafeCheckpointError,
    quote,
)
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat
from storage.checkpoint.safetensors.header import (
    INDEX_NAME,
    SINGLE_NAME,
    WRITE_KEY,
    encode_header,
    layout,
)
from storage.checkpoint.safetensors.parse import parse_index
from storage.checkpoint.safetensors.reading import (
    read_files,
    read_header,
    read_index,
    read_limited,
    show_id,
)
from storage.checkpoint.safetensors.staging import is_model_file_name
from storage.checkpoint.tensors import tensor_bytes

_TAG = 8  # hex digits of the write id in the names of a model written beside another

log = logging.getLogger(__name__)


def file_names(count: int, tag: str = "") -> list[str]:
    """The names of a model's ``count`` files, as transformers and torch name them
    (several: ``tag`` after ``model-`` where given, see :func:`new_names`)."""
    if count == 1:
        return [SINGLE_NAME]
    prefix = f"model-{tag}-" if tag else "model-"
    return [f"{prefix}{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


@dataclasses.dataclass(frozen=True)
class Replaced:
    """What a write to a folder may remove once committed (:func:`commit_model`): the
    model files ``names`` in it when the write began, and ``home``, the folder itself,
    resolved then where the user named their own link (:func:`heartbeat.resolved`):
    removals walk from there, never through a link (``rm_file_in``)."""

    home: str
    names: frozenset[str]


def new_names(
    fs: FileSystemBase, root: str, count: int, write_id: str, *, home: str | None = None
) -> tuple[list[str], Replaced]:
    """The names of the ``count`` files of a new model at ``root``: transformers' names
    unless one of them is there already (the model being replaced, or what a killed
    write left), then those names tagged with the start of ``write_id``
    (``model-1a2b3c4d-00001-of-00004.safetensors``), so no file of the model there is
    written over before the new one is committed. One file is ``model.safetensors``:
    it is published whole over the old one. Also what :func:`commit_model` may remove:
    the model files at ``root`` now (never those another write to the folder makes
    meanwhile), and where (``home``: ``root`` as the write resolved it when it began;
    default: resolved now). Each of transformers' names the listing does not show is
    asked for by name: a listing that lags or misses an object had a write take the
    names of the model it replaced, which a write failed or killed then left broken."""
    home = heartbeat.resolved(fs, root) if home is None else home
    listed = _model_files(fs, root)
    names = file_names(count)
    if count == 1:
        return names, Replaced(home, listed)
    unlisted = [n for n in names if n not in listed]  # asked for at once: one look each
    with concurrent.futures.ThreadPoolExecutor(
        max(1, min(len(unlisted), fs.io_concurrency))
    ) as pool:
        found = pool.map(lambda n: fs.exists(fs.concat_path(root, n)), unlisted)
        there = (listed & set(names)) | {n for n, hit in zip(unlisted, found) if hit}
    replaced = Replaced(home, listed | there)
    if not there:
        return names, replaced
    return file_names(count, write_id[:_TAG]), replaced


def _model_files(fs: FileSystemBase, root: str) -> frozenset[str]:
    try:
        return frozenset(n for n in fs.ls(root) if is_model_file_name(n))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()


def commit_model(
    fs: FileSystemBase,
    root: str,
    weight_map: dict[str, str],
    total: int,
    write_id: str,
    replaced: Replaced,
) -> list[str]:
    """Commit the model whose files (the values of ``weight_map``, tensor -> file) are
    written at ``root``, then remove the files of the model it replaces (``replaced``,
    from :func:`new_names`). Several files: the index is published (and the folder read
    back, :func:`publish_index`) and read again; where a ``model.safetensors`` was there,
    its removal is the commit (readers take that file over an index), then the index is
    read once more and the folder must hold no ``model.safetensors`` (another write's).
    One file: it was published whole, which committed it; it is read back (its header
    must carry ``write_id``), then the index of a model it replaces is removed. Only
    then are the other replaced files removed.

    Every removal goes through ``rm_file_in`` under ``replaced.home``: the folder as
    resolved when the write began, so one swapped for a link since makes a removal
    fail, never remove another model's files."""
    home = replaced.home
    files = sorted(set(weight_map.values()))
    if len(files) > 1:
        publish_index(fs, root, weight_map, total, write_id, home=replaced.home)
        files.append(INDEX_NAME)
        # Another write may have committed since: its files are not ours to remove.
        _check_index_id(fs, root, write_id)
        if SINGLE_NAME in replaced.names:
            _remove_single(fs, root, home)
            _check_index_id(fs, root, write_id)
        if fs.exists(fs.concat_path(root, SINGLE_NAME)):
            raise IntegrityError(
                f"{fs.url(root)}: another save or export to this folder published "
                f"{SINGLE_NAME} while this one was written; the folder holds that write's "
                "model: export or save the model again, one writer at a time"
            )
    else:
        _check_single_id(fs, root, write_id, home)  # before the old index goes: it may serve
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file_in(home, INDEX_NAME)
        fs.sync_dir(root)
    _remove_replaced(fs, root, home, replaced.names - set(files))
    return files


def _remove_single(fs: FileSystemBase, root: str, home: str) -> None:
    """The commit of a model in several files replacing one file: the old
    ``model.safetensors`` removed from ``home`` (``root`` resolved; gone already: another
    write removed it). A removal that fails leaves the old model committed, and the
    write fails saying so."""
    path = fs.concat_path(root, SINGLE_NAME)
    try:
        fs.rm_file_in(home, SINGLE_NAME)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise OSError(
            f"{fs.url(path)}: the replaced model's file could not be removed ({exc}); it is "
            f"still the model that readers load (they take it over {INDEX_NAME}): remove it, "
            "or export or save the model again"
        ) from exc
    fs.sync_dir(root)


def _remove_replaced(fs: FileSystemBase, root: str, home: str, doomed: Iterable[str]) -> None:
    """Remove ``doomed`` from ``home`` (``root`` resolved): the files of the replaced
    model, and those of writes killed before their commit, found before this write
    began. Quietly: one left behind is unreferenced, and the next write removes it."""
    for name in sorted(doomed):
        try:
            fs.rm_file_in(home, name)
        except FileNotFoundError:
            pass
        except (OSError, UnsafeCheckpointError) as exc:
            log.warning("%s: a file of the replaced model is left: %s", fs.url(root), exc)


def split(sizes: Sequence[tuple[str, int]], max_size: int | None) -> list[list[str]]:
    """Names grouped into files in order, a new file started when the next tensor
    would take the current one past ``max_size`` bytes (one tensor larger than that
    gets a file of its own); ``None``: one file."""
    groups: list[list[str]] = []
    filled = 0
    for name, size in sizes:
        if not groups or (max_size is not None and groups[-1] and filled + size > max_size):
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    return groups


def refuse_existing(fs: FileSystemBase, root: str, *, overwrite: bool) -> list[str]:
    """Refuse a committed model at ``root`` unless ``overwrite``; the names of its
    commit (index, single file) found there. Removes nothing: the old model stays
    until the new one is committed (:func:`commit_model`)."""
    found = [n for n in (SINGLE_NAME, INDEX_NAME) if fs.exists(fs.concat_path(root, n))]
    if found and not overwrite:
        raise CheckpointExistsError(
            f"Checkpoint already exists: {fs.url(root)} holds a safetensors model "
            f"({found[0]}); pass overwrite=True (--overwrite) to replace it, or pick another "
            "destination"
        )
    return found


@contextlib.contextmanager
def publish_file(fs: FileSystemBase, path: str, *, home: str | None = None) -> Iterator[IO[bytes]]:
    """A stream whose content appears at ``path`` whole or not at all: object stores
    publish an upload whole; local disk writes a temporary name, then renames it. With
    ``home`` (the folder holding ``path`` as the write resolved it when it began), both
    happen inside it, never through a link swapped in since (``create_stream_in``,
    ``rename_in``)."""
    if home is None:
        target = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if fs.atomic_rename else path
        with fs.create_stream(target, "wb", sync=True) as out:
            yield out
        if target != path:
            fs.rename(target, path)
        return
    name = path.rsplit("/", 1)[-1]
    target = f"{name}.tmp-{uuid.uuid4().hex[:12]}" if fs.atomic_rename else name
    with fs.create_stream_in(home, target, "wb", sync=True) as out:
        yield out
    if target != name:
        fs.rename_in(home, target, name)


def write_file(
    fs: FileSystemBase,
    path: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    write_id: str | None = None,
    progress: Callable[[int], object] | None = None,
    home: str | None = None,
) -> int:
    """Write one safetensors file holding ``tensors`` (CPU, contiguous) with their
    CRC-32Cs and ``write_id``, in the library's byte layout; returns the bytes of
    tensor data. ``progress`` is called with the tensor bytes written so far after
    each tensor. ``home``: as :func:`publish_file`'s."""
    by_name = dict(tensors)
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors}
    order = layout(shapes)
    crcs = {name: crc32c.crc32c(tensor_bytes(by_name[name])) for name in order}
    header = encode_header(shapes, order, crcs, write_id)
    with publish_file(fs, path, home=home) as out:
        out.write(header)
        done = 0
        for name in order:
            raw = tensor_bytes(by_name[name])
            out.write(raw)
            done += len(raw)
            if progress is not None:
                progress(done)
    return sum(t.numel() * t.element_size() for _, t in tensors)


def publish_index(
    fs: FileSystemBase,
    root: str,
    weight_map: dict[str, str],
    total: int,
    write_id: str,
    *,
    home: str | None = None,
) -> None:
    """The commit of a model in several files: the index, as transformers writes it,
    with the ``write_id`` its files carry in its ``metadata``; published in ``home``
    (``root`` as the write resolved it when it began; default: resolved now), never
    through a link swapped in since (``write_atomic_in``)."""
    meta: dict[str, object] = {"total_size": total, WRITE_KEY: write_id}
    index = {"metadata": meta, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    home = heartbeat.resolved(fs, root) if home is None else home
    fs.write_atomic_in(home, INDEX_NAME, text.encode())
    fs.sync_dir(root)
    _confirm_write(fs, root, write_id)


def _confirm_write(fs: FileSystemBase, root: str, write_id: str) -> None:
    """Raise unless ``root`` now holds this write's model whole: its index, and every
    file the index names carrying ``write_id``. Two writes to a folder at once publish
    the same names, each file whole, so the folder may end with one's index over files
    of both, or with the other's model; the write that checks last sees the folder as
    it stays, so at least one of the two fails instead of both saying they succeeded."""
    _check_index_id(fs, root, write_id)
    try:  # every file the index names carries its write id (a single file may be beside)
        read_files(fs, root, read_index(fs, root), threads=8)
    except CheckpointNotFoundError as exc:  # the other write removed them, replacing us
        raise IntegrityError(
            f"{fs.url(root)}: another save or export to this folder removed files of this "
            f"one while it was written ({exc}); two writes to this folder overlapped: export "
            "or save the model again, one writer at a time"
        ) from exc


def _check_index_id(fs: FileSystemBase, root: str, write_id: str) -> None:
    """Raise unless the index at ``root`` is this write's."""
    path = fs.concat_path(root, INDEX_NAME)
    try:
        found = parse_index(read_limited(fs, path), fs.url(path)).write_id
    except FileNotFoundError as exc:
        raise IntegrityError(
            f"{fs.url(root)}: another save or export to this folder removed this one's "
            f"{INDEX_NAME} while it was written (it published {SINGLE_NAME}); the folder holds "
            "that write's model: export or save the model again, one writer at a time"
        ) from exc
    if found != write_id:
        raise IntegrityError(
            f"{fs.url(root)}: another save or export to this folder published its index "
            f"while this one was written (write id {show_id(found)}, this one's "
            f"{quote(write_id)}); the folder holds that write's model, or a mix: export or "
            "save the model again, one writer at a time"
        )


def _check_single_id(fs: FileSystemBase, root: str, write_id: str, home: str) -> None:
    """Raise unless the ``model.safetensors`` at ``root`` is this write's: another write
    may have published its own over it since, or the store may serve an older object
    than the one it acknowledged (the old model's: the write would return while every
    reader loads the model it replaced, and the old index would go). ``root`` leading
    elsewhere than ``home`` (swapped for a link since the write began) is said so."""
    try:
        found = read_header(fs, root, SINGLE_NAME).write_id
    except CheckpointNotFoundError as exc:
        _refuse_swapped(fs, root, home)
        raise IntegrityError(
            f"{fs.url(root)}: {SINGLE_NAME} is gone right after this write published it "
            f"({exc}); another save or export to this folder removed it: export or save the "
            "model again, one writer at a time"
        ) from exc
    if found != write_id:
        _refuse_swapped(fs, root, home)
        raise IntegrityError(
            f"{fs.url(root)}: the {SINGLE_NAME} there is not the one this write published "
            f"(write id {show_id(found)}, this one's {quote(write_id)}): another save or "
            "export to this folder published its own meanwhile, or the store serves an "
            "older object than the one it acknowledged; nothing of the model there was "
            "removed: export or save the model again, one writer at a time"
        )


def _refuse_swapped(fs: FileSystemBase, root: str, home: str) -> None:
    if fs.resolve_link(root) != home:
        raise UnsafeCheckpointError(
            f"{fs.url(root)} is now a symbolic link where the checkpoint has a directory "
            f"(it led to {fs.url(home)} when this write began); nothing of the model there "
            "was removed. Whoever can write its parent may have swapped it in: remove the "
            "link itself, and make that directory writable by you only"
        )
