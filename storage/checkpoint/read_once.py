"""Read once, share over the process group (``CheckpointReader(read_once=True)``).

When several ranks need the same stored item (replicated DDP/HSDP state, overlapping
shards of a resharded load), stock DCP has each of them fetch and decode it: an 8-rank
load of a replicated state reads every byte 8 times. Here the coordinator, in
``prepare_global_plan``, gives each such item one *owner* among the ranks that need it,
balancing the bytes every rank fetches (its sole-consumer items count too); the owner
fetches, verifies and decodes it once, and sends the decoded bytes point to point to
the other ranks that need it. Items one rank alone needs are read as before.

Every rank receives the same schedule (:class:`Share` records in one global order,
cut into batches of :func:`batch_limit` bytes), and goes through the batches in that
order: agree with every rank that nothing failed in fetching the batch (a small
``all_gather_object``: a rank that failed or missed its deadline is named by every
rank, rather than leaving the others waiting for bytes that never come), exchange,
then hand each chunk to the planner, narrowed to what each request asked for. Fetching
runs ahead on a thread of its own (:data:`AHEAD` batches past the one being
exchanged), so on a bandwidth-bound store the exchange hides behind the fetch. A chunk
a rank wants whole, whose target is a plain CPU tensor, is decoded, sent and received
in the target itself; others travel through a buffer.

The agreement and the exchange are in storage/checkpoint/share_exchange.py. The
exchange needs a group that sends CPU tensors: storage/checkpoint/share_groups.py
picks it (the reader's process group when it has gloo, else, for the default group of
an NCCL-only job, a gloo group made once).

Tensor items travel decoded, as their chunk's bytes in the metadata's dtype; non-tensor
items travel as the owner's re-pickled plain value (``decode.plain_value``) after their
length. The owner is a rank of the same job, so what it sends is trusted as much as the
rank itself.
"""

from __future__ import annotations

import dataclasses
import io
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from extensions._compat import narrow_tensor_by_index
from extensions.errors import quote
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.deadline import Budget
from storage.checkpoint.fetch import read_items
from storage.checkpoint.load_context import Chunks, LoadContext
from storage.checkpoint.share_exchange import Share, agree, exchange, time_left
from storage.checkpoint.share_groups import exchange_group
from storage.checkpoint.tensors import check_shapes, holds_its_bytes

#: Decoded bytes of shared items per batch, at most (one item larger than this is a
#: batch of its own); smaller batches when there is less to share (:func:`batch_limit`).
BATCH_BYTES = 64 << 20
#: ... at least this much per batch: each batch costs one agreement round.
MIN_BATCH_BYTES = 16 << 20
#: Batches fetched ahead of the one being exchanged. A rank holds, for sharing, at most
#: the chunks of the batch it exchanges plus those it owns in the batches ahead.
AHEAD = 2


@dataclasses.dataclass(frozen=True)
class SharePlan:
    """A load plan's ``storage_data`` under read-once: the shares this rank owns or
    consumes, by ``seq``, and the number of batches every rank goes through."""

    rank: int
    batches: int
    shares: tuple[Share, ...]


def batch_limit(total: int) -> int:
    """Bytes per batch when ``total`` decoded bytes are shared: about 8 batches, so
    the last exchange (which nothing hides) is short, within the bounds above."""
    return min(BATCH_BYTES, max(MIN_BATCH_BYTES, total // 8))


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

    def size(index: MetadataIndex) -> int:
        return length(index) if kinds[index] else _chunk_bytes(chunks[index])

    limit = batch_limit(sum(size(i) for i in shared))
    per_rank: list[list[Share]] = [[] for _ in plans]
    batch, in_batch = 0, 0
    for seq, index in enumerate(shared):
        if in_batch and in_batch + size(index) > limit:
            batch, in_batch = batch + 1, 0
        in_batch += size(index)
        owner = min(consumers[index], key=lambda r: (load[r], r))
        load[owner] += length(index)
        share = Share(seq, batch, index, kinds[index], owner, tuple(consumers[index]))
        for rank in share.consumers:
            per_rank[rank].append(share)
    return [
        dataclasses.replace(plan, storage_data=SharePlan(rank, batch + 1, tuple(per_rank[rank])))
        for rank, plan in enumerate(plans)
    ]


def read_shared(load: LoadContext, plan: LoadPlan, planner: LoadPlanner) -> None:
    """Carry out ``plan`` (whose ``storage_data`` is a :class:`SharePlan`) on this rank,
    with what ``load`` was set up with (its items read through ``fetch.read_items``).
    A target the plan leaves partly without a value is refused
    (``LoadContext.check_covered``) on every rank, at the first agreement.

    A collective over the load's process group: every rank of it calls this together
    (DCP's ``read_data``), and the first call may create the exchange group."""
    share_plan: SharePlan = plan.storage_data
    me = share_plan.rank
    group = load.process_group
    channel = exchange_group(group)
    left = load.budget.left()
    deadline = None if left is None else time.monotonic() + left
    safe = _Serialized(planner)
    shared = {s.index for s in share_plan.shares}
    wanted: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
    direct: list[ReadItem] = []
    for req in plan.items:
        (wanted[req.storage_index] if req.storage_index in shared else direct).append(req)
    batches: list[list[Share]] = [[] for _ in range(share_plan.batches)]
    for share in share_plan.shares:
        batches[share.batch].append(share)

    def fetch(batch: int) -> tuple[_Batch | None, BaseException | None]:
        try:
            if batch == 0:
                load.check_covered(planner, plan.items)
            held = _Batch(safe, load.chunks, batches[batch], wanted, me)
            read_items(
                load,
                (direct if batch == 0 else []) + held.requests,
                held,  # type: ignore[arg-type]
                Budget(time_left(deadline)),
            )
            return held, None
        except Exception as exc:  # every rank must hear of it before the exchange
            return None, exc

    with _Prefetcher(fetch, len(batches)) as fetcher:
        for batch, shares in enumerate(batches):
            held, error = fetcher.take(batch)
            agree(error, channel)
            assert held is not None
            received = exchange(shares, held.buffers, me, group, channel, load.chunks, deadline)
            fetcher.done(batch)
            for share in shares:
                _apply(load, safe, held, wanted[share.index], received[share.index])


class _Serialized:
    """The planner, called by one thread at a time: the fetch of later batches runs
    while this rank's thread exchanges and hands over earlier ones."""

    def __init__(self, planner: LoadPlanner) -> None:
        self.planner = planner
        self._lock = threading.Lock()

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        with self._lock:
            return self.planner.resolve_tensor(req).detach()

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        with self._lock:
            self.planner.commit_tensor(req, tensor)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        with self._lock:
            self.planner.load_bytes(req, value)


class _Batch:
    """One batch on this rank: where each shared chunk lands, and the planner its owned
    items are read through.

    A chunk that this rank wants whole, in one request, whose target is a contiguous
    CPU tensor of the chunk's dtype and shape, lands in that target: the owner decodes
    into it and sends from it, a consumer receives into it. Any other chunk lands in a
    buffer of its own, narrowed and copied into each request's target afterwards.
    Reading an owned item through this object resolves to where it lands; the rank's
    own items (``direct``, read with the first batch) go to the real planner."""

    def __init__(
        self,
        planner: _Serialized,
        chunks: Chunks,
        shares: list[Share],
        wanted: Mapping[MetadataIndex, list[ReadItem]],
        me: int,
    ) -> None:
        self.planner = planner
        self.buffers: dict[MetadataIndex, torch.Tensor] = {}
        self.targets: dict[MetadataIndex, tuple[ReadItem, torch.Tensor]] = {}
        self.requests: list[ReadItem] = []
        self._ours: set[int] = set()
        for share in shares:
            if share.is_bytes:
                if share.owner == me:
                    one = torch.Size([0])
                    self._own(
                        ReadItem(LoadItemType.BYTE_IO, share.index, one, share.index, one, one)
                    )
                continue
            sizes, dtype = chunks[share.index]
            reqs = wanted.get(share.index, [])
            if len(reqs) == 1 and _whole(reqs[0], sizes):
                target = planner.resolve_tensor(reqs[0])
                self.targets[share.index] = (reqs[0], target)
                if _fits(target, sizes, dtype):
                    self.buffers[share.index] = target
            if share.owner == me:
                if share.index not in self.buffers:
                    self.buffers[share.index] = torch.empty(tuple(sizes), dtype=dtype)
                zeros = torch.Size([0] * len(sizes))
                self._own(
                    ReadItem(LoadItemType.TENSOR, share.index, zeros, share.index, zeros, sizes)
                )

    def _own(self, req: ReadItem) -> None:
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


class _Prefetcher:
    """Runs ``fetch(0)``, ``fetch(1)``, ... on a thread of its own, at most
    :data:`AHEAD` batches past the one being exchanged, so fetching overlaps the
    exchange. Leaving the ``with`` block stops it and waits for a fetch in progress
    (bounded by the reader's deadline, if any), so nothing lands after the load ends."""

    def __init__(
        self, fetch: Callable[[int], tuple[_Batch | None, BaseException | None]], count: int
    ) -> None:
        self._fetch, self._count = fetch, count
        self._ready: dict[int, tuple[_Batch | None, BaseException | None]] = {}
        self._finished = -1  # the last batch exchanged
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dcp-storage-read-once", daemon=True)

    def __enter__(self) -> _Prefetcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        for batch in range(self._count):
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopped or batch <= self._finished + 1 + AHEAD  # noqa: B023
                )
                if self._stopped:
                    return
            try:
                result = self._fetch(batch)
            except BaseException as exc:  # noqa: BLE001 - reported by take() like any failure
                result = None, exc
            with self._cond:
                self._ready[batch] = result
                self._cond.notify_all()
            if result[1] is not None:
                return  # the load fails at this batch: fetch nothing more

    def take(self, batch: int) -> tuple[_Batch | None, BaseException | None]:
        with self._cond:
            self._cond.wait_for(lambda: batch in self._ready)
            return self._ready.pop(batch)

    def done(self, batch: int) -> None:
        with self._cond:
            self._finished = batch
            self._cond.notify_all()


def _apply(
    load: LoadContext,
    planner: _Serialized,
    held: _Batch,
    reqs: list[ReadItem],
    value: torch.Tensor,
) -> None:
    """Hand one shared item to the planner, for each request of this rank."""
    for req in reqs:
        label = fmt.item_label(req.storage_index)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(value.numpy().tobytes()))
            continue
        landed = held.targets.get(req.storage_index)
        if landed is not None and landed[0] is req:
            target = landed[1]
            if target is value:  # decoded or received in place
                planner.commit_tensor(req, target)
                continue
        else:
            target = planner.resolve_tensor(req)
        where = f"{load.url}: item {quote(label)} (shared)"
        check_shapes(req, target, load.chunks.get(req.storage_index), where)
        target.copy_(narrow_tensor_by_index(value, req.storage_offsets, req.lengths))
        planner.commit_tensor(req, target)


def _chunk_bytes(chunk: tuple[torch.Size, torch.dtype]) -> int:
    return math.prod(chunk[0]) * chunk[1].itemsize


def _whole(req: ReadItem, sizes: torch.Size) -> bool:
    return tuple(req.lengths) == tuple(sizes) and not any(req.storage_offsets)


def _fits(target: torch.Tensor, sizes: torch.Size, dtype: torch.dtype) -> bool:
    """Whether ``target`` can hold the chunk's bytes as they travel (and be sent)."""
    return (
        holds_its_bytes(target) and target.dtype == dtype and tuple(target.size()) == tuple(sizes)
    )
