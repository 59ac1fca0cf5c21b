"""How many elements a set of chunks of a tensor holds: the volume of the union of
boxes (each an ``(offsets, sizes)`` pair), counted exactly, at a bounded cost.

Chunks a torch save writes never overlap: each dimension is cut at the same places
for every chunk (a sharding's boundaries), so every chunk is one cell of the grid those
cuts make, and their volumes add up. That case is recognised in O(n log n) and counted
so (:func:`union_volume`). Chunks that overlap (a chunk saved by two ranks without
dedup, or a crafted metadata: two chunks overlapping in part can sum to the tensor's
size while leaving a gap) are counted exactly too: one dimension by sorting and
merging, several by marking the cells of that grid, all boxes at once. The grid of
chunks with many unshared edges in several dimensions grows as a power of their count
(and that of two chunks overlapping in part in each of ``d`` dimensions as ``3**d``),
so marking is bounded, in all (:data:`MAX_CELLS`) and per box (:data:`CELLS_PER_BOX`):
beyond that :class:`Irregular` is raised, for the caller to refuse naming the item.
The bound per box keeps a count's cost in proportion to the chunks a metadata lists,
each counted as often as a tensor lists it: a few chunks overlapping in a dozen
dimensions, whose list a metadata's many tensors share for a few bytes each, must not
make every load of it spend seconds per tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from itertools import pairwise

import torch

#: An ``(offsets, sizes)`` pair: a chunk's place in its tensor, or a read's in its target.
Box = tuple[tuple[int, ...], tuple[int, ...]]

#: Most cells of the grid the chunks' edges cut a tensor into that an exact count marks
#: (four bytes each, and eight more while they are summed).
MAX_CELLS = 1 << 22
#: Most cells of that grid, and most corners of a box (``2**d`` in ``d`` dimensions the
#: grid cuts), an exact count spends per box it counts: overlapping layouts that are no
#: damage (chunks of two shardings of a tensor, a whole replica beside its shards) cut
#: a few cells per box, in a few dimensions.
CELLS_PER_BOX = 1 << 10


class Irregular(Exception):
    """Boxes that overlap over a grid too large to count exactly (:data:`MAX_CELLS`,
    :data:`MAX_MARKS`, :data:`CELLS_PER_BOX`): no torch save lays chunks out so."""


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
    return _marked_volume(distinct)


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


def _marked_volume(boxes: Collection[Box]) -> int:
    """The volume of the grid cells (cut at the ``boxes``' edges in each dimension) that
    the ``boxes`` mark, within :data:`MAX_CELLS` and :data:`CELLS_PER_BOX`. The cells
    are marked all at once, never box by box: each box adds one at its first cell and
    takes one past its last (its ``2**d`` corners, signed), and the running sums along
    each dimension count the boxes holding each cell. A dimension the grid does not cut
    (every box spans it whole) is left out of the grid."""
    starts = torch.tensor([o for o, _ in boxes], dtype=torch.int64).T.contiguous()
    ends = starts + torch.tensor([s for _, s in boxes], dtype=torch.int64).T
    edges = [torch.unique(torch.cat(pair)) for pair in zip(starts, ends, strict=True)]
    cut = [d for d, e in enumerate(edges) if len(e) > 2]
    cells = math.prod(len(edges[d]) - 1 for d in cut)
    if cells > min(MAX_CELLS, CELLS_PER_BOX * len(boxes)) or 2 ** len(cut) > CELLS_PER_BOX:
        raise Irregular(f"{len(boxes)} boxes over {cells} grid cells in {len(cut)} dimensions")
    first = [torch.searchsorted(edges[d], starts[d]) for d in cut]
    last = [torch.searchsorted(edges[d], ends[d]) for d in cut]
    held = torch.zeros([len(edges[d]) for d in cut], dtype=torch.int32)
    signs = {odd: torch.full((len(boxes),), -1 if odd else 1, dtype=torch.int32) for odd in (0, 1)}
    for corner in itertools.product((False, True), repeat=len(cut)):
        index = tuple(b if past else a for a, b, past in zip(first, last, corner, strict=True))
        held.index_put_(index, signs[sum(corner) % 2], accumulate=True)
    for dim in range(len(cut)):
        held = held.cumsum(dim, dtype=torch.int32)
    volume = (held[(slice(-1),) * len(cut)] > 0).to(torch.int64)
    for dim in reversed(cut):
        volume = (volume * edges[dim].diff()).sum(-1)
    whole = (int(e[1] - e[0]) for d, e in enumerate(edges) if d not in cut)
    return int(volume) * math.prod(whole)
