"""torchft 0.2 (real package): our transport under torchft's own transport harness, on
local disk, S3 (SeaweedFS) and GCS (fake-gcs-server), with zstd and checksums.

The healing test (tests/integrations/_torchft_replica.py) runs torchft's lighthouse and
two replica groups as processes, kills one with SIGKILL, restarts it, and checks that it
heals from the live group through storage and stays bit-exact with it.
"""

from __future__ import annotations

import unittest
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft", reason="pip install 'dcp-storage[torchft]'")

from torchft.checkpointing.transport_test import run_multi_recovery_test  # noqa: E402

from extensions import ZStandard  # noqa: E402
from storage.integrations.torchft import StorageCheckpointTransport  # noqa: E402
from tests.support.servers import (  # noqa: E402
    ServerUnavailable,
    endpoint_with_bucket,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_options,
    s3_options,
)

BUCKET = "torchft"


@pytest.fixture(params=["local", "s3", "gcs"])
def location(request: Any, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    run = uuid.uuid4().hex[:8]
    if request.param == "local":
        yield str(tmp_path / "ft"), None
    elif request.param == "s3":
        request.param = "seaweedfs"
        endpoint = endpoint_with_bucket(request, BUCKET)
        yield f"s3://{BUCKET}/{run}", s3_options(endpoint)
    else:
        try:
            endpoint = fake_gcs_endpoint()
        except ServerUnavailable as exc:
            pytest.skip(str(exc))
        gcs_create_bucket(endpoint, BUCKET)
        yield f"gs://{BUCKET}/{run}", gcs_options(endpoint)


def _transports(
    root: str, options: dict[str, Any] | None
) -> Callable[[int, int], StorageCheckpointTransport]:
    def init(rank: int, world_size: int) -> StorageCheckpointTransport:
        return StorageCheckpointTransport(
            root,
            replica_id=f"group{rank}",
            storage_options=options,
            transforms=[ZStandard(level=1)],
            poll_interval=0.01,
        )

    return init


def test_torchft_transport_harness(location: tuple[str, dict[str, Any] | None]) -> None:
    """torchft's own harness: 3-node and 2-node recovery, and its timeout case, which
    failed when our TimeoutError did not say "timed out" (torchft matches the message)."""
    root, options = location
    try:
        run_multi_recovery_test(
            unittest.TestCase(), _transports(root, options), torch.device("cpu")
        )
    finally:
        if dist.is_initialized():  # the harness leaves its group behind when it fails
            dist.destroy_process_group()


def test_metadata_is_the_workers_own_directory(tmp_path: Path) -> None:
    transport = StorageCheckpointTransport(tmp_path, replica_id="train_0", group_rank=3)
    assert transport.metadata() == str(tmp_path / "train_0" / "replica-3")
    transport.shutdown()
    with pytest.raises(ValueError, match="replica_id must be .* got 'a/b'"):
        StorageCheckpointTransport(tmp_path, replica_id="a/b")
