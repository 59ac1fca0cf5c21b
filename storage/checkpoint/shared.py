"""One request, not one per rank: the coordinator asks storage, every rank gets the answer.

In a collective load every rank would read the same ``.metadata`` (and, when it is
missing, list the directory to say why): N identical requests at once, where N may be
thousands. :func:`on_coordinator` runs such a request on the group's rank 0 only and
broadcasts its result, or its error, to the others. It is a collective: only callers
that every rank reaches together use it (``storage.load`` turns it on for the reader's
metadata read, ``CheckpointReader(share_metadata=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def group_size(group: Any) -> int:
    """Ranks in ``group`` (the default group if ``None``); 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def on_coordinator(request: Callable[[], T], group: Any = None) -> T:
    """``request()`` run on the group's rank 0; its result or error on every rank."""
    if group_size(group) == 1:
        return request()
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box = [(True, request())]
        except Exception as exc:  # handed to every rank below
            box = [(False, exc)]
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=source, group=group)
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
