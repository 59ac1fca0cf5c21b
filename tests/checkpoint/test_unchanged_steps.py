"""An incremental save in which no item changed writes no data file.

Before, on S3 such a save failed while committing (``FileNotFoundError: ... nothing under
this prefix``: the commit listed the checkpoint's prefix to check its new data files, and
an object store has no prefix without an object), on GCS with a listing error; local disk
and memory were fine. So frozen models and eval-only steps could not be saved through
``storage.save(base=...)`` or an incremental manager, and a tiered step stayed local with
every drain pass failing again. Every backend, every path: one step writes no data file.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from storage import CheckpointManager
from storage.ops.describe import describe
from tests.support.servers import (
    ServerUnavailable,
    create_bucket,
    fake_gcs_endpoint,
    gcs_create_bucket,
    gcs_options,
    s3_endpoint,
    s3_options,
)

BUCKET = "dcp-unchanged"
BACKENDS = ["local", "memory", "moto", "seaweedfs", "gcs"]


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh root URL on one backend and its storage options."""
    kind = request.param
    run = uuid.uuid4().hex
    if kind == "local":
        yield str(tmp_path / "run"), {}
    elif kind == "memory":
        yield f"dcpmem://unchanged-{run}/run", {}
        storage.MemoryFileSystem.drop_store(f"unchanged-{run}")
    elif kind == "gcs":
        endpoint = fake_gcs_endpoint()
        gcs_create_bucket(endpoint, BUCKET)
        yield f"gs://{BUCKET}/{run}", gcs_options(endpoint)
    else:
        try:
            endpoint = s3_endpoint(kind)
        except ServerUnavailable as exc:
            pytest.skip(str(exc))
        create_bucket(endpoint, BUCKET)
        yield f"s3://{BUCKET}/{run}", s3_options(endpoint)


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(21)
    return {"frozen": torch.randn(64, 32, generator=gen), "meta": {"lr": 0.5}}


def _blank() -> dict[str, Any]:
    return {"frozen": torch.zeros(64, 32), "meta": {"lr": 0.0}}


def _data_files(url: str, options: dict[str, Any]) -> list[str]:
    fs, path = storage.filesystem_from_url(url, storage_options=options)
    return [n for n in fs.ls(path) if n.endswith(".distcp")]


def _check_loads(url: str, options: dict[str, Any]) -> None:
    target = _blank()
    storage.load(target, url, storage_options=options)
    assert torch.equal(target["frozen"], _state()["frozen"]) and target["meta"] == {"lr": 0.5}


def test_save_with_base_and_nothing_changed(root: tuple[str, dict[str, Any]]) -> None:
    url, options = root
    storage.save(_state(), f"{url}/a", storage_options=options, fingerprint=True)
    storage.save(_state(), f"{url}/b", storage_options=options, base=f"{url}/a")
    assert _data_files(f"{url}/b", options) == []  # every item is a reference
    fs, path = storage.filesystem_from_url(f"{url}/b", storage_options=options)
    assert {row.ref for row in describe(fs, path).items} == {"a"}
    _check_loads(f"{url}/b", options)


def test_incremental_manager_saves_the_same_state_twice(root: tuple[str, dict[str, Any]]) -> None:
    url, options = root
    mgr = CheckpointManager(url, storage_options=options, incremental=True)
    mgr.save(1, _state())
    mgr.save(2, _state())
    mgr.save(3, _state())  # references step 2's references: still step 1's bytes
    assert mgr.steps() == [1, 2, 3]
    assert _data_files(mgr.step_url(3), options) == []
    target = _blank()
    assert mgr.load(target) == 3
    assert torch.equal(target["frozen"], _state()["frozen"])


@pytest.mark.parametrize("root", ["moto", "seaweedfs", "gcs"], indirect=True)
def test_tier_drains_a_step_that_wrote_no_data_file(
    root: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, options = root
    mgr = CheckpointManager(
        url, storage_options=options, incremental=True, local=tmp_path / "local"
    )
    for step in (1, 2, 3):
        mgr.save(step, _state())
        mgr.wait()  # before: step 2's drain failed, and every later pass again
    assert mgr.durable_steps() == [1, 2, 3]
    assert _data_files(mgr.step_url(2), options) == []
    _check_loads(mgr.step_url(3), options)
