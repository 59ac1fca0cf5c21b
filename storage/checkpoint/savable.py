"""What no DCP checkpoint can hold, refused up front with the item and the fix.

Stock DCP fails on these too, but deep inside (``unsupported memory format option``,
``Cannot copy out of meta tensor``, a pickler's ``Can't pickle <function>``), naming
neither the item nor what to do. Every save path of ours meets its data in one of two
places, and both check here: the writes, where the planner resolves each item
(:func:`resolve`), and an asynchronous save's staging, which copies the state dict before
any item exists (:func:`check_state_dict`). Both raise :class:`TypeError`.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from extensions.errors import quote
from storage.checkpoint import storage_format as fmt

# What pickling a value that cannot be pickled raises: a lambda or a class that
# cannot be found again (PicklingError, or AttributeError for a local object), an
# open file, lock or socket (TypeError).
_PICKLE_FAILURES = (pickle.PicklingError, AttributeError, TypeError)


def unsavable(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s values cannot be stored in a DCP item, and the fix; ``None``
    where they can."""
    if tensor.layout != torch.strided:
        return (
            f"is a {str(tensor.layout).removeprefix('torch.')} tensor, and DCP stores "
            "dense tensors only: save tensor.to_dense() (and load into a dense tensor)"
        )
    if tensor.device.type == "meta":
        return (
            "is on the meta device and holds no values: materialize it before saving "
            "(module.to_empty(device=...) and initialize it, or load its values first)"
        )
    return None


def _refuse(url: str, label: str, why: str) -> TypeError:
    return TypeError(f"{url}: item {quote(label)} cannot be saved: it {why}")


def check_state_dict(state_dict: Any, url: str) -> None:
    """Refuse the first tensor of ``state_dict`` that :func:`unsavable` refuses, named as
    DCP flattens it, before an asynchronous save stages it. The walk is DCP's: into
    mappings and lists, never into tuples or other values (DCP pickles those whole)."""

    def walk(path: tuple[object, ...], value: object) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk((*path, key), inner)
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk((*path, index), inner)
        elif isinstance(value, torch.Tensor):
            why = unsavable(value)
            if why is not None:
                raise _refuse(url, ".".join(map(str, path)), why)

    walk((), state_dict)


def resolve(planner: SavePlanner, item: WriteItem, url: str) -> Any:
    """``planner.resolve_data(item)``, with a tensor that :func:`unsavable` refuses, or a
    value that does not pickle, refused naming the item (of the checkpoint at ``url``)."""
    label = fmt.item_label(item.index)
    try:
        data = planner.resolve_data(item)
    except _PICKLE_FAILURES as exc:
        if item.type != WriteItemType.BYTE_IO:
            raise
        raise _refuse(
            url,
            label,
            f"does not pickle ({type(exc).__name__}: {exc}); DCP stores a non-tensor "
            "value with torch.save: keep only picklable values in the state dict (no "
            "lambdas, local classes, open files or locks) or leave this one out",
        ) from exc
    if isinstance(data, torch.Tensor):
        why = unsavable(data)
        if why is not None:
            raise _refuse(url, label, why)
    return data
