"""The one read model of a committed checkpoint: what its saved metadata says, read once.

Every path that decides from saved metadata what to delete, what is referenced, what to
copy or drain and which step may serve as a base reads it here, so they all see the same
facts under one error policy:

* **missing** (``FileNotFoundError``, ``NotADirectoryError``): the location or the
  metadata file is not there, so it commits nothing (a metadata file that vanishes
  between the listing and the read is simply not there);
* **unreadable** (any other error: an I/O error, a refused listing, metadata that does
  not unpickle or validate): what the checkpoint names and references is unknown, so
  every deletion path fails closed. An unreadable checkpoint may reference any sibling
  (:meth:`CommittedCheckpoint.may_reference`): deleting or overwriting a checkpoint
  beside it is refused, and retention keeps every step while it stands. Opening one says
  nothing: the path that decides says so, in its refusal or its log, and paths that
  delete nothing (inspect, verify, copy) report only their own error.

:func:`open_committed` reads a checkpoint whole: every metadata file in its directory,
the committing ones (``.metadata``, else each rank's ``__{rank}.metadata``; see
``layout.committing_metadata``) and any other one lingering there, because a deletion
must know every reference and every file any of them records. ``siblings.Siblings`` holds
the checkpoints under one parent directory for one pass (a retention pass, one refusal to
delete), each opened at most once, so such a pass reads each step's metadata once.
:class:`ReadModels` keeps the models of a manager's own steps between passes, reused
while their metadata files are unchanged, so a save reads each metadata at most once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.stateful import Stateful

from extensions.errors import (
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    printable,
)
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.layout import (
    committing_metadata,
    is_data_file_name,
    is_metadata_name,
    present_metadata,
)

log = logging.getLogger(__name__)

_LISTING = ""  # key in ``errors`` of a directory that could not be listed


def read_metadata_file(fs: FileSystemBase, meta_path: str) -> Metadata | None:
    """The parsed metadata at ``meta_path`` (``format.load_metadata``), or ``None`` when
    there is none. Any other error propagates: it makes the checkpoint unreadable, and
    the caller fails closed."""
    try:
        payload = read_metadata_bytes(fs, meta_path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return fmt.load_metadata(payload, fs.url(meta_path))


def read_metadata_bytes(fs: FileSystemBase, meta_path: str) -> bytes:
    """The content of the metadata file ``meta_path``, refused with
    :class:`UnsafeCheckpointError` past ``format.MAX_METADATA_BYTES``. The read is
    bounded (``fs.read_bytes(limit=...)``: at most one byte more than the bound is
    fetched, in the one request a load makes anyway); where reads are local, and a
    sparse file of any size is free to make, its size is checked first (a stat), so not
    even the bound is read."""
    limit = fmt.MAX_METADATA_BYTES
    if fs.local_reads:
        try:
            size = fs.size(meta_path)
        except (FileNotFoundError, NotADirectoryError):
            size = 0  # the read below says it is missing
        _refuse_oversized(fs, meta_path, size, f"metadata of {size} bytes")
    data = fs.read_bytes(meta_path, limit=limit)
    _refuse_oversized(fs, meta_path, len(data), "metadata")
    return data


def _refuse_oversized(fs: FileSystemBase, meta_path: str, size: int, what: str) -> None:
    limit = fmt.MAX_METADATA_BYTES
    if size > limit:
        raise UnsafeCheckpointError(
            f"{fs.url(meta_path)}: {what} is larger than {limit} bytes "
            "(a DCP metadata takes about 200 bytes per item); refusing to read it: the "
            "file is damaged or hostile"
        )


def own_files(metadata: Metadata, where: str) -> frozenset[str]:
    """The data files ``metadata`` names for its own items (a referenced item's file is
    its base's), and only names that are data file names, so a hostile or hand-edited
    metadata cannot make a deletion path remove ``train.py``."""
    named = {
        getattr(i, "relative_path", None)
        for i in (metadata.storage_data or {}).values()
        if fmt.stored_item(i).ref is None
    }
    ours = frozenset(n for n in named if isinstance(n, str) and is_data_file_name(n))
    if len(ours) < len(named):
        log.warning("%s names files that are not data files; they are never deleted", where)
    return ours


def referenced_names(metadata: Metadata) -> frozenset[str]:
    """Names of the sibling checkpoints whose bytes ``metadata``'s items reference."""
    refs = {fmt.stored_item(i).ref for i in (metadata.storage_data or {}).values()}
    return frozenset(r for r in refs if r is not None)


def files_read(metadata: Metadata, state_dict: dict[str, Any]) -> set[tuple[str | None, str]]:
    """What loading ``state_dict`` from a checkpoint with ``metadata`` reads on this rank,
    as DCP's default load planner plans it: (the sibling holding the bytes of a
    referenced item, else ``None``; its data file) pairs."""
    planner = DefaultLoadPlanner()
    plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    planner.set_up_planner(plain, metadata, is_coordinator=False)
    out = set()
    for item in planner.create_local_plan().items:
        info = (metadata.storage_data or {}).get(item.storage_index)
        if info is not None:  # else the load refuses the item, naming it
            record = fmt.stored_item(info)
            out.add((record.ref, record.relative_path))
    return out


def chain_of(metadata: Metadata | None) -> int:
    """Incremental saves since the last full one (0 for a full or foreign checkpoint)."""
    chain = fmt.checkpoint_facts(metadata).get(fmt.CHAIN, 0)
    return chain if isinstance(chain, int) and chain >= 0 else 0


@dataclass(frozen=True)
class CommittedCheckpoint:
    """The checkpoint at ``path`` as its saved metadata describes it (see the module
    docstring). ``committing``: the metadata files that commit it; ``metadata``: every
    metadata file in its directory that could be read, parsed; ``errors``: those that
    could not (``""`` for a directory that could not be listed), with why."""

    fs: FileSystemBase
    path: str
    committing: tuple[str, ...]
    metadata: Mapping[str, Metadata]
    errors: Mapping[str, Exception]

    @property
    def url(self) -> str:
        return self.fs.url(self.path)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rpartition("/")[2]

    @property
    def committed(self) -> bool:
        """Whether metadata commits it (an unreadable one may: it counts)."""
        return bool(self.committing) or bool(self.errors)

    @property
    def readable(self) -> bool:
        return not self.errors

    @property
    def global_metadata(self) -> Metadata | None:
        """The parsed ``.metadata`` when it commits the checkpoint: only such a
        checkpoint serves as a base (rank-local metadata never does)."""
        if self.committing != (fmt.METADATA_NAME,):
            return None
        return self.metadata.get(fmt.METADATA_NAME)

    @property
    def chain(self) -> int:
        """Incremental saves since the last full one, by its ``.metadata`` (0 without)."""
        return chain_of(self.global_metadata)

    def items(self) -> dict[MetadataIndex, Any]:
        """The storage index of its ``.metadata`` (empty when it has none to offer)."""
        metadata = self.global_metadata
        return dict(metadata.storage_data or {}) if metadata is not None else {}

    def data_files(self) -> frozenset[str]:
        """The data files its metadata (all of them) name as its own: what deleting it
        removes (empty for what could not be read: those files stay for ``gc``)."""
        where = self.url
        return frozenset().union(*(own_files(m, where) for m in self.metadata.values()))

    def references(self) -> frozenset[str]:
        """The siblings whose bytes its readable metadata reference."""
        return frozenset().union(*(referenced_names(m) for m in self.metadata.values()))

    def may_reference(self, name: str) -> bool:
        """Whether it references (or, unreadable, might reference) sibling ``name``."""
        if name == self.name:
            return False
        return bool(self.errors) or name in self.references()

    def why_unreadable(self) -> str:
        """What could not be read, for messages (empty when everything could)."""
        return "; ".join(
            f"{name or 'listing'}: {printable(str(exc) or type(exc).__name__, 200)}"
            for name, exc in sorted(self.errors.items())
        )

    def require(self) -> None:
        """Raise unless its committing metadata could all be read: the reason it could
        not, or :class:`CheckpointNotFoundError` naming what is missing."""
        for name in (_LISTING, *self.committing):
            if name in self.errors:
                raise self.errors[name]
        if not self.committing:
            if self.fs.exists(self.path):
                raise CheckpointNotFoundError(
                    f"{self.url} is not a committed checkpoint: it has no "
                    f"{fmt.METADATA_NAME} (an interrupted save, or not a checkpoint "
                    "directory); point at a checkpoint directory"
                )
            raise CheckpointNotFoundError(
                f"no checkpoint at {self.url}: the location does not exist"
            )


def open_committed(fs: FileSystemBase, path: str) -> CommittedCheckpoint:
    """Read the checkpoint at ``path``: one listing (and, for metadata files it may have
    missed, looks by name: ``layout.present_metadata``), then each metadata file in it."""
    metadata: dict[str, Metadata] = {}
    errors: dict[str, Exception] = {}
    names: list[str] = []
    try:
        listing = fs.ls(path)
    except FileNotFoundError:
        listing = []  # a listing that lags may not show the directory yet
    except NotADirectoryError:
        listing = None
    except Exception as exc:
        listing, errors[_LISTING] = None, exc
    if listing is not None:
        # A listing may lag or miss an object: a checkpoint that references a sibling
        # must not pass for uncommitted, nor for one that references less than it does,
        # so what the listing does not show is asked for by name too.
        try:
            names = present_metadata(fs, path, listing)
        except Exception as exc:
            errors[_LISTING] = exc
    for name in names:
        try:
            found = read_metadata_file(fs, fs.concat_path(path, name))
        except Exception as exc:
            errors[name] = exc
            continue
        if found is not None:
            metadata[name] = found
    committing = committing_metadata([n for n in names if n in metadata or n in errors])
    return CommittedCheckpoint(fs, path, tuple(committing), metadata, errors)


_Stamp = tuple[tuple[str, tuple[int, ...]], ...]


def metadata_stamp(fs: FileSystemBase, path: str) -> _Stamp | None:
    """What identifies the metadata files of the checkpoint at ``path`` right now
    (``FileSystemBase.stamps``: names, inodes, sizes and modification and change times);
    ``None`` where that cannot be told cheaply or the directory cannot be listed."""
    stamps = fs.stamps(path)
    if stamps is None:
        return None
    return tuple(sorted((name, st) for name, st in stamps.items() if is_metadata_name(name)))


class ReadModels:
    """Read models of a manager's own checkpoints, kept between passes: :meth:`open`
    returns the model it holds for a path while the metadata files there are the same
    files (names, inodes, sizes, modification and change times: a metadata file is
    only ever replaced through a new file, so a new save of a step is a new inode), and
    opens it afresh otherwise. Only backends that stamp entries without a request (local
    disk) keep models; elsewhere every :meth:`open` reads. Unreadable checkpoints are never kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, tuple[_Stamp, CommittedCheckpoint]] = {}

    def open(self, fs: FileSystemBase, path: str) -> CommittedCheckpoint:
        stamp = metadata_stamp(fs, path)
        if stamp is not None:
            with self._lock:
                held = self._models.get(path)
            if held is not None and held[0] == stamp:
                return held[1]
        checkpoint = open_committed(fs, path)
        self._keep(path, stamp, checkpoint)
        return checkpoint

    def remember(self, fs: FileSystemBase, path: str, metadata: Metadata) -> None:
        """``metadata`` was just published by this process as the ``.metadata`` of the
        checkpoint at ``path``: keep it as that checkpoint's model, unless other
        metadata files lie there (then the next :meth:`open` reads them all)."""
        stamp = metadata_stamp(fs, path)
        if stamp is not None and [s[0] for s in stamp] == [fmt.METADATA_NAME]:
            checkpoint = CommittedCheckpoint(
                fs, path, (fmt.METADATA_NAME,), {fmt.METADATA_NAME: metadata}, {}
            )
            self._keep(path, stamp, checkpoint)

    def forget(self, path: str) -> None:
        with self._lock:
            self._models.pop(path, None)

    def _keep(self, path: str, stamp: _Stamp | None, checkpoint: CommittedCheckpoint) -> None:
        with self._lock:
            if stamp is not None and checkpoint.readable and checkpoint.committing:
                self._models[path] = (stamp, checkpoint)
            else:
                self._models.pop(path, None)
