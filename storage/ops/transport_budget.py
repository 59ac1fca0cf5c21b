"""How much a :class:`~storage.ops.transport.StorageTransport` receive may allocate for
the tensors a sender's metadata claims: its budget, checked from the claims before any
tensor is allocated (:class:`~storage.ops.transport_load.PlainDataPlanner`); the
non-tensor values, whose sizes are known only as they are read, spend what is left.

A claim is already bounded by what its stored bytes could decode to (its codec's
``max_expansion``: zstd's is 32768), but zeros compress about 25,000x: ~6 MB stored
could make the receiver allocate and fill ~150 GB and be killed for memory, the replica
that was healing taken down by a tampered store or a broken peer. So the receive as a
whole is bounded by what the receiver knows:

- ``max_bytes=`` where the caller gives it;
- else, with ``state_dict=`` (the receiver's own state, as torchft's transports pass
  it), :data:`OWN_STATE_MULTIPLE` times the bytes of that state plus
  :data:`SLACK_BYTES`, at most the memory this process may use: a healthy peer's state
  is about as large as ours, and the multiple covers what ours may not hold yet (an
  optimizer's state, made at its first step: Adam's two moments are twice the model; or
  a ``state_dict=`` returning the model alone);
- else the memory this process may use (a receive past it could only end in the
  process being killed): the host's, or its cgroup's memory limit where lower (a
  container's 4 GiB on a 512 GiB host; :func:`storage.checkpoint.cgroups.usable_memory`),
  unbounded where neither can be read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from extensions.errors import UnsafeCheckpointError, quote
from storage.checkpoint.cgroups import usable_memory

#: A receive given the receiver's own state may allocate this many times its bytes ...
OWN_STATE_MULTIPLE = 4
#: ... plus this much (values its own state lacks: RNG states, a data loader's).
SLACK_BYTES = 64 << 20


@dataclass(frozen=True)
class Budget:
    """At most ``limit`` bytes of tensors (``None``: unbounded); ``why`` says where the
    limit comes from, for the refusal."""

    limit: int | None
    why: str


def check_max_bytes(max_bytes: object) -> None:
    if max_bytes is not None and (
        not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
    ):
        raise ValueError(
            "max_bytes must be an int >= 0 (the bytes a receive may allocate for the "
            f"tensors it receives) or None, got {max_bytes!r}"
        )


def budget(max_bytes: int | None, own: Any) -> Budget:
    """The budget of a receive: ``max_bytes`` where given; else from ``own`` (the
    receiver's own state, ``None`` where it gave none), at most the memory this process
    may use; else that memory."""
    if max_bytes is not None:
        return Budget(max_bytes, "max_bytes=")
    memory = usable_memory()
    machine = Budget(memory, "the memory this process may use: the host's, or its cgroup's limit")
    if own is None:
        return machine
    mine = own_bytes(own)
    derived = OWN_STATE_MULTIPLE * mine + SLACK_BYTES
    if memory is not None and memory < derived:
        return machine
    why = f"{OWN_STATE_MULTIPLE} x this worker's own state of {mine} bytes, plus {SLACK_BYTES}"
    return Budget(derived, why)


def own_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (walked through mappings, lists and
    tuples), each memory once (tied weights are one tensor), a ``DTensor`` by its local
    shard (what a sender sends of it) and any other tensor by its shape and dtype (what
    it backs of a claim: a ``ShardedTensor``'s global shape)."""
    total = 0
    seen: set[Any] = set()
    walked: set[int] = set()
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensor = value.to_local() if isinstance(value, DTensor) else value
            key = memory_of(tensor)
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
        elif isinstance(value, (Mapping, list, tuple)) and id(value) not in walked:
            walked.add(id(value))  # a container holding itself is walked once
            stack.extend(value.values() if isinstance(value, Mapping) else value)
    return total


def memory_of(tensor: torch.Tensor) -> Any:
    """What identifies the memory ``tensor`` holds: views starting at the same element
    (the same tensor at two places, a second view of it, its transpose) are one; a
    tensor without storage (a meta tensor, a sparse one) is its own."""
    try:
        pointer = 0 if tensor.device.type == "meta" else tensor.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage: sparse, or a subclass
        pointer = 0
    return id(tensor) if pointer == 0 else (tensor.device, pointer)


def over_budget(
    where: str,
    sender: str,
    fqn: str,
    item: int,
    total: int,
    budget: Budget,
    *,
    value: bool = False,
) -> UnsafeCheckpointError:
    """The refusal of item ``fqn`` (``item`` bytes), which brings the bytes of tensors
    the sender's metadata claims (and, for a ``value``, of the values read so far) to
    ``total``, past ``budget``."""
    if value:
        what = (
            f"{sender}'s tensors and the values read so far come to {total} bytes with this "
            f"value ({item} bytes), past this receive's budget of {budget.limit} bytes "
            f"({budget.why}): the receive stopped here"
        )
    else:
        what = (
            f"{sender}'s metadata claims {total} bytes of tensors up to this one ({item} "
            f"bytes), past this receive's budget of {budget.limit} bytes ({budget.why}): "
            "nothing was allocated"
        )
    return UnsafeCheckpointError(
        f"{where}: item {quote(fqn)}: {what}. The sender's metadata is damaged or "
        "hostile (a compression bomb decodes far past a healthy state's size), or the "
        "sender's state is that much larger than this worker's: if it is, pass max_bytes= "
        "to the transport (the bytes a receive may allocate for what it receives) to raise "
        "the budget"
    )
