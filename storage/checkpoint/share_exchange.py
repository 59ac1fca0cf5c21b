"""The collective half of a read-once load (``read_once.py``): every rank agreeing
that a batch was fetched (a failure is raised on every rank, naming the rank that
failed), then the point-to-point exchange of the batch's shared items over the
exchange group (``share_groups.py``), each bounded by the load's deadline."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from storage.checkpoint.deadline import CheckpointRankError, DeadlineExceededError, rank_error
from storage.checkpoint.load_context import Chunks
from storage.checkpoint.tensors import flat_bytes


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


def agree(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
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


def exchange(
    shares: list[Share],
    buffers: Mapping[MetadataIndex, torch.Tensor],
    me: int,
    group: dist.ProcessGroup | None,
    channel: dist.ProcessGroup | None,
    chunks: Chunks,
    deadline: float | None,
) -> dict[MetadataIndex, torch.Tensor]:
    """Send what this rank owns to its consumers and receive what it consumes (into
    where each chunk lands), over ``channel``; ranks are ``group``'s."""
    received = {s.index: buffers[s.index] for s in shares if s.owner == me}

    def peer(rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    # Non-tensor values first announce their length.
    sizes: dict[MetadataIndex, torch.Tensor] = {}
    ops = []
    for share in (s for s in shares if s.is_bytes):
        if share.owner == me:
            length = torch.tensor([received[share.index].numel()], dtype=torch.int64)
            ops += [
                dist.P2POp(dist.isend, length, peer(c), channel, 2 * share.seq)
                for c in share.consumers
                if c != me
            ]
        else:
            sizes[share.index] = torch.zeros(1, dtype=torch.int64)
            ops.append(
                dist.P2POp(
                    dist.irecv, sizes[share.index], peer(share.owner), channel, 2 * share.seq
                )
            )
    _run(ops, deadline)
    ops = []
    for share in shares:
        if share.owner == me:
            flat = flat_bytes(received[share.index])
            if flat.numel():
                ops += [
                    dist.P2POp(dist.isend, flat, peer(c), channel, 2 * share.seq + 1)
                    for c in share.consumers
                    if c != me
                ]
            continue
        if share.is_bytes:
            buffer = torch.empty(int(sizes[share.index].item()), dtype=torch.uint8)
        elif share.index in buffers:
            buffer = buffers[share.index]
        else:
            chunk_sizes, dtype = chunks[share.index]
            buffer = torch.empty(tuple(chunk_sizes), dtype=dtype)
        received[share.index] = buffer
        if buffer.numel():
            ops.append(
                dist.P2POp(
                    dist.irecv, flat_bytes(buffer), peer(share.owner), channel, 2 * share.seq + 1
                )
            )
    _run(ops, deadline)
    return received


def _run(ops: list[dist.P2POp], deadline: float | None) -> None:
    if not ops:
        return
    left = time_left(deadline)
    for work in dist.batch_isend_irecv(ops):
        if left is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=max(left, 0.001)))


def time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
