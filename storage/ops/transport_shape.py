"""The containers of a state dict sent through :mod:`storage.ops.transport`, recorded
beside it and rebuilt around what is read back.

DCP's flattening loses keys that are not strings (an optimizer's parameter ids), empty
dicts and lists (its state before the first step), lists of containers and a DTensor's
layout: :func:`record` writes them down as plain data, sent as one more item
(:data:`SHAPE_KEY`); :func:`rebuild` puts the loaded values back in them, checking the
sender's record as it walks it (it is untrusted: bounded in depth, never unfolded
twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from extensions.errors import UnsafeCheckpointError, quote
from storage.ops import transport_dtensor

# The item holding the state dict's container structure (see record).
SHAPE_KEY = "_dcp_storage_transport_shape"
#: The item holding the id of the transport that sent a step (``StorageTransport.sender_id``).
SENDER_KEY = "_dcp_storage_transport_sender"
_PLAIN_KEYS = (str, int, float, bool, type(None))

Shape = tuple[str, list[Any]] | None


def record(value: Any, path: str) -> Shape:
    """What DCP's flattening loses: keys that are not strings (an optimizer's parameter
    ids), empty dicts and lists (its state before the first step), lists of containers,
    a DTensor's layout. ``("d", [(key, shape), ...])`` for a mapping, ``("l", [shape,
    ...])`` for a list DCP walks into, ``("t", layout)`` for a DTensor (sent as its local
    shard, see :mod:`~storage.ops.transport_dtensor`), ``None`` for a value DCP stores
    whole. ``path`` names the value in errors."""
    if isinstance(value, DTensor):
        return ("t", transport_dtensor.describe(value, f"item {quote(path)}"))
    if isinstance(value, Mapping):
        return (
            "d",
            [
                (k if isinstance(k, _PLAIN_KEYS) else str(k), record(v, _join(path, k)))
                for k, v in value.items()
            ],
        )
    if isinstance(value, list) and _walked(value):
        return ("l", [record(v, f"{path}[{i}]") for i, v in enumerate(value)])
    return None


def local(value: Any) -> Any:
    """``value`` with each DTensor :func:`record` walks to replaced by its local shard
    (containers copied, every other value as it is)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, Mapping):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list) and _walked(value):
        return [local(v) for v in value]
    return value


def _walked(values: list[Any]) -> bool:
    # DCP's traverse_state_dict walks into a list holding a tensor, a mapping or such a list.
    return any(
        isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and _walked(v))
        for v in values
    )


#: Deepest nesting of a received shape record (a state dict nests a handful of levels).
MAX_NESTING = 100


def rebuild(
    loaded: Any,
    shape: Shape,
    where: str,
    depth: int = 0,
    seen: set[int] | None = None,
    path: str = "",
    own: Any = None,
) -> Any:
    """``loaded`` in the containers ``shape`` records; the record is the sender's, so
    it is checked as it is walked: a malformed one, one nesting deeper than
    :data:`MAX_NESTING` (each level a recursion here), one that holds a container
    record twice, or a mapping's key that is not one :func:`record` writes (a string,
    number, bool or None), is refused naming ``where``. :func:`record` never shares a
    record, and a shared one (the pickle's memo makes that cheap) would unfold
    exponentially: 4 KiB holding 40 levels of ``("l", [x, x])`` asked for 2**40
    containers, and a key of 30 levels of shared pairs made a string of 2**30 leaves.
    ``path`` names the value in errors (bounded: one long key shared by every level
    must not be copied into each level's path); ``own`` is the value at the same place
    in the receiver's own state, if it gave one (a DTensor is rebuilt on the mesh of its
    own there)."""
    if shape is None:
        return loaded
    seen = set() if seen is None else seen
    if not (
        depth < MAX_NESTING
        and isinstance(shape, tuple)
        and len(shape) == 2
        and shape[0] in ("d", "l", "t")
        and isinstance(shape[1], list)
        and (
            shape[0] != "d"
            or all(
                isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], _PLAIN_KEYS)
                for c in shape[1]
            )
        )
        and id(shape) not in seen
        and id(shape[1]) not in seen
    ):
        raise UnsafeCheckpointError(
            f"{where}: item {SHAPE_KEY!r}, the record of the state dict's containers, is "
            f"malformed, nests deeper than {MAX_NESTING} levels or repeats a container's "
            "record; the checkpoint is damaged or not written by StorageTransport: have the "
            "sender send it again"
        )
    seen.update((id(shape), id(shape[1])))
    kind, children = shape
    if kind == "t":
        return transport_dtensor.rebuild(loaded, children, f"{where}: item {quote(path)}", own)
    if kind == "d":
        found = loaded if isinstance(loaded, Mapping) else {}
        # A value DCP did not store (a DTensor with no shard on this rank, as sent
        # before DTensors travelled as their local shards) stays absent.
        mine = own if isinstance(own, Mapping) else {}
        return {
            k: rebuild(
                found.get(str(k)), child, where, depth + 1, seen, _join(path, k), _get(mine, k)
            )
            for k, child in children
            if child is not None or str(k) in found
        }
    items = loaded if isinstance(loaded, list) else []
    own_items = own if isinstance(own, (list, tuple)) else ()
    return [
        rebuild(
            items[i] if i < len(items) else None,
            c,
            where,
            depth + 1,
            seen,
            f"{path}[{i}]",
            own_items[i] if i < len(own_items) else None,
        )
        for i, c in enumerate(children)
    ]


def _get(mapping: Mapping[Any, Any], key: Any) -> Any:
    try:
        return mapping.get(key)
    except TypeError:  # a key the receiver's mapping cannot hash or compare
        return None


#: Longest path :func:`rebuild` carries for its messages (they quote it bounded anyway).
_PATH_CHARS = 1000


def _join(path: str, key: Any) -> str:
    joined = f"{path}.{str(key)[:_PATH_CHARS]}" if path else str(key)[:_PATH_CHARS]
    return joined if len(joined) <= _PATH_CHARS else joined[: _PATH_CHARS - 3] + "..."
