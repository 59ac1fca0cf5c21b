"""How many elements a set of chunks of a tensor holds: the volume of the union of
boxes (each an ``(offsets, sizes)`` pair), counted exactly, at a bounded cost.

Chunks a torch save writes never overlap: each dimension is cut at the same places
for every chunk (a sharding's boundaries), so every chunk is one cell of the grid those
cuts make, and their volumes add up. That case is recognised in O(n log n) and counted
so (:func:`union_volume`). Chunks that overlap (a chunk saved by two ranks without
dedup, or a crafted metadata: two chunks overlapping in part can sum to the tensor's
size while leaving a gap) are counted exactly too: one dimension by sorting and
merging, several by marking the cells of that grid. The grid of chunks with many
unshared edges in several dimensions grows as a power of their count, so marking is
bounded (:data:`MAX_CELLS`, :data:`MAX_MARKS`): beyond that :class:`Irregular` is
raised, for the caller to refuse naming the item.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import pairwise

import torch

#: An ``(offsets, sizes)`` pair: a chunk's place in its tensor, or a read's in its target.
Box = tuple[tuple[int, ...], tuple[int, ...]]

#: Most cells of the grid the chunks' edges cut a tensor into that an exact count marks
#: (a byte each, and eight more while they are summed).
MAX_CELLS = 1 << 22
#: Most cell marks an exact count makes, all chunks together.
MAX_MARKS = 1 << 24


class Irregular(Exception):
    """Boxes that overlap over a grid too large to count exactly (:data:`MAX_CELLS`,
    :data:`MAX_MARKS`): no torch save lays chunks out so."""


def union_volume(boxes: Iterable[Box]) -> int:
    """The elements the ``boxes`` (all of one rank of dimensions) hold together: each
    counted once, however many boxes hold it; a box listed twice counts once. Raises
    :class:`Irregular` where counting overlapping boxes exactly would cost more than
    the bounds allow."""
    distinct = {box for box in boxes if all(s > 0 for s in box[1])}
    if len(distinct) <= 1:
        return sum(math.prod(sizes) for _, sizes in distinct)
    ndim = len(next(iter(distinct))[0])
    if ndim == 0:  # every box is the scalar's one element
        return 1
    if ndim == 1:
        return _merged_length(sorted((o[0], o[0] + s[0]) for o, s in distinct))
    if all(_apart({(o[d], o[d] + s[d]) for o, s in distinct}) for d in range(ndim)):
        # In each dimension the boxes' extents are the same or apart, so each box is one
        # cell of the grid they cut, and no two distinct boxes are the same cell.
        return sum(math.prod(sizes) for _, sizes in distinct)
    edges = [
        sorted({o[d] for o, _ in distinct} | {o[d] + s[d] for o, s in distinct})
        for d in range(ndim)
    ]
    spans = [
        [(bisect_left(edges[d], o[d]), bisect_left(edges[d], o[d] + s[d])) for d in range(ndim)]
        for o, s in distinct
    ]
    return _marked_volume(edges, spans)


def _apart(intervals: set[tuple[int, int]]) -> bool:
    """Whether the distinct ``intervals`` overlap none of the others."""
    ordered = sorted(intervals)
    return all(a[1] <= b[0] for a, b in pairwise(ordered))


def _merged_length(intervals: Sequence[tuple[int, int]]) -> int:
    """The length the sorted ``intervals`` cover together."""
    total = 0
    start, end = intervals[0]
    for lo, hi in intervals[1:]:
        if lo > end:
            total += end - start
            start, end = lo, hi
        else:
            end = max(end, hi)
    return total + end - start


def _marked_volume(
    edges: Sequence[Sequence[int]], spans: Sequence[Sequence[tuple[int, int]]]
) -> int:
    """The volume of the grid cells (cut at ``edges``) the ``spans`` (each a range of
    cell indices per dimension) mark, within :data:`MAX_CELLS` and :data:`MAX_MARKS`."""
    shape = [len(e) - 1 for e in edges]
    cells = math.prod(shape)
    marks = sum(math.prod(hi - lo for lo, hi in span) for span in spans)
    if cells > MAX_CELLS or marks > MAX_MARKS:
        raise Irregular(f"{len(spans)} boxes over {cells} grid cells ({marks} marks)")
    grid = torch.zeros(shape, dtype=torch.bool)
    for span in spans:
        grid[tuple(slice(lo, hi) for lo, hi in span)] = True
    volume = grid.to(torch.int64)
    for dim in reversed(range(len(edges))):
        widths = torch.tensor([b - a for a, b in pairwise(edges[dim])], dtype=torch.int64)
        volume = (volume * widths).sum(-1)
    return int(volume)
