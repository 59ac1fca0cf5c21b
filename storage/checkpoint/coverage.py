"""Whether a load's reads fill what it asked for: a tensor its stored chunks leave
partly without a value is refused, naming it, instead of loading the rest silently.

DCP plans reads only for the chunks a metadata lists, so the elements of a target that
no stored chunk holds keep whatever the target held (freshly initialised weights) and
nobody hears of it. torch's save planner checks, when several ranks save together, that
the chunks cover each tensor; a save by one process (``no_dist``, rank-local metadata,
the recovery transport's) records the global size of a sharded tensor with only that
process's shards, which is no damage: such a checkpoint is loaded shard by shard. So
what is checked here is what a load asks for, never the checkpoint as a whole: a target
(its elements on this rank, as the planner plans reads for them) that the planned
reads do not fill, of a tensor whose chunks hold fewer elements than it has. Only a
shortfall is refused: chunks holding more elements (replicated chunks a custom planner
saved without dedup) are not damage. A chunk listed twice (the same offsets and sizes)
counts once, in the metadata and in the reads, so a duplicate never stands in for a
missing chunk; chunks that overlap only in part count whole, so such overlaps can still
hide a gap (an exact union of boxes costs more than a load can spend on it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from extensions._compat import local_chunks
from extensions.errors import IntegrityError, quote


def uncovered(metadata: Metadata) -> dict[str, tuple[int, int]]:
    """The tensor items of ``metadata`` whose chunks hold fewer elements than the tensor
    has, each with those two counts: a chunk listed twice (same offsets and sizes)
    counts once, chunks that partly overlap count whole. A 0-dim tensor has one
    element: with no chunk it is uncovered; one with no element never is."""
    found: dict[str, tuple[int, int]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            total = math.prod(meta.size)
            boxes = {(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in meta.chunks}
            covered = sum(math.prod(sizes) for _, sizes in boxes)
            if covered < total:
                found[fqn] = (covered, total)
    return found


def asked_elements(planner: LoadPlanner, keys: Iterable[str]) -> dict[str, int]:
    """The elements the tensor targets of ``planner`` under ``keys`` hold on this rank,
    by state-dict key, where the planner keeps its targets as torch's
    ``DefaultLoadPlanner`` (and its subclasses) does; none for another planner (nothing
    is checked), or for one that says its targets are made from the stored chunks
    (``targets_from_metadata``: the recovery transport's). A DTensor on a rank outside
    its mesh asks for nothing (the planner plans no read for it)."""
    state_dict = getattr(planner, "state_dict", None)
    if (
        not isinstance(planner, DefaultLoadPlanner)
        or getattr(planner, "targets_from_metadata", False)
        or not isinstance(state_dict, Mapping)
    ):
        return {}
    asked: dict[str, int] = {}
    for key in keys:
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        mesh: Any = getattr(value, "device_mesh", None)
        if mesh is not None and mesh.get_coordinate() is None:
            continue
        asked[key] = sum(math.prod(chunk.sizes) for chunk in local_chunks(value))
    return asked


def check_covered(
    url: str,
    short: Mapping[str, tuple[int, int]],
    planner: LoadPlanner,
    reads: Iterable[ReadItem],
) -> None:
    """Refuse, before anything is read, a load whose planned ``reads`` do not fill a
    target of ``planner`` (:func:`asked_elements`) of a tensor in ``short``
    (:func:`uncovered` of the load's metadata), naming the checkpoint at ``url``, the
    item, what is missing and what to do."""
    if not short:
        return
    wanted = asked_elements(planner, short)
    if not wanted:
        return
    got = dict.fromkeys(wanted, 0)
    seen: set[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = set()
    for req in reads:
        fqn = req.dest_index.fqn
        if fqn in got and req.type != LoadItemType.BYTE_IO:
            box = (
                fqn,
                tuple(req.dest_index.offset or ()),
                tuple(req.dest_offsets),
                tuple(req.lengths),
            )
            if box not in seen:  # a chunk listed twice is read twice into one place
                seen.add(box)
                got[fqn] += math.prod(req.lengths)
    for fqn in sorted(wanted):
        if got[fqn] < wanted[fqn]:
            covered, total = short[fqn]
            raise IntegrityError(
                f"{url}: item {quote(fqn)}: its stored chunks cover {got[fqn]} of the "
                f"{wanted[fqn]} elements this load asks for ({covered} of the tensor's "
                f"{total}): the checkpoint is damaged or incomplete (a rank's part missing), "
                "and the load would leave the rest of the target as it was; nothing was "
                "read. Re-save the checkpoint, or load from another step (a load that "
                "leaves this item out still works)"
            )
