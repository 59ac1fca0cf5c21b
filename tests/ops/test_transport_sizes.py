"""The sizes a received checkpoint's metadata claims, against what the receiver
allocates: a sender's metadata is untrusted, so a tensor's claimed global size must be
what its stored chunks hold or what the receiver's own state says, and the memory a
claim makes the receiver touch is bounded by the bytes that decode."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.zstd import ZStandard
from tests.ops.test_transport import _sent_metadata


def _claiming(metadata: Any, size: int) -> None:
    """``model.w`` (4 elements, stored whole) claimed to be a tensor of ``size``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = metadata.state_dict_metadata["model.w"]
    metadata.state_dict_metadata["model.w"] = TensorStorageMetadata(
        md.properties, torch.Size([size]), md.chunks
    )


def test_a_tensor_claiming_a_global_size_its_chunks_do_not_hold_is_refused(
    tmp_path: Path,
) -> None:
    """The receiver allocates a tensor at the global size the sender claims: a
    4-element chunk of a tensor claimed to hold 2**40 elements made it ask for 4 TiB
    (torch's MemoryError; a smaller claim was allocated and zeroed, page by page)."""
    import pickle

    from extensions.errors import IntegrityError

    transport, path, metadata = _sent_metadata(tmp_path)
    _claiming(metadata, 1 << 40)
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(IntegrityError) as info:
        transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))
    message = str(info.value)
    assert "item 'model.w': replica 0's metadata claims a (1099511627776) float32 tensor" in message
    assert "(4398046511104 bytes) but its stored chunks hold 4 of its" in message
    assert "pass state_dict= to the transport" in message


def test_a_tensor_the_sender_stores_in_part_is_sized_by_the_receivers_own(
    tmp_path: Path,
) -> None:
    """A tensor of which the sender stores only its own shards (claimed 8 elements, 4
    stored) is allocated where the receiver's own state has it at that shape; the
    elements no chunk holds are zero."""
    import pickle

    from extensions.errors import IntegrityError

    transport, path, metadata = _sent_metadata(tmp_path)
    _claiming(metadata, 8)
    path.write_bytes(pickle.dumps(metadata))
    shaped = storage.StorageTransport(
        str(tmp_path), rank=1, state_dict=lambda: {"model": {"w": torch.zeros(8)}}
    )
    got = shaped.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))
    assert torch.equal(got["model"]["w"], torch.tensor([1.0] * 4 + [0.0] * 4))
    other = storage.StorageTransport(
        str(tmp_path), rank=2, state_dict=lambda: {"model": {"w": torch.zeros(9)}}
    )
    with pytest.raises(IntegrityError, match="'model.w'.*hold 4 of its 8 elements"):
        other.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))


_RECEIVE_PEAK = """
import resource, sys
from datetime import timedelta
import storage
from extensions.errors import IntegrityError

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    storage.StorageTransport(sys.argv[1], rank=1).recv_checkpoint(
        0, sys.argv[1], 1, timedelta(seconds=5)
    )
except IntegrityError as exc:
    print("refused:", exc)
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_compressed_chunk_claiming_a_huge_tensor_is_not_zero_filled(tmp_path: Path) -> None:
    """A compressed item's claim of elements has no stored size to be checked against:
    a 4-element zstd item claiming 2**28 (1 GiB of float32) made the receiver allocate
    and zero-fill the whole GiB before its bytes ran out. A tensor its chunks cover is
    now left untouched (the load writes every element), so only decoded bytes touch
    memory; measured in a fresh process, whose peak is the receive's alone."""
    import pickle
    import subprocess
    import sys

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    sender = storage.StorageTransport(str(tmp_path), rank=0, transforms=[ZStandard()])
    sender.send_checkpoint([1], 1, {"model": {"w": torch.ones(4)}}, timedelta(seconds=60))
    path = tmp_path / "replica-0" / "step-1" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file
    big = torch.Size([1 << 28])
    props = metadata.state_dict_metadata["model.w"].properties
    chunk = ChunkStorageMetadata(torch.Size([0]), big)
    metadata.state_dict_metadata["model.w"] = TensorStorageMetadata(props, big, [chunk])
    path.write_bytes(pickle.dumps(metadata))
    done = subprocess.run(
        [sys.executable, "-c", _RECEIVE_PEAK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(storage.__file__).parent.parent)},
    )
    assert "refused:" in done.stdout and "'model.w'" in done.stdout, done.stdout + done.stderr
    grew = int(done.stdout.rsplit("grew_kib", 1)[1])
    assert grew < 256 * 1024, done.stdout  # KiB: far below the claimed GiB
