"""Read once, share over the process group (``CheckpointReader(read_once=True)``).

When several ranks need the same stored item (replicated DDP/HSDP state, overlapping
shards of a resharded load), stock DCP has each of them fetch and decode it: an 8-rank
load of a replicated state reads every byte 8 times. Here the coordinator, in
``prepare_global_plan``, gives each such item one *owner* among the ranks that need it,
balancing the bytes every rank fetches (its sole-consumer items count too); the owner
fetches, verifies and decodes it once, and sends the decoded bytes point to point to
the other ranks that need it. Items one rank alone needs are read as before.

Every rank receives the same schedule (:class:`Share` records in one global order,
cut into batches of at most :data:`BATCH_BYTES`, so the memory held for sharing stays
bounded), and goes through the batches in that order: fetch what it owns (plus, in
the first batch, its own items), agree with every rank that nothing failed (a small
``all_gather_object``: a rank that failed or missed its deadline is named by every
rank, rather than leaving the others waiting for bytes that never come), exchange,
then hand each received chunk to the planner, narrowed to what each request asked for.

Tensor items travel decoded, as their chunk's bytes in the metadata's dtype; non-tensor
items travel as the owner's re-pickled plain value (``decode.plain_value``) after their
length. The owner is a rank of the same job, so what it sends is trusted as much as the
rank itself.
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from extensions._compat import narrow_tensor_by_index
from extensions.errors import quote
from storage.checkpoint import format as fmt
from storage.checkpoint._common import check_shapes
from storage.checkpoint.deadline import (
    Budget,
    CheckpointRankError,
    DeadlineExceededError,
    rank_error,
)

if TYPE_CHECKING:
    from storage.checkpoint.reader import CheckpointReader

#: Decoded bytes shared per batch: what a rank holds at most for sharing at a time.
BATCH_BYTES = 512 << 20

Chunks = Mapping[MetadataIndex, tuple[torch.Size, torch.dtype]]


@dataclasses.dataclass(frozen=True)
class Share:
    """One stored item several ranks need: ``owner`` fetches it, ``consumers`` (the
    owner among them) get it; ``seq`` is its place in the global order."""

    seq: int
    batch: int
    index: MetadataIndex
    is_bytes: bool
    owner: int
    consumers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SharePlan:
    """A load plan's ``storage_data`` under read-once: the shares this rank owns or
    consumes, by ``seq``, and the number of batches every rank goes through."""

    rank: int
    batches: int
    shares: tuple[Share, ...]


def can_send_cpu_tensors(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (the default group if ``None``) has a CPU backend (gloo)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "gloo" in str(dist.get_backend(group))


def assign(
    plans: list[LoadPlan], stored: Mapping[MetadataIndex, Any], chunks: Chunks
) -> list[LoadPlan]:
    """The global plans with a :class:`SharePlan` each, or ``plans`` unchanged when no
    stored item is needed by more than one rank."""
    consumers: dict[MetadataIndex, list[int]] = defaultdict(list)
    kinds: dict[MetadataIndex, bool] = {}
    for rank, plan in enumerate(plans):
        for req in plan.items:
            if not consumers[req.storage_index] or consumers[req.storage_index][-1] != rank:
                consumers[req.storage_index].append(rank)
            kinds[req.storage_index] = req.type == LoadItemType.BYTE_IO
    load = [0] * len(plans)

    def length(index: MetadataIndex) -> int:
        info = stored.get(index)
        return int(info.length) if info is not None else 0

    shared = []
    for index, ranks in consumers.items():
        # A tensor item without its chunk in the metadata is refused by each reader.
        if len(ranks) > 1 and (kinds[index] or index in chunks):
            shared.append(index)
        else:
            for rank in ranks:
                load[rank] += length(index)
    if not shared:
        return plans
    shared.sort(key=lambda i: (-length(i), i.fqn, tuple(i.offset or ())))
    per_rank: list[list[Share]] = [[] for _ in plans]
    batch, in_batch = 0, 0
    for seq, index in enumerate(shared):
        size = length(index) if kinds[index] else _chunk_bytes(chunks[index])
        if in_batch and in_batch + size > BATCH_BYTES:
            batch, in_batch = batch + 1, 0
        in_batch += size
        owner = min(consumers[index], key=lambda r: (load[r], r))
        load[owner] += length(index)
        share = Share(seq, batch, index, kinds[index], owner, tuple(consumers[index]))
        for rank in share.consumers:
            per_rank[rank].append(share)
    return [
        dataclasses.replace(plan, storage_data=SharePlan(rank, batch + 1, tuple(per_rank[rank])))
        for rank, plan in enumerate(plans)
    ]


def read_shared(reader: CheckpointReader, plan: LoadPlan, planner: LoadPlanner) -> None:
    """Carry out ``plan`` (whose ``storage_data`` is a :class:`SharePlan`) on this rank."""
    share_plan: SharePlan = plan.storage_data
    me = share_plan.rank
    group = reader.process_group
    left = reader.budget.left()
    deadline = None if left is None else time.monotonic() + left
    shared = {s.index for s in share_plan.shares}
    wanted: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
    direct: list[ReadItem] = []
    for req in plan.items:
        (wanted[req.storage_index] if req.storage_index in shared else direct).append(req)
    for batch in range(share_plan.batches):
        shares = [s for s in share_plan.shares if s.batch == batch]
        owned = [s for s in shares if s.owner == me]
        sink = _Sink(planner, reader._chunks, owned)
        error: BaseException | None = None
        try:
            reader._read_items(
                (direct if batch == 0 else []) + list(sink.requests),
                sink,  # type: ignore[arg-type]
                Budget(_left(deadline)),
            )
        except Exception as exc:  # every rank must hear of it before the exchange
            error = exc
        _agree(error, group)
        received = _exchange(shares, sink.buffers, me, group, reader._chunks, deadline)
        for share in shares:
            _apply(reader, planner, wanted[share.index], received[share.index])


class _Sink:
    """The planner the owned items are read through: whole-chunk requests resolve to
    buffers kept for sending; everything else goes to the real planner."""

    def __init__(self, planner: LoadPlanner, chunks: Chunks, owned: list[Share]) -> None:
        self.planner = planner
        self.buffers: dict[MetadataIndex, torch.Tensor] = {}
        self.requests: list[ReadItem] = []
        self._ours: set[int] = set()
        for share in owned:
            if share.is_bytes:
                one = torch.Size([0])
                req = ReadItem(LoadItemType.BYTE_IO, share.index, one, share.index, one, one)
            else:
                sizes, dtype = chunks[share.index]
                zeros = torch.Size([0] * len(sizes))
                req = ReadItem(LoadItemType.TENSOR, share.index, zeros, share.index, zeros, sizes)
                self.buffers[share.index] = torch.empty(tuple(sizes), dtype=dtype)
            self.requests.append(req)
            self._ours.add(id(req))

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        if id(req) in self._ours:
            return self.buffers[req.storage_index]
        return self.planner.resolve_tensor(req)

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        if id(req) not in self._ours:
            self.planner.commit_tensor(req, tensor)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        if id(req) in self._ours:
            self.buffers[req.storage_index] = torch.frombuffer(
                bytearray(value.getbuffer()), dtype=torch.uint8
            )
        else:
            self.planner.load_bytes(req, value)


def _agree(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank failed to fetch its part of this batch."""
    mine = None
    if error is not None:
        mine = (
            str(error),
            getattr(error, "rank", None),
            getattr(error, "item", None),
            getattr(error, "url", None),
            isinstance(error, DeadlineExceededError),
        )
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    for rank, failure in enumerate(everyone):
        if failure is not None:
            message, failed_rank, item, url, late = failure
            raise rank_error(
                DeadlineExceededError if late else CheckpointRankError,
                message if failed_rank is not None else f"rank {rank}: {message}",
                rank=failed_rank if failed_rank is not None else rank,
                item=item or "?",
                url=url or "?",
            )


def _exchange(
    shares: list[Share],
    owned: dict[MetadataIndex, torch.Tensor],
    me: int,
    group: dist.ProcessGroup | None,
    chunks: Chunks,
    deadline: float | None,
) -> dict[MetadataIndex, torch.Tensor]:
    """Send what this rank owns to its consumers and receive what it consumes."""
    received = dict(owned)

    def peer(rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    # Non-tensor values first announce their length.
    sizes: dict[MetadataIndex, torch.Tensor] = {}
    ops = []
    for share in (s for s in shares if s.is_bytes):
        if share.owner == me:
            length = torch.tensor([owned[share.index].numel()], dtype=torch.int64)
            ops += [
                dist.P2POp(dist.isend, length, peer(c), group, 2 * share.seq)
                for c in share.consumers
                if c != me
            ]
        else:
            sizes[share.index] = torch.zeros(1, dtype=torch.int64)
            ops.append(
                dist.P2POp(dist.irecv, sizes[share.index], peer(share.owner), group, 2 * share.seq)
            )
    _run(ops, deadline)
    ops = []
    for share in shares:
        if share.owner == me:
            flat = _flat(owned[share.index])
            if flat.numel():
                ops += [
                    dist.P2POp(dist.isend, flat, peer(c), group, 2 * share.seq + 1)
                    for c in share.consumers
                    if c != me
                ]
            continue
        if share.is_bytes:
            buffer = torch.empty(int(sizes[share.index].item()), dtype=torch.uint8)
        else:
            chunk_sizes, dtype = chunks[share.index]
            buffer = torch.empty(tuple(chunk_sizes), dtype=dtype)
        received[share.index] = buffer
        if buffer.numel():
            ops.append(
                dist.P2POp(dist.irecv, _flat(buffer), peer(share.owner), group, 2 * share.seq + 1)
            )
    _run(ops, deadline)
    return received


def _apply(
    reader: CheckpointReader, planner: LoadPlanner, reqs: list[ReadItem], value: torch.Tensor
) -> None:
    """Hand one shared item to the planner, for each request of this rank."""
    for req in reqs:
        label = fmt.item_label(req.storage_index)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(value.numpy().tobytes()))
            continue
        target = planner.resolve_tensor(req).detach()
        where = f"{reader.url}: item {quote(label)} (shared)"
        check_shapes(req, target, reader._chunks.get(req.storage_index), where)
        target.copy_(narrow_tensor_by_index(value, req.storage_offsets, req.lengths))
        planner.commit_tensor(req, target)


def _run(ops: list[dist.P2POp], deadline: float | None) -> None:
    if not ops:
        return
    left = _left(deadline)
    for work in dist.batch_isend_irecv(ops):
        if left is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=max(left, 0.001)))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _chunk_bytes(chunk: tuple[torch.Size, torch.dtype]) -> int:
    return math.prod(chunk[0]) * chunk[1].itemsize


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
