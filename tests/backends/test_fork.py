"""A bucket backend used in a child made with ``fork``: the filesystem object (and every
reader, writer, manager or transport holding it) came from the parent, its clients did
not; the child builds its own on first use."""

from __future__ import annotations

import os
import traceback
import uuid
from typing import Any

import pytest
import torch

import storage
from storage.backends.registry import filesystem_from_url
from tests.checkpoint.test_thread_staging import wait_exit
from tests.support.servers import (
    endpoint_with_bucket,
    gcs_endpoint_with_bucket,
    gcs_options,
    s3_options,
)

BUCKET = "dcp-fork"


@pytest.fixture(params=["moto", "gcs"])
def location(request: Any) -> tuple[str, dict[str, Any]]:
    run = uuid.uuid4().hex[:8]
    if request.param == "moto":
        return f"s3://{BUCKET}/{run}", s3_options(endpoint_with_bucket(request, BUCKET))
    return f"gs://{BUCKET}/{run}", gcs_options(gcs_endpoint_with_bucket(BUCKET))


def test_a_forked_child_saves_and_loads_through_its_parents_filesystem(
    location: tuple[str, dict[str, Any]],
) -> None:
    """The child used the parent's s3fs client, whose event loop fsspec refuses in a
    child ("This class is not fork-safe"): every save failed after its retries."""
    root, options = location
    fs, path = filesystem_from_url(root, options)
    storage.save({"w": torch.ones(64)}, root + "/parent", filesystem=fs)  # clients built
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            storage.save({"w": torch.full((64,), 2.0)}, root + "/child", filesystem=fs)
            target = {"w": torch.zeros(64)}
            storage.load(target, root + "/parent", filesystem=fs)
            code = 0 if torch.equal(target["w"], torch.ones(64)) else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert wait_exit(pid, timeout=120) == 0
    target = {"w": torch.zeros(64)}
    storage.load(target, root + "/child", filesystem=fs)  # the parent's clients still work
    assert torch.equal(target["w"], torch.full((64,), 2.0))
