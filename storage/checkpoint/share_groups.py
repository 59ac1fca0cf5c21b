"""Which process group read-once sends CPU tensors over (storage/checkpoint/read_once.py).

The reader's process group serves when it has a gloo backend (``gloo``, or
``cpu:gloo,cuda:nccl``, which ``init_process_group()`` without a backend makes on a CUDA
machine). The default group of an NCCL-only job (``init_process_group("nccl")``) gets a
gloo group over all ranks, made the first time a read-once load shares anything and
cached for the life of that default group. ``new_group`` is a collective of the whole
job; it is called from ``read_data``, which every rank of the default group reaches
together in the same load. Any other group without gloo (a subgroup) gets none: only its
ranks are in the load, and ``new_group`` needs every rank of the job (docs/scale.md says
why ``use_local_synchronization`` is not used), so the caller passes a gloo group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from extensions.errors import CheckpointStorageError

#: The gloo group made for an NCCL-only default group: (that default group, the gloo one).
_MADE: dict[str, tuple[Any, Any]] = {}


@dataclass(frozen=True)
class Member:
    """A rank's local load plan's ``storage_data``: the global rank of its process."""

    rank: int


def member() -> Member | None:
    """This process's :class:`Member` (``None`` outside a process group)."""
    return Member(dist.get_rank()) if dist.is_available() and dist.is_initialized() else None


def spans(group: dist.ProcessGroup | None, members: list[Any]) -> bool:
    """Whether DCP's group for a load, whose ranks are in order the ``members`` of the
    local plans, is ``group`` (the default group if ``None``): read-once addresses the
    ranks of ``group`` by DCP's rank numbers, so it may share only then."""
    try:
        ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    except Exception:  # a group this process is not in
        return False
    return [m.rank if isinstance(m, Member) else None for m in members] == ranks


def can_share(group: dist.ProcessGroup | None) -> bool:
    """Whether read-once can exchange for ``group`` (the default group if ``None``): it
    has a gloo backend, or it is the default group and :func:`exchange_group` can make
    one (gloo is built in, and torch makes groups with ``new_group``, not by splitting
    the default group as it does under TorchComms, where an NCCL group yields no gloo
    group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if _has_gloo(group):
        return True
    return _is_default(group) and dist.is_gloo_available() and not _torchcomms()


def check_can_share(group: dist.ProcessGroup | None, url: str) -> None:
    """Raise, naming the fix, when ``read_once=True`` cannot exchange over ``group``."""
    if not can_share(group):
        backend = dist.get_backend(group) if dist.is_initialized() else "none"
        raise CheckpointStorageError(
            f"{url}: read_once=True needs a process group that can send CPU tensors, but the "
            f"reader's group uses {backend!r} and dcp-storage makes a gloo group itself only "
            "for the default group (and not under TorchComms); pass a gloo group over the "
            "same ranks as process_group= (torch.distributed.new_group(ranks, "
            "backend='gloo')) or read_once=False"
        )


def exchange_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group read-once sends over for the reader's ``group``: ``group`` itself when
    it has a gloo backend, else (the default group of an NCCL-only job) a gloo group
    over all ranks, created on first use and cached per default group. The creation is
    a collective of the whole job: only ``read_once.read_shared``, which every rank reaches
    together, calls this."""
    if _has_gloo(group):
        return group
    if not can_share(group):
        raise CheckpointStorageError(f"no gloo group for {group!r}")  # check_can_share
    default = dist.group.WORLD
    made = _MADE.get("default")
    if made is None or made[0] is not default:  # a new default group since
        gloo = dist.new_group(backend="gloo", group_desc="dcp_storage_read_once")
        _MADE["default"] = made = (default, gloo)
    return made[1]  # type: ignore[no-any-return]


def _has_gloo(group: dist.ProcessGroup | None) -> bool:
    return "gloo" in str(dist.get_backend(group))


def _is_default(group: dist.ProcessGroup | None) -> bool:
    return group is None or group is dist.group.WORLD


def _torchcomms() -> bool:
    try:
        from torch.distributed import config
    except ImportError:  # older torch: no TorchComms
        return False
    return bool(getattr(config, "use_torchcomms", False))
