"""The deep copy every asynchronous save stages with: torch's ``StateDictStager`` (it
keeps DTensors and other objects intact, and its buffers can be kept between saves),
staging each tensor's values.

torch's copy takes a tensor's storage, offset, size and strides and drops its lazy
conjugate and negative bits (``x.conj()``, ``x.conj().imag``: views whose values are
only resolved by torch's ops), so the staged tensor would hold the unconjugated
values and the checkpoint the wrong numbers. :class:`ValueStager` stages such a tensor
as its resolved values instead (a copy made at the save: such views are rare in a
state dict). And where torch's cache of buffers (kept between saves) holds one for a
storage resized in place since (``tensor.resize_``), torch refuses the stage with an
``AssertionError``; this stager makes that storage a new buffer.

Pinning (``pin_memory``) applies to the buffers of CUDA storages only, each pinned in
the context of its storage's device. torch pins every buffer, in the current device's
context: a buffer of a CPU tensor gains nothing from it (nothing copies it to or from a
device) and locked host memory for nothing, and a process whose tensors live on another
device than its current one, or on none, made a CUDA context there (hundreds of MB of
that device's memory, in every process of the host). ``None`` where torch has no
``StateDictStager`` (2.7)."""

from __future__ import annotations

from typing import Any

import torch

from extensions._compat import StateDictStager


class _ValueStager(StateDictStager or object):  # type: ignore[misc]
    pin_memory: bool  # torch's: whether it pins the buffers it makes

    def _offload_tensor(self, x: Any, memo: dict[int, Any], non_blocking: bool = False) -> Any:
        if not (x.is_conj() or x.is_neg()):
            return super()._offload_tensor(x, memo, non_blocking)  # type: ignore[misc]
        # Resolved in CPU memory: the stage copies from there before it returns, where a
        # device temporary could be freed (and its memory reused) while a non-blocking
        # copy from it on a side stream was still in flight.
        values = x.cpu().resolve_conj().resolve_neg()
        # Alive as long as the memo: it is keyed by the ids of the objects it copied.
        memo.setdefault(id(memo), []).append(values)
        staged = super()._offload_tensor(values, memo, non_blocking)  # type: ignore[misc]
        memo[id(x)] = staged
        return staged

    def _stage_untyped_storage(self, storage: Any, non_blocking: bool = False) -> Any:
        cache = getattr(self, "_cached_storage_mapping", None)
        kept = None if cache is None else cache.get(storage)
        if kept is not None and kept.nbytes() != storage.nbytes():
            del cache[storage]  # type: ignore[union-attr]  # resized in place since
        if storage.device.type == "cuda":
            with torch.cuda.device(storage.device):
                return super()._stage_untyped_storage(storage, non_blocking)  # type: ignore[misc]
        pin, self.pin_memory = self.pin_memory, False  # a copy from CPU: never pinned
        try:
            return super()._stage_untyped_storage(storage, non_blocking)  # type: ignore[misc]
        finally:
            self.pin_memory = pin


ValueStager: type[Any] | None = _ValueStager if StateDictStager is not None else None
