"""How :class:`~storage.ops.transport.StorageTransport` sends a ``DTensor``: its local
shard as a plain tensor, and its layout (mesh ranks and names, placements, global shape
and stride) as plain data in the state dict's shape record; the receiver rebuilds the
``DTensor`` around the shard it loads, on a mesh of the same ranks.

This is what torchft's own transports hand back (a ``DTensor`` with the sender's spec
and local shard): the worker that heals holds the sender's rank in an identical replica
group, so the shard is its own. DCP would store the shard under the global shape instead
(and nothing for a tensor on a mesh without dimensions), and the receiver would get a
plain, zero-filled global tensor.

The mesh is the receiver's own where the caller hands one (the ``DTensor`` at the same
place in a state dict of its own); else it is rebuilt from the sender's ranks, which
gives a mesh equal to the receiver's own only for a whole (root or flattened) mesh: a
``DTensor`` on a slice of one (HSDP's or FSDP with tensor parallelism's ``mesh["dp"]``)
is then refused, naming the fix.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from extensions._compat import (
    DTensorSpec,
    StridedShard,
    TensorMeta,
    local_shape_and_offset,
    mesh_without_groups,
)
from extensions.errors import UnsafeCheckpointError, printable, quote

#: Most ranks a received mesh may name (a record is the sender's: it is checked).
MAX_MESH_RANKS = 1 << 20
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")


def describe(value: DTensor, where: str) -> list[Any]:
    """``value``'s layout as plain data: ``[device_type, ranks, dim_names, placements,
    shape, stride, whole]``, ``whole`` saying whether a mesh rebuilt from the ranks
    equals ``value``'s (not so for a slice of a mesh). A layout it cannot carry whole
    (a placement other than shard, strided shard, replicate or partial; a shard order
    other than the default) is refused naming ``where``, rather than arriving changed."""
    mesh = value.device_mesh
    names = mesh.mesh_dim_names
    record = [
        mesh.device_type,
        mesh.mesh.tolist(),
        None if names is None else list(names),
        [_placement(p, where) for p in value.placements],
        list(value.shape),
        list(value.stride()),
    ]
    try:
        whole = _rebuilt_mesh(record) == mesh
    except Exception:
        whole = False
    record.append(whole)
    if _spec(mesh, record, value.dtype) != value._spec:
        raise ValueError(
            f"{where} is a DTensor whose layout {value._spec} the transport cannot carry "
            "(only its mesh, placements, shape and stride travel); redistribute it to the "
            "default shard order before sending"
        )
    return record


def _placement(p: Placement, where: str) -> list[Any]:
    if type(p) is Shard:
        return ["S", p.dim]
    if type(p) is StridedShard:
        return ["SS", p.dim, p.split_factor]
    if type(p) is Replicate:
        return ["R"]
    if type(p) is Partial:
        return ["P", p.reduce_op]
    raise ValueError(
        f"{where} is a DTensor placed {p!r}, which the transport cannot carry (it sends "
        "Shard, _StridedShard, Replicate and Partial); redistribute it before sending"
    )


def _spec(mesh: Any, record: list[Any], dtype: torch.dtype) -> DTensorSpec:
    placements = tuple(_PLACEMENTS[p[0]](*p[1:]) for p in record[3])
    meta = TensorMeta(torch.Size(record[4]), tuple(record[5]), dtype)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


_PLACEMENTS: dict[str, Any] = {
    "S": Shard,
    "SS": lambda dim, split: StridedShard(dim, split_factor=split),
    "R": Replicate,
    "P": Partial,
}
_ARITY = {"S": 1, "SS": 2, "R": 0, "P": 1}


def rebuild(local: Any, record: Any, where: str, own: Any = None) -> DTensor:
    """The ``DTensor`` the sender described by ``record``, around ``local``, its loaded
    shard (kept where it was loaded: on the CPU, as the transport's plain tensors), on
    the mesh of ``own`` where that is a ``DTensor`` (the receiver's at the same place),
    else on one rebuilt from the sender's ranks. The record is the sender's, so it is
    checked first; a malformed one is refused naming ``where`` (the checkpoint and the
    item), and so is one whose mesh is not ``own``'s."""
    if not (isinstance(local, torch.Tensor) and _well_formed(record)):
        raise UnsafeCheckpointError(
            f"{where}: the record of this DTensor's layout is malformed, or its local shard "
            "is missing; the checkpoint is damaged or not written by StorageTransport: have "
            "the sender send it again"
        )
    if isinstance(own, DTensor):
        _check_own_mesh(own.device_mesh, record, where)
    elif not record[6]:
        raise RuntimeError(
            f"{where} is a DTensor on a slice of a device mesh (ranks {quote(record[1])}, "
            f"named {quote(record[2])}), which cannot be rebuilt from its ranks alone: pass "
            "state_dict= to the transport (a function returning this worker's own state, as "
            "the sender sends it) so the DTensor is rebuilt on this worker's mesh"
        )
    elif not dist.is_initialized():
        raise RuntimeError(
            f"{where} is a DTensor: receiving it rebuilds its device mesh on this process's "
            "ranks, which needs torch.distributed initialized (init_process_group) before "
            "recv_checkpoint"
        )
    try:
        mesh = own.device_mesh if isinstance(own, DTensor) else _rebuilt_mesh(record)
        spec = _spec(mesh, record, local.dtype)
        expected = _shard_shape(spec, mesh, local)
    except (ValueError, TypeError, IndexError, AssertionError, RuntimeError) as exc:
        raise UnsafeCheckpointError(
            f"{where}: the sender's DTensor layout {quote(record)} cannot be rebuilt here "
            f"({printable(str(exc), 200)}); the checkpoint is damaged, or the replica groups "
            "differ in layout: give them the same device mesh"
        ) from exc
    if tuple(local.shape) != tuple(expected):
        # A shard of another shape would make a DTensor whose local tensor disagrees with
        # its spec: ops on it read past the shard, or leave part of the layout unset.
        raise UnsafeCheckpointError(
            f"{where}: the sender's shard here has shape {quote(list(local.shape))}, but its "
            f"DTensor layout {quote(record)} gives this rank a shard of shape "
            f"{quote(list(expected))}; the checkpoint is damaged or the replica groups "
            "differ in layout: give them the same device mesh, and have the sender send it again"
        )
    return DTensor(local, spec, requires_grad=False)


def _shard_shape(spec: DTensorSpec, mesh: Any, local: torch.Tensor) -> tuple[int, ...]:
    """The shape the sender's shard must have: this rank's under ``spec`` (the sender is
    this rank of another replica group, laid out alike), or, where this process is not
    in the mesh (so its place is not known), ``local``'s own where it fits inside the
    global shape, rank for rank, else the global shape (which refuses it)."""
    if mesh.get_coordinate() is not None:
        shape, _ = local_shape_and_offset(spec.shape, mesh, spec.placements)
        return tuple(shape)
    fits = local.dim() == len(spec.shape) and all(
        n <= whole for n, whole in zip(local.shape, spec.shape)
    )
    return tuple(local.shape) if fits else tuple(spec.shape)


def _check_own_mesh(mesh: Any, record: list[Any], where: str) -> None:
    names = None if mesh.mesh_dim_names is None else list(mesh.mesh_dim_names)
    if [mesh.device_type, mesh.mesh.tolist(), names] != record[:3]:
        raise UnsafeCheckpointError(
            f"{where}: the sender's DTensor is on a {record[0]} mesh of ranks "
            f"{quote(record[1])} named {quote(record[2])}, this worker's on a "
            f"{mesh.device_type} mesh of ranks {quote(mesh.mesh.tolist())} named "
            f"{quote(names)}; give the replica groups the same mesh"
        )


def _rebuilt_mesh(record: list[Any]) -> Any:
    device_type, ranks, names = record[:3]
    return mesh_without_groups(device_type, ranks, None if names is None else tuple(names))


def _well_formed(record: Any) -> bool:
    if not (isinstance(record, list) and len(record) == 7):
        return False
    device_type, ranks, names, placements, shape, stride, whole = record
    dims = _mesh_dims(ranks)
    return (
        type(whole) is bool
        and isinstance(device_type, str)
        and _DEVICE_TYPE.fullmatch(device_type) is not None
        and dims is not None
        and (
            names is None
            or (
                isinstance(names, list)
                and len(names) == len(dims)
                and all(isinstance(n, str) for n in names)
            )
        )
        and _ints(shape)
        and _ints(stride)
        and len(shape) == len(stride)
        and isinstance(placements, list)
        and len(placements) == len(dims)
        and all(_placement_ok(p, len(shape)) for p in placements)
    )


def _mesh_dims(ranks: Any) -> list[int] | None:
    """The sizes of a rectangular nested list of at most :data:`MAX_MESH_RANKS` ranks
    (``[]`` for a bare rank), ``None`` for anything else. The sizes are read off the
    first element of each level and bounded before the rest is walked: the pickle's
    memo makes a list of 64 references to one list cheap, and 8 levels of them a walk
    of 64**8 calls."""
    dims: list[int] = []
    first = ranks
    while isinstance(first, list):
        if not first or len(dims) == 8:
            return None
        dims.append(len(first))
        first = first[0]
    if math.prod(dims) > MAX_MESH_RANKS or not _rectangular(ranks, dims):
        return None
    return dims


def _rectangular(ranks: Any, dims: list[int]) -> bool:
    """Whether ``ranks`` is a nested list of ``dims`` sizes holding ranks."""
    if not dims:
        return type(ranks) is int and 0 <= ranks < MAX_MESH_RANKS
    return (
        isinstance(ranks, list)
        and len(ranks) == dims[0]
        and all(_rectangular(r, dims[1:]) for r in ranks)
    )


def _placement_ok(p: Any, ndim: int) -> bool:
    if not (isinstance(p, list) and p and p[0] in _ARITY and len(p) == 1 + _ARITY[p[0]]):
        return False
    if p[0] == "P":
        return isinstance(p[1], str) and len(p[1]) <= 32
    return _ints(p[1:]) and (p[0] == "R" or p[1] < ndim)


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(type(v) is int and 0 <= v < 1 << 62 for v in values)


__all__ = ["describe", "rebuild"]
