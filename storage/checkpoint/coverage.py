"""Whether a load's reads fill what it asked for: a tensor its stored chunks leave
partly without a value is refused, naming it, instead of loading the rest silently.

DCP plans reads only for the chunks a metadata lists, so the elements of a target that
no stored chunk holds keep whatever the target held (freshly initialised weights, or
the uninitialised memory of a target the planner made from the metadata, as torch's
``dcp_to_torch_save`` does) and nobody hears of it. torch's save planner checks, when
several ranks save together, that the chunks cover each tensor; a save by one process
(``no_dist``, rank-local metadata, the recovery transport's) records the global size of
a sharded tensor with only that process's shards, which is no damage: such a checkpoint
is loaded shard by shard. So what is checked here is what a load asks for, never the
checkpoint as a whole: a target chunk (its elements on this rank, as the planner plans
reads for them) that the planned reads do not fill, of a tensor whose chunks hold fewer
elements than it has. Only a shortfall is refused: chunks holding more elements
(replicated chunks a custom planner saved without dedup) are not damage.

Elements are counted exactly (``boxes.union_volume``), in the metadata and in the
reads: a chunk listed twice counts once, and chunks that overlap in part count what
they hold together, so neither a duplicate nor an overlap stands in for a missing
chunk. Counting overlapping chunks exactly has a bounded cost; a tensor whose chunks
overlap beyond it (``boxes.Irregular``: no torch save lays chunks out so) is refused
when a load asks for it, as one its chunks leave short.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from extensions._compat import EmptyStateDictLoadPlanner, local_chunks
from extensions.errors import IntegrityError, quote
from storage.checkpoint.boxes import Box, Irregular, union_volume


class Shortfall(NamedTuple):
    """What a tensor's stored chunks hold (``covered``: ``None`` where they overlap too
    irregularly to count, :class:`~storage.checkpoint.boxes.Irregular`) of its
    ``total`` elements."""

    covered: int | None
    total: int


def stored_elements(meta: TensorStorageMetadata) -> int | None:
    """The elements of the tensor ``meta`` describes that its stored chunks hold
    together (each once), or ``None`` where they overlap too irregularly to count."""
    try:
        return union_volume((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
    except Irregular:
        return None


def uncovered(metadata: Metadata) -> dict[str, Shortfall]:
    """The tensor items of ``metadata`` whose chunks hold fewer elements than the tensor
    has (or overlap too irregularly to count), each with what they hold. A 0-dim tensor
    has one element: with no chunk it is uncovered; one with no element never is."""
    found: dict[str, Shortfall] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            total = math.prod(meta.size)
            covered = stored_elements(meta) if total else 0
            if covered is None or covered < total:
                found[fqn] = Shortfall(covered, total)
    return found


def irregular_error(url: str, fqn: str) -> IntegrityError:
    """The refusal of a load asking for item ``fqn`` of the checkpoint at ``url``, whose
    stored chunks overlap too irregularly to count what they hold."""
    return IntegrityError(
        f"{url}: item {quote(fqn)}: its stored chunks overlap in a way no torch save "
        "makes (over a grid too large to count which elements they hold), so whether "
        "they hold every element this load asks for cannot be checked: the metadata is "
        "damaged or forged; nothing was read. Re-save the checkpoint, or load from "
        "another step (a load that leaves this item out still works)"
    )


def asked_chunks(
    planner: LoadPlanner, keys: Iterable[str]
) -> dict[str, dict[tuple[int, ...], tuple[int, ...]]]:
    """The tensor targets of ``planner`` under ``keys`` on this rank, by state-dict key,
    each as its chunks (their sizes by offsets, as the planner's reads name them in
    ``dest_index``), where the planner keeps its targets as torch's
    ``DefaultLoadPlanner`` (and its subclasses, ``_EmptyStateDictLoadPlanner`` among
    them) does; none for another planner (nothing is checked), or for one that says
    its targets are made from the stored chunks (``targets_from_metadata``: the
    recovery transport's). A DTensor on a rank outside its mesh asks for nothing (the
    planner plans no read for it)."""
    state_dict = getattr(planner, "state_dict", None)
    if (
        not isinstance(planner, DefaultLoadPlanner)
        or getattr(planner, "targets_from_metadata", False)
        or not isinstance(state_dict, Mapping)
    ):
        return {}
    asked: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for key in keys:
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        mesh: Any = getattr(value, "device_mesh", None)
        if mesh is not None and mesh.get_coordinate() is None:
            continue
        asked[key] = {tuple(c.offsets): tuple(c.sizes) for c in local_chunks(value)}
    return asked


def check_covered(
    url: str,
    short: Mapping[str, Shortfall],
    planner: LoadPlanner,
    reads: Iterable[ReadItem],
) -> None:
    """Refuse, before anything is read, a load whose planned ``reads`` do not fill a
    target chunk of ``planner`` (:func:`asked_chunks`) of a tensor in ``short``
    (:func:`uncovered` of the load's metadata), naming the checkpoint at ``url``, the
    item, what is missing and what to do. The reads into each target chunk (grouped by
    the chunk's offsets, ``dest_index.offset``; their places relative to it) are
    counted exactly, each element once."""
    if not short:
        return
    wanted = asked_chunks(planner, short)
    if not wanted:
        return
    boxes: dict[tuple[str, tuple[int, ...]], set[Box]] = defaultdict(set)
    for req in reads:
        fqn = req.dest_index.fqn
        if fqn in wanted and req.type != LoadItemType.BYTE_IO:
            chunk = (fqn, tuple(req.dest_index.offset or ()))
            boxes[chunk].add((tuple(req.dest_offsets), tuple(req.lengths)))
    made = isinstance(planner, EmptyStateDictLoadPlanner)
    for fqn in sorted(wanted):
        covered, total = short[fqn]
        if covered is None:
            raise irregular_error(url, fqn)
        asked = got = 0
        for offsets, sizes in wanted[fqn].items():
            asked += math.prod(sizes)
            try:
                got += union_volume(boxes.get((fqn, offsets), ()))
            except Irregular:
                raise irregular_error(url, fqn) from None
        if got < asked:
            rest = (
                "leave the rest of the tensor it makes from the metadata uninitialised memory"
                if made
                else "leave the rest of the target as it was"
            )
            raise IntegrityError(
                f"{url}: item {quote(fqn)}: its stored chunks cover {got} of the "
                f"{asked} elements this load asks for ({covered} of the tensor's "
                f"{total}): the checkpoint is damaged or incomplete (a rank's part missing), "
                f"and the load would {rest}; nothing was read. Re-save the checkpoint, or "
                "load from another step (a load that leaves this item out still works)"
            )
