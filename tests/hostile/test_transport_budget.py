"""A recovery transport's sender claiming tensors its compressed bytes could decode to
but the receiver has no room for: a compression bomb inside its codec's bound.

zstd's bound (32768 plain bytes per stored byte) refuses a claim no stored byte could
fill, but zeros compress ~25,000x: ~6 MB stored made a receiver allocate and fill
~150 GB and be killed for memory, the replica that was healing taken down by the peer
it healed from. The receive has a budget, checked from the metadata's claims before
anything is allocated: with ``state_dict=``, a multiple of this worker's own state (a
healthy peer's is about as large) plus a slack; without it, the memory this process may
use (its cgroup's limit, where lower than the host's); ``max_bytes=`` sets it
explicitly.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions import ZStandard
from extensions.errors import UnsafeCheckpointError
from extensions.zstd import MAX_EXPANSION

WAIT = timedelta(seconds=30)


def _bomb(root: Path, length: int | None = None) -> tuple[storage.StorageTransport, int]:
    """A sender of item ``w`` through zstd, whose metadata then claims as many float32
    elements as its stored bytes (``length`` where given, else the real ones) could
    decode to at zstd's best: within the codec's bound. Returns the claimed bytes."""
    sender = storage.StorageTransport(str(root), rank=0, transforms=[ZStandard()])
    # 4096 random floats: ~16 KB stored, enough to claim ~500 MiB within the bound.
    state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0))}
    sender.send_checkpoint([1], 1, state, timedelta(seconds=60))
    path = root / "replica-0" / "step-1" / ".metadata"
    metadata: Any = pickle.loads(path.read_bytes())  # the test's own file
    entry = metadata.state_dict_metadata["w"]
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "w")
    if length is not None:
        info.length = length
    elements = info.length * MAX_EXPANSION // 4
    entry.size = entry.chunks[0].sizes = torch.Size([elements])
    path.write_bytes(pickle.dumps(metadata))
    return sender, elements * 4


def test_a_bomb_past_the_receivers_own_state_is_refused_before_allocating(
    tmp_path: Path,
) -> None:
    # ~16 KB stored claims ~500 MiB; this worker's own state is 16 bytes, so its budget
    # is 4 x 16 bytes + 64 MiB. Before, the claim was believed (its chunk covers it and
    # zstd could decode that far) and ~500 MiB allocated for a tensor a healthy peer,
    # whose state is about the size of ours, never sends.
    sender, claimed = _bomb(tmp_path)
    assert claimed > 256 << 20
    own = {"w": torch.zeros(4), "b": torch.zeros(0)}
    receiver = storage.StorageTransport(str(tmp_path), rank=1, state_dict=lambda: own)
    budget = 4 * 16 + (64 << 20)
    with pytest.raises(
        UnsafeCheckpointError,
        match=rf"step-1: item 'w': replica 0's metadata claims {claimed} bytes of tensors up "
        rf"to this one \({claimed} bytes\), past this receive's budget of {budget} bytes "
        r"\(4 x this worker's own state of 16 bytes, plus 67108864\): nothing was allocated"
        r".*pass max_bytes=",
    ):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


def test_an_explicit_budget_bounds_a_receive_without_its_own_state(tmp_path: Path) -> None:
    sender, claimed = _bomb(tmp_path)
    receiver = storage.StorageTransport(str(tmp_path), rank=1, max_bytes=1 << 20)
    with pytest.raises(
        UnsafeCheckpointError,
        match=rf"item 'w'.*claims {claimed} bytes of tensors up to this one .*, past this "
        r"receive's budget of 1048576 bytes \(max_bytes=\)",
    ):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


def test_without_its_own_state_a_receive_is_bounded_by_this_machines_memory(
    tmp_path: Path,
) -> None:
    # A stored length of 2**32 bytes (forged: nothing is read before the refusal) lets
    # zstd's bound believe 128 TiB, more than any machine here holds. Before, the
    # receiver asked the allocator for it (a MemoryError, or 128 TiB reserved where
    # the machine overcommits).
    sender, claimed = _bomb(tmp_path, length=1 << 32)
    receiver = storage.StorageTransport(str(tmp_path), rank=1)
    with pytest.raises(
        UnsafeCheckpointError,
        match=rf"item 'w'.*claims {claimed} bytes of tensors up to this one .*, past this "
        r"receive's budget of \d+ bytes \(the memory this process may use",
    ):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


def test_tensors_backed_by_the_receivers_own_count_their_real_size(tmp_path: Path) -> None:
    # A healthy send of the receiver's own state, a tensor of it sent only in part (a
    # sharded tensor's own shards) included: its tensors count 96 bytes (the partly
    # sent one its real 64), so a budget one byte short refuses it naming the item that
    # crossed it, before anything is allocated; one with room for them and for the
    # values (the transport's shape record and sender id, ~1.3 KB) receives it.
    sender = storage.StorageTransport(str(tmp_path), rank=0)
    sender.send_checkpoint([1], 1, {"a": torch.ones(8), "b": torch.ones(4)}, WAIT)
    path = tmp_path / "replica-0" / "step-1" / ".metadata"
    metadata: Any = pickle.loads(path.read_bytes())  # the test's own file
    metadata.state_dict_metadata["b"].size = torch.Size([16])  # stored: 4 of 16
    path.write_bytes(pickle.dumps(metadata))
    own = {"a": torch.zeros(8), "b": torch.zeros(16)}
    fits = storage.StorageTransport(
        str(tmp_path), rank=1, state_dict=lambda: own, max_bytes=96 + 4096
    )
    got = fits.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    assert int(got["b"].sum()) == 4 and got["b"].numel() == 16
    short = storage.StorageTransport(str(tmp_path), rank=2, state_dict=lambda: own, max_bytes=95)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"item 'b'.*claims 96 bytes of tensors up to this one \(64 bytes\)",
    ):
        short.recv_checkpoint(0, sender.metadata(), 1, WAIT)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_bytes_must_be_a_count_of_bytes(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        storage.StorageTransport(str(tmp_path), rank=0, max_bytes=bad)


def test_values_spend_what_the_tensors_left_of_the_budget(tmp_path: Path) -> None:
    # Each non-tensor value is bounded as it is read (max_object_bytes, 16 MiB), but not
    # their sum: thousands of zstd'd 16 MiB strings (~600 bytes stored each) filled the
    # receiver's memory one bounded value at a time. Here two 600 KB strings against a
    # budget of 1 MiB: the second, read, crosses it and stops the receive.
    sender = storage.StorageTransport(str(tmp_path), rank=0, transforms=[ZStandard()])
    state = {"t": torch.ones(4), "a": "x" * 600_000, "b": "y" * 600_000}
    sender.send_checkpoint([1], 1, state, WAIT)
    receiver = storage.StorageTransport(str(tmp_path), rank=1, max_bytes=1 << 20)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"item '[ab]': replica 0's tensors and the values read so far come to \d+ "
        r"bytes with this value \(\d+ bytes\), past this receive's budget of 1048576 bytes "
        r"\(max_bytes=\): the receive stopped here",
    ):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    roomy = storage.StorageTransport(str(tmp_path), rank=2, max_bytes=2 << 20)
    got = roomy.recv_checkpoint(0, sender.metadata(), 1, WAIT)
    assert got["a"] == "x" * 600_000 and got["b"] == "y" * 600_000


def test_a_receivers_own_tensor_without_storage_is_counted_by_its_shape(tmp_path: Path) -> None:
    # Sizing the budget walks every tensor of the receiver's own state: a sparse one
    # (no data pointer to tell its memory by) made the walk raise torch's "Cannot access
    # data pointer", and no receive given that state could heal.
    sender = storage.StorageTransport(str(tmp_path), rank=0)
    sender.send_checkpoint([1], 1, {"w": torch.ones(4)}, WAIT)
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (8,))
    own = {"w": torch.zeros(4), "s": sparse, "m": torch.empty(2, device="meta")}
    receiver = storage.StorageTransport(str(tmp_path), rank=1, state_dict=lambda: own)
    assert torch.equal(receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)["w"], torch.ones(4))
