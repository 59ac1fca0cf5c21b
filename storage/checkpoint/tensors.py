"""Tensors as the read path meets them: a target checked against the stored chunk
before any byte is read, one allocated for a stored tensor only once its claim is
checked, and a tensor's memory as writable bytes; and the raw memory of a plain tensor,
copied from or into in one call (many small items cost their per-item calls, not bytes).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from extensions.errors import IntegrityError, printable, quote
from extensions.registry import ExtensionRegistry
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.coverage import stored_elements


def check_shapes(
    req: ReadItem, target: torch.Tensor, chunk: tuple[torch.Size, Any] | None, where: str
) -> None:
    """A target that does not fit the stored chunk is the caller's mismatch (a
    ``ValueError``, as torch's planner says), found before any byte is read; so is one
    no load can fill (:func:`check_writable`)."""
    check_writable(target, where)
    requested, offsets = tuple(req.lengths), tuple(req.storage_offsets)
    stored = tuple(chunk[0]) if chunk is not None else None
    if tuple(target.size()) != requested or (
        stored is not None
        and not (
            len(offsets) == len(requested) == len(stored)
            and all(o >= 0 and o + n <= s for o, n, s in zip(offsets, requested, stored))
        )
    ):
        raise ValueError(
            f"{where}: size mismatch: the target has shape {tuple(target.size())}, the "
            f"stored chunk {stored if stored is not None else '(unknown)'} (region at "
            f"{offsets} of sizes {requested}); load into a state dict shaped like the "
            "checkpoint (dcp-storage inspect lists its shapes)"
        )


def check_writable(target: torch.Tensor, where: str) -> None:
    """Refuse a load target whose elements share memory (an expanded view: stride 0
    along a dimension of more than one element), which torch's copy into it would refuse
    with no item named, before any byte is read."""
    for dim, (size, stride) in enumerate(zip(target.shape, target.stride(), strict=True)):
        if stride == 0 and size > 1:
            raise ValueError(
                f"{where}: the target is an expanded view (stride 0 along dimension {dim} "
                f"of shape {tuple(target.shape)}): its elements share memory, so no load "
                "can fill it; load into a tensor with memory of its own (target.clone(), "
                "or torch.empty of its shape) and assign that back"
            )


def holds_its_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory, as :func:`tensor_bytes` gives it, is its values: a
    contiguous CPU tensor that is no lazy conjugate or negative view (``x.conj()``, whose
    bytes are ``x``'s, resolved only by torch's ops), so bytes can be decoded into it."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def has_plain_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values are the ``numel * element_size`` bytes at its data
    pointer: :func:`holds_its_bytes`, and no subclass (whose pointer need not be its
    values), no other layout (MKL-DNN has no pointer to give) and no ZeroTensor (whose
    pointer is null)."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor._is_zerotensor()
        and holds_its_bytes(tensor)
    )


def copy_of_memory(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor that :func:`has_plain_memory` (checked by the caller),
    copied in one call."""
    nbytes = tensor.numel() * tensor.element_size()
    return ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""


def copy_into_memory(tensor: torch.Tensor, source: memoryview) -> None:
    """Copy ``source`` (writable; exactly the tensor's bytes) into a tensor that
    :func:`has_plain_memory` (checked by the caller), in one call."""
    if len(source):
        address = ctypes.addressof(ctypes.c_char.from_buffer(source))
        ctypes.memmove(tensor.data_ptr(), address, len(source))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` tensor over a contiguous tensor's memory (no copy; CPU or not)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # A lone element keeps any stride and is still contiguous (0 for
        # ``torch.tensor(1.0).expand(1)``, 2 for ``torch.arange(3.0)[1::2]``): a dtype
        # view needs a stride of 1.
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    return flat_bytes(tensor).numpy().data.cast("B")


@functools.lru_cache(maxsize=256)
def _expansion(descriptors: tuple[str, ...]) -> int | None:
    # Once per chain: a registry is built per call, and a load or an export meets a few
    # chains over thousands of items. A name registered later, unknown when first met,
    # only stays unchecked (no class replaces a registered one).
    return ExtensionRegistry().max_expansion(descriptors)


def unbacked_claim(record: fmt.StoredItem, elements: int) -> str | None:
    """Why a chunk of ``elements`` elements stored as ``record`` cannot be what its
    stored bytes hold (``None`` when it can be): at least a byte per element decoded,
    and at most the chain's ``max_expansion`` plain bytes per stored byte (one for no
    transform). A chain whose bound is unknown (a user's transform offering none) is
    not checked here. Every reader that allocates a tensor at a chunk's claimed size
    asks this first."""
    ratio = _expansion(record.descriptors) if record.descriptors else 1
    if ratio is None or elements <= record.length * ratio:
        return None
    if not record.descriptors:
        how = "untransformed"
    else:
        chain = quote(list(record.descriptors))
        how = f"through {chain}, which decode to at most {record.length * ratio} bytes"
    return (
        f"claims {elements} elements but stores {record.length} bytes, {how}; its "
        "metadata is damaged or forged: nothing was allocated for it"
    )


def empty_stored(
    metadata: Metadata, fqn: str, checkpoint: str, *, whole: bool = True
) -> torch.Tensor:
    """A CPU tensor for the stored tensor ``fqn``, allocated once its claim is checked
    (:func:`stored_allocator`)."""
    return stored_allocator(metadata, fqn, checkpoint, whole=whole)()


def stored_allocator(
    metadata: Metadata, fqn: str, checkpoint: str, *, whole: bool = True
) -> Callable[[], torch.Tensor]:
    """Check the stored tensor ``fqn``'s claim, then return what allocates it: a
    caller that bounds a load's claims in all checks each before allocating any.

    It allocates a CPU tensor shaped and typed as the stored tensor ``fqn``, for loading
    it whole where no caller gave one (export, the Lightning integration, the recovery
    transport's receiver, which bounds its claims in all). Its size is the
    checkpoint's claim: a chunk claiming more elements than its stored bytes could
    decode to (:func:`unbacked_claim`: a byte per element untransformed, its codec's
    bound compressed) is refused before anything is allocated; an allocation that
    fails names the item.

    Where the stored chunks leave part of it unread, the tensor is zeroed: that part
    must not be whatever the allocator handed out (this process's old memory, which an
    export would publish). Where they hold every element, a load of it writes each one
    (or fails), so it is left untouched: its memory is touched only as decoded bytes
    arrive, which the stored bytes bound. ``whole``: the chunks must hold every element,
    else the tensor is refused naming the item (what they leave out has no stored
    value)."""
    meta: Any = metadata.state_dict_metadata[fqn]
    covered = stored_elements(meta)
    if whole and covered != math.prod(meta.size):
        held = "an uncountable part" if covered is None else covered
        raise IntegrityError(
            f"{checkpoint}: item {quote(fqn)} is a {quote(tuple(meta.size))} tensor but its "
            f"{len(meta.chunks)} stored chunks hold {held} of its "
            f"{math.prod(meta.size)} elements; its metadata is incomplete or damaged (a "
            "rank's part missing, or chunks overlapping as no torch save makes): nothing "
            "was read. Restore the checkpoint from a good copy"
        )
    for chunk in meta.chunks:
        index = MetadataIndex(fqn, chunk.offsets)
        info = (metadata.storage_data or {}).get(index)
        if info is None:
            continue
        problem = unbacked_claim(fmt.stored_item(info), math.prod(chunk.sizes))
        if problem is not None:
            raise IntegrityError(
                f"{checkpoint}: item {quote(fmt.item_label(index))} {problem}. Restore the "
                "checkpoint from a good copy"
            )
    size, dtype = torch.Size(meta.size), meta.properties.dtype
    empty = torch.empty if covered == math.prod(size) else torch.zeros

    def allocate() -> torch.Tensor:
        try:
            return empty(size, dtype=dtype)
        except (RuntimeError, MemoryError) as exc:
            raise MemoryError(
                f"{checkpoint}: item {quote(fqn)} is a {tuple(size)} {dtype} tensor, more "
                f"than this machine can allocate ({printable(str(exc), 200)}); load it where "
                "there is more memory, or leave it out"
            ) from None

    return allocate
