"""A nested checkpoint dict as DCP items: every tensor its own item, the rest one item.

Frameworks hand over dicts that DCP's own flattening cannot carry back unchanged (an
optimizer's ``state`` is keyed by ints, which DCP turns into strings, and a load needs a
target of the same shape). :func:`pack` lifts each plain tensor out of the dicts and
lists it finds into a flat ``{name: tensor}`` map, so tensors are stored, checksummed,
transformed and read like any DCP item, and records the rest (the tree with the tensors
taken out, and where each belongs) as one ``torch.save`` blob under ``prefix``.
:func:`unpack` puts them back; the blob is unpickled by ``torch.load`` with the
caller's ``weights_only``, exactly as a framework's own ``torch.load`` of the file would.

Containers other than ``dict``, ``OrderedDict`` and ``list`` (tuples, a framework's own
dict classes) and tensors of other kinds (parameters, subclasses, sparse) stay inside
the blob as they are: correct, just not items of their own.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from extensions.errors import UnsafeCheckpointError, quote
from storage.checkpoint.archives import check_archive
from storage.checkpoint.decode import refused_pickle

_FORMAT = 1
Path = tuple[str | int, ...]


def pack(tree: Any, prefix: str) -> dict[str, torch.Tensor]:
    """``tree`` as DCP items: ``prefix`` (the blob) and ``prefix/<path>`` (each tensor)."""
    tensors: dict[str, torch.Tensor] = {}
    slots: list[tuple[str, Path]] = []

    def lift(node: Any, path: Path) -> Any:
        if type(node) is torch.Tensor and node.layout == torch.strided:
            name = f"{prefix}/" + "/".join(str(p) for p in path)
            while name in tensors:  # {"a/b": x} and {"a": {"b": y}} name the same path
                name += "+"
            tensors[name] = node
            slots.append((name, path))
            return None
        if type(node) in (dict, collections.OrderedDict):
            return type(node)(
                (k, lift(v, (*path, k)) if _plain_key(k) else v) for k, v in node.items()
            )
        if type(node) is list:
            return [lift(v, (*path, i)) for i, v in enumerate(node)]
        return node

    skeleton = lift(tree, ())
    blob = io.BytesIO()
    torch.save({"format": _FORMAT, "tree": skeleton, "slots": slots}, blob)
    tensors[prefix] = torch.frombuffer(bytearray(blob.getbuffer()), dtype=torch.uint8)
    return tensors


def item_names(names: list[str], prefix: str) -> list[str]:
    """Of a checkpoint's item names, those :func:`pack` wrote under ``prefix``."""
    return [n for n in names if n == prefix or n.startswith(prefix + "/")]


def unpack(
    items: Mapping[str, torch.Tensor],
    prefix: str,
    *,
    where: str,
    weights_only: bool | None = None,
    map_location: Any = None,
) -> Any:
    """The tree :func:`pack` stored under ``prefix``, from its loaded ``items``.

    ``where`` (the checkpoint's URL) names the checkpoint in errors. Raises
    :class:`UnsafeCheckpointError` when the blob holds what ``weights_only`` refuses
    (``storage.checkpoint.decode.refused_pickle``) or does not say where a stored tensor
    goes."""
    blob = items[prefix].numpy().tobytes()
    check_archive(blob, f"{where}: item {quote(prefix)}")
    try:
        record = torch.load(io.BytesIO(blob), weights_only=weights_only, map_location=map_location)
    except pickle.UnpicklingError as exc:
        raise refused_pickle(f"{where}: item {quote(prefix)}", exc) from None
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise UnsafeCheckpointError(
            f"{where}: item {prefix!r} is not a checkpoint tree of format {_FORMAT} "
            f"(found {quote(record)}); was it saved by dcp-storage's integration?"
        )
    tree = record["tree"]
    for slot in record["slots"]:
        try:
            name, path = slot
            tensor = items[name]
            if isinstance(map_location, (str, torch.device)):
                tensor = tensor.to(map_location)
            node = tree
            for step in path[:-1]:
                node = node[step]
            if node[path[-1]] is not None:
                raise ValueError("the place is taken")
            node[path[-1]] = tensor
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise UnsafeCheckpointError(
                f"{where}: item {prefix!r} places a tensor where the tree has no room "
                f"({quote(slot)}: {exc}); the checkpoint is damaged or was edited"
            ) from None
    return tree


def _plain_key(key: object) -> bool:
    return type(key) in (str, int)
