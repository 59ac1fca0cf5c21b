"""How :class:`~storage.ops.transport.StorageTransport` loads a received checkpoint:
into an empty state dict rebuilt from the sender's metadata, which is checked before it
sizes anything (the sender may be damaged or hostile), against the bytes stored and the
receiver's own state where it gives one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from extensions._compat import EmptyStateDictLoadPlanner, set_element
from extensions.errors import IntegrityError, UnsafeCheckpointError, quote
from storage.checkpoint.coverage import stored_elements
from storage.checkpoint.decode import MAX_OBJECT_BYTES, refused_pickle
from storage.checkpoint.tensors import stored_allocator
from storage.ops.transport_budget import Budget, budget, memory_of, over_budget
from storage.ops.transport_shape import MAX_NESTING


class PlainDataPlanner(EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata; non-tensor values are
    unpickled with ``weights_only=True`` (plain data only, never code).

    What the metadata claims is checked before it sizes anything: each tensor is
    allocated by ``tensors.empty_stored`` (a claim its stored bytes cannot hold is
    refused, a failed allocation names the item; zeroed, so what no chunk covers is
    never this process's old memory), and the list indices of the paths in
    ``planner_data`` may ask for at most :data:`MAX_OBJECT_BYTES` list slots in all
    (torch's ``set_element`` grows a list to an index one ``None`` at a time).

    Each tensor is allocated at the global size the sender claims, so that claim is
    bounded too: by what its stored chunks hold (each element once,
    ``coverage.stored_elements``; an untransformed chunk holds a byte per element it
    claims), or, where they hold less, by the receiver's own state (``own``: the
    transport's ``state_dict=``), whose tensor at the same place must have that shape
    and dtype (of a DTensor there, its local shard, which is what a sender sends of it:
    its global shape would let a sender claim what the other ranks hold, and a wider
    dtype up to 16 times the memory the receiver holds), and which backs no other claim
    (one tensor at two places, as tied weights are, would back two allocations of its
    size). Else the tensor is refused
    before anything is allocated, naming the checkpoint, ``sender``, the item and the
    sizes: 24 bytes of metadata claiming 2**40 elements must not make the receiver
    allocate (or fail allocating) 4 TiB. And the claims in all must fit the receive's
    budget (:mod:`~storage.ops.transport_budget`: ``max_bytes``, else a multiple of
    ``own``, else the memory this process may use), checked before any tensor is allocated: a
    compression bomb inside its codec's bound (zeros compress ~25,000x) must not make
    the receiver fill more memory than a healthy peer's state takes.

    Its targets are made from the stored chunks (``targets_from_metadata``): a sender
    of a tensor sharded over ranks (a ``ShardedTensor``) stores only its own shards, so
    what no chunk covers of a tensor the receiver's own state has is no damage here (the
    reader does not refuse it; it stays zero)."""

    targets_from_metadata = True

    def __init__(
        self,
        where: str,
        sender: str = "the sender",
        own: Callable[[], Any] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self._where = where
        self._sender = sender
        self._own = own
        self._max_bytes = max_bytes
        self._budget = Budget(None, "")  # set up with the metadata (set_up_planner)
        self._spent = 0
        self._names: dict[int, Any] = {}  # the own state's mappings indexed (at_path)
        self._backing: dict[Any, str] = {}  # each own tensor believed: the item it backs

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if state_dict or metadata is None:
            raise ValueError("the transport's planner loads into an empty state dict")
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        check_paths(paths, self._where, metadata.state_dict_metadata)
        # Every claim is checked, and the claims in all against the budget, before
        # any tensor is allocated.
        mine = self._own() if self._own is not None and self._max_bytes is None else None
        limit = budget(self._max_bytes, mine)
        allocators: dict[str, Callable[[], torch.Tensor]] = {}
        total = 0
        for fqn, stored in metadata.state_dict_metadata.items():
            if isinstance(stored, TensorStorageMetadata):
                self._check_size(fqn, stored, paths.get(fqn, (fqn,)))
                allocators[fqn] = stored_allocator(metadata, fqn, self._where, whole=False)
                item = math.prod(stored.size) * stored.properties.dtype.itemsize
                total += item
                if limit.limit is not None and total > limit.limit:
                    raise over_budget(self._where, self._sender, fqn, item, total, limit)
        self._budget, self._spent = limit, total
        for fqn, stored in metadata.state_dict_metadata.items():
            value: Any = allocators[fqn]() if fqn in allocators else stored
            if fqn in paths:
                set_element(state_dict, paths[fqn], value)
            else:
                state_dict[fqn] = value
        DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)

    def _check_size(self, fqn: str, stored: TensorStorageMetadata, path: Sequence[Any]) -> None:
        """Refuse a tensor whose claimed size its stored chunks do not hold, unless the
        receiver's own tensor at ``path`` has that shape and dtype (see the class
        docstring)."""
        total = math.prod(stored.size)
        held = stored_elements(stored)
        if held is not None and held >= total:
            return
        dtype = stored.properties.dtype
        own = at_path(self._own(), path, self._names) if self._own is not None else None
        if isinstance(own, DTensor):
            own = own.to_local()  # what the sender sends of it (transport_dtensor)
        dtype_name = str(dtype).removeprefix("torch.")
        if (
            isinstance(own, torch.Tensor)
            and tuple(own.shape) == tuple(stored.size)
            and own.dtype == dtype
        ):
            memory = memory_of(own)
            backed = self._backing.setdefault(memory, fqn)
            if backed == fqn:
                return
            raise IntegrityError(
                f"{self._where}: item {quote(fqn)}: {self._sender}'s metadata claims a "
                f"{quote(tuple(stored.size))} {dtype_name} tensor its stored chunks do not "
                f"hold, and this worker's own tensor there already backs item {quote(backed)}'s "
                "claim (the same tensor at both places, as tied weights are): one tensor of "
                "this worker's backs one claim, so nothing was allocated. The sender's "
                "metadata is damaged or hostile: have the sender send it again"
            )
        raise IntegrityError(
            f"{self._where}: item {quote(fqn)}: {self._sender}'s metadata claims a "
            f"{quote(tuple(stored.size))} {dtype_name} tensor ({total * dtype.itemsize} bytes) "
            f"but its stored chunks hold {'an uncountable part' if held is None else held} "
            f"of its {total} elements, and this worker's own state has no {dtype_name} tensor "
            "of that shape there (of a DTensor, its local shard): allocating it would take "
            "memory no stored byte fills, so nothing was allocated. The sender's metadata "
            "is damaged or hostile, or it stores only "
            "its own shards of a tensor sharded over ranks: pass state_dict= to the "
            "transport (this worker's own state, as the sender sends it), or have the "
            "sender send it again"
        )

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        # A value's size is known only once read (each at most the reader's
        # max_object_bytes): the values spend what the tensors left of the budget, so
        # many small values that decode large stop at it too.
        size = value.getbuffer().nbytes
        self._spent += size
        if self._budget.limit is not None and self._spent > self._budget.limit:
            raise over_budget(
                self._where, self._sender, fqn, size, self._spent, self._budget, value=True
            )
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise refused_pickle(f"{self._where}: item {quote(fqn)}", exc) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def at_path(state: Any, path: Sequence[Any], names: dict[int, Any] | None = None) -> Any:
    """The value at ``path`` (a ``planner_data`` path: keys and list indices) in
    ``state``, a key matching a path's string where the state's key is not one (an
    optimizer's parameter ids); ``None`` where there is none. ``names`` keeps each
    mapping's keys by their strings from one call to the next (the first key of each
    string, as the mapping orders them), so a mapping is indexed once, not walked for
    each path into it: a sender's thousands of paths into a receiver's optimizer state
    of thousands of parameters cost millions of key comparisons."""
    names = {} if names is None else names
    value = state
    for part in path:
        if isinstance(value, Mapping):
            try:
                found = value.get(part)
            except TypeError:  # a mapping whose keys cannot be compared with the part
                found = None
            if found is None:
                if id(value) not in names:
                    index: dict[str, Any] = {}
                    for k, v in value.items():
                        index.setdefault(str(k), v)
                    names[id(value)] = (value, index)  # the mapping kept: its id stays its
                found = names[id(value)][1].get(str(part))
            value = found
        elif isinstance(value, (list, tuple)) and type(part) is int and 0 <= part < len(value):
            value = value[part]
        else:
            return None
    return value


def check_paths(paths: Mapping[str, Any], where: str, keys: Iterable[str] = ()) -> None:
    """Refuse ``planner_data`` paths that are not a key then keys and list indices, that
    nest deeper than :data:`~storage.ops.transport_shape.MAX_NESTING` (a state dict
    nests a handful of levels; building and flattening a deeper one recurses past
    Python's limit), whose indices would build lists of more than
    :data:`MAX_OBJECT_BYTES` slots in all (a sent list's length is bounded so: the
    shape item records a byte per element), or that collide: an item's place inside or
    at another's, or a place both a list's and a mapping's (each would fail with a raw
    error, or lose an item without a word). An item of ``keys`` without a path is put
    at its key."""
    longest: dict[tuple[Any, ...], int] = {}
    inner: dict[tuple[Any, ...], bool] = {}  # each container's place: a list's or not
    places: set[tuple[Any, ...]] = set()
    for fqn in [*paths, *(k for k in keys if k not in paths)]:
        path = paths.get(fqn, (fqn,))
        if (
            not isinstance(path, (tuple, list))
            or not 0 < len(path) <= MAX_NESTING
            or not isinstance(path[0], str)
            or not all(
                isinstance(p, str) or (type(p) is int and 0 <= p < MAX_OBJECT_BYTES) for p in path
            )
        ):
            raise UnsafeCheckpointError(
                f"{where}: item {quote(fqn)}: its planner_data path {quote(path)} is not a key "
                f"then at most {MAX_NESTING - 1} keys and list indices below "
                f"{MAX_OBJECT_BYTES}; the metadata is damaged or hostile: send the checkpoint "
                "again"
            )
        place = tuple(path)
        for at in range(1, len(place)):
            listed = type(place[at]) is int
            if place[:at] in places or inner.setdefault(place[:at], listed) != listed:
                raise _colliding(where, fqn, path)
        if place in places or place in inner:
            raise _colliding(where, fqn, path)
        places.add(place)
        for at, part in enumerate(place):
            if type(part) is int:
                prefix = place[:at]
                longest[prefix] = max(longest.get(prefix, 0), part + 1)
    slots = sum(longest.values())
    if slots > MAX_OBJECT_BYTES:
        raise UnsafeCheckpointError(
            f"{where}: the paths of its planner_data build lists of {slots} slots in all, "
            f"more than {MAX_OBJECT_BYTES}; the metadata is damaged or hostile: send the "
            "checkpoint again"
        )


def _colliding(where: str, fqn: str, path: Any) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where}: item {quote(fqn)}: its planner_data path {quote(path)} collides with "
        "another item's (at its place, inside it, or a list's place as a mapping's); the "
        "metadata is damaged or hostile: send the checkpoint again"
    )
