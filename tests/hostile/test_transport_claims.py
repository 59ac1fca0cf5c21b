"""A recovery transport's sender claiming a tensor larger than its chunks hold, leaning
on the receiver's own state (``state_dict=``) to be believed.

The receiver allocates a claimed size its stored chunks do not hold only where its own
state has a tensor of that size at the same place (a sender of a tensor sharded over
ranks stores only its own shards). So the claim is bounded by memory the receiver
already holds: the claim must match that tensor in dtype as well as shape, a
DTensor of its own, which travels as its local shard, bounds the claim by that shard,
never by the global shape the other ranks hold the rest of, and one tensor backs one
claim, wherever else the receiver's state holds it. Finding that tensor costs a
look-up per item, however many items and keys.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

import storage
from extensions._compat import mesh_without_groups
from extensions.errors import IntegrityError, UnsafeCheckpointError

WAIT = timedelta(seconds=30)


def _send(root: Path, state: dict[str, Any]) -> tuple[storage.StorageTransport, Path, Any]:
    sender = storage.StorageTransport(str(root), rank=0)
    sender.send_checkpoint([1], 1, state, timedelta(seconds=60))
    path = root / "replica-0" / "step-1" / ".metadata"
    return sender, path, pickle.loads(path.read_bytes())  # the test's own file


def _claim(path: Path, metadata: Any, fqn: str, size: int, dtype: torch.dtype) -> None:
    """Rewrite item ``fqn`` of the sent ``metadata`` to claim a 1-D ``dtype`` tensor of
    ``size`` elements, its stored chunks unchanged."""
    md = metadata.state_dict_metadata[fqn]
    props = TensorProperties(dtype=dtype)
    metadata.state_dict_metadata[fqn] = TensorStorageMetadata(props, torch.Size([size]), md.chunks)
    path.write_bytes(pickle.dumps(metadata))


def test_a_claim_of_the_receivers_shape_in_a_wider_dtype_is_refused(tmp_path: Path) -> None:
    # The sender stores 4 bytes of a tensor it claims is a 64-element complex128 (1 KiB)
    # where the receiver's own state has a 64-element bool mask (64 bytes). Before, the
    # shape alone was compared: the receiver allocated 16 times its own tensor's memory
    # (a 1 GiB mask claimed as complex128: 16 GiB) and handed back a tensor of the
    # sender's dtype.
    sender, path, metadata = _send(tmp_path, {"mask": torch.ones(4, dtype=torch.bool)})
    _claim(path, metadata, "mask", 64, torch.complex128)
    receiver = storage.StorageTransport(
        str(tmp_path), rank=1, state_dict=lambda: {"mask": torch.zeros(64, dtype=torch.bool)}
    )
    with pytest.raises(IntegrityError, match=r"'mask'.*\(64\) complex128 tensor \(1024 bytes\)"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    _claim(path, metadata, "mask", 64, torch.bool)  # the receiver's own dtype: believed
    got = receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    assert got["mask"].dtype == torch.bool and int(got["mask"].sum()) == 4


def test_a_dtensors_shard_claimed_at_its_global_shape_is_refused(
    tmp_path: Path, one_rank_group: None
) -> None:
    # A DTensor travels as its local shard: here 4 of the 64 elements of a tensor
    # sharded over 16 ranks. The sender claims the shard's item is the whole 64-element
    # tensor; before, the receiver's own DTensor, of that global shape, made the claim
    # believed: it allocated the whole tensor on every rank (16 times its shard; on a
    # 1024-rank mesh, 1024 times) and rebuilt a DTensor whose local shard was that.
    mesh = mesh_without_groups("cpu", list(range(16)), None)

    def sharded(local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(64,), stride=(1,)
        )

    sender, path, metadata = _send(tmp_path, {"w": sharded(torch.ones(4))})
    assert tuple(metadata.state_dict_metadata["w"].size) == (4,)  # sent as its shard
    own = {"w": sharded(torch.zeros(4))}
    receiver = storage.StorageTransport(str(tmp_path), rank=1, state_dict=lambda: own)
    _claim(path, metadata, "w", 64, torch.float32)
    with pytest.raises(IntegrityError, match=r"'w'.*\(64\) float32 tensor .* hold 4 of its 64"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


class _Key:
    """A key of the receiver's own mapping that counts how often it is made a string."""

    made = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __str__(self) -> str:
        _Key.made += 1
        return str(self.n)


def test_paths_into_the_receivers_own_mapping_index_it_once(tmp_path: Path) -> None:
    # 500 items the sender claims are twice what it stores, each believed for the
    # receiver's own tensor of that shape, found by its path into the receiver's own
    # mapping, whose keys match the paths' parts only as strings (an optimizer's
    # parameter ids; or a hostile sender's parts). Before, each path walked the mapping
    # comparing strings: 500 items cost 125,000 (a sender of 100,000 items into a
    # mapping of 10,000: a billion, minutes before a byte was read); now each key once.
    n = 500
    sender, path, metadata = _send(tmp_path, {"state": {i: torch.ones(1) for i in range(n)}})
    for i in range(n):
        md = metadata.state_dict_metadata[f"state.{i}"]
        md.size = torch.Size([2])
    path.write_bytes(pickle.dumps(metadata))
    own = {"state": {_Key(i): torch.zeros(2) for i in range(n)}}
    receiver = storage.StorageTransport(str(tmp_path), rank=1, state_dict=lambda: own)
    _Key.made = 0
    got = receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    assert _Key.made <= n
    assert all(torch.equal(got["state"][i], torch.tensor([1.0, 0.0])) for i in range(n))


@pytest.mark.parametrize("shape", [(1000,), (3,), (2, 2)])
def test_a_shard_of_another_shape_than_its_layout_gives_is_refused(
    tmp_path: Path, one_rank_group: None, shape: tuple[int, ...]
) -> None:
    # The sender's layout record says rank 0 of 16 holds 4 elements of a 64-element
    # tensor sharded on dim 0; the shard it sends has another shape. Before, the
    # receiver wrapped it as given: a DTensor whose local tensor disagrees with its spec
    # (ops on it read past a shard too small, or leave the rest of one too large unused)
    # and no error.
    mesh = mesh_without_groups("cpu", list(range(16)), None)
    lying = DTensor.from_local(
        torch.ones(shape), mesh, [Shard(0)], run_check=False, shape=(64,), stride=(1,)
    )
    sender, _, _ = _send(tmp_path, {"w": lying})
    receiver = storage.StorageTransport(str(tmp_path), rank=1)
    with pytest.raises(UnsafeCheckpointError, match=r"'w'.*shard here has shape.*shape \[4\]"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


@pytest.mark.parametrize("alias", ["same", "view"])
def test_one_tensor_of_the_receivers_backs_one_claim(tmp_path: Path, alias: str) -> None:
    # The receiver's own state holds one tensor at two places (tied weights: the
    # embedding and the output layer; or the same memory through a second view). The
    # sender stores 4 elements under each place and claims both are 2**20-element
    # tensors. Before, each claim was believed for that one tensor: the receiver
    # allocated (and zero-filled) it twice, and N places sharing it, N times.
    n = 1 << 20
    sender, path, metadata = _send(tmp_path, {"embed": torch.ones(4), "head": torch.ones(4)})
    _claim(path, metadata, "embed", n, torch.float32)
    _claim(path, metadata, "head", n, torch.float32)
    tied = torch.zeros(n)
    own = {"embed": tied, "head": tied if alias == "same" else tied[:]}
    receiver = storage.StorageTransport(str(tmp_path), rank=1, state_dict=lambda: own)
    with pytest.raises(IntegrityError, match=r"'head'.*already backs item 'embed'"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    # Each place its own tensor: both believed.
    own["head"] = torch.zeros(n)
    got = receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    assert int(got["embed"].sum()) == int(got["head"].sum()) == 4
