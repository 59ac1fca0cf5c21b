"""A store that lies to a write replacing a checkpoint or a model: it acknowledges the
write that commits it, then keeps serving the older object at that name (a PUT it lost,
a cache in front of it), or its listing omits the files there. moto behind the fault
proxy (``tests.support.servers.FaultProxy``), whose ``"rewrite"`` fault changes what
the server did or said. Each test says what happened before the fix it guards."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import CheckpointStorageError, IntegrityError
from storage.backends import LocalFileSystem
from storage.checkpoint.safetensors import load_safetensors
from storage.ops.copy import copy_checkpoint
from storage.ops.export import export_safetensors
from tests.support.servers import (
    Asked,
    FaultProxy,
    Reply,
    boto3_client,
    create_bucket,
    moto_endpoint,
    s3_options,
)

pytestmark = pytest.mark.timeout(120)

BUCKET = "dcp-lost-puts"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FaultProxy]]:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint) as proxy:
        yield endpoint, proxy


def _keeping_old(endpoint: str, key: str) -> Any:
    """A rewrite that lets the write of ``key`` through, then puts the object that was
    there back: the store answered 200 and serves the old object."""
    client = boto3_client(endpoint)
    older = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def rewrite(asked: Asked, reply: Reply) -> Reply:
        client.put_object(Bucket=BUCKET, Key=key, Body=older)
        return reply

    return rewrite


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((64,), value), "b": torch.full((32,), value)}


def test_a_copy_over_a_checkpoint_whose_metadata_the_store_keeps_old_removes_nothing(
    server: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    """``cp --overwrite``: the store acknowledged the new ``.metadata`` and kept the old.
    Before, the copy then removed the old checkpoint's data files and reported success,
    while the metadata every reader found named those files: the checkpoint replaced was
    lost and the new one was not there. Now the metadata is read back before anything
    is removed: the copy fails saying so and both checkpoints' files stay."""
    endpoint, proxy = server
    proxy.clear()
    for value in (1.0, 2.0):
        storage.save(_state(value), str(tmp_path / f"src-{value:g}"))
    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url))
    prefix = uuid.uuid4().hex
    dst = f"{BUCKET}/{prefix}/ckpt"
    copy_checkpoint(LocalFileSystem(), str(tmp_path / "src-1"), fs, dst)
    rewrite = _keeping_old(endpoint, f"{prefix}/ckpt/.metadata")
    proxy.add("rewrite", method="PUT", path=r"/ckpt/\.metadata(\?|$)", rewrite=rewrite, count=1)
    with pytest.raises(CheckpointStorageError, match="acknowledged this save's metadata"):
        copy_checkpoint(LocalFileSystem(), str(tmp_path / "src-2"), fs, dst, overwrite=True)
    proxy.clear()
    state = _state(0.0)
    storage.load(state, f"s3://{dst}", filesystem=fs)  # the old checkpoint, whole
    assert all(torch.equal(v, _state(1.0)[k]) for k, v in state.items())
    # Once the store answers right, the copy goes through.
    copy_checkpoint(LocalFileSystem(), str(tmp_path / "src-2"), fs, dst, overwrite=True)
    storage.load(state, f"s3://{dst}", filesystem=fs)
    assert all(torch.equal(v, _state(2.0)[k]) for k, v in state.items())


def test_a_save_over_a_step_whose_metadata_the_store_keeps_old_keeps_that_step(
    server: tuple[str, FaultProxy],
) -> None:
    """The manager saving a step again (a job restarted from an older step): the same
    lost PUT. Before, the save returned and the step's metadata named files it had just
    removed; now the save fails and the step still loads as it was."""
    endpoint, proxy = server
    proxy.clear()
    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url))
    prefix = uuid.uuid4().hex
    mgr = storage.CheckpointManager(f"s3://{BUCKET}/{prefix}", filesystem=fs)
    mgr.save(5, _state(1.0))
    rewrite = _keeping_old(endpoint, f"{prefix}/step-5/.metadata")
    proxy.add("rewrite", method="PUT", path=r"/step-5/\.metadata(\?|$)", rewrite=rewrite, count=1)
    with pytest.raises(CheckpointStorageError, match="acknowledged this save's metadata"):
        mgr.save(5, _state(2.0))
    proxy.clear()
    state = _state(0.0)
    assert mgr.load(state) == 5
    assert all(torch.equal(v, _state(1.0)[k]) for k, v in state.items())


def test_an_export_of_one_file_whose_publish_the_store_keeps_old_fails(
    server: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    """An export of one file (``model.safetensors``) over an earlier one: the store
    acknowledged the upload and kept the old file. Before, the export returned as if
    the new weights were there, and serving loaded the old ones (a model in several
    files read its index back and failed); now it reads the file's header back."""
    endpoint, proxy = server
    proxy.clear()
    for value in (1.0, 2.0):
        storage.save(_state(value), str(tmp_path / f"src-{value:g}"))
    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url))
    prefix = uuid.uuid4().hex
    dst = f"{BUCKET}/{prefix}/hf"
    export_safetensors(LocalFileSystem(), str(tmp_path / "src-1"), fs, dst)
    rewrite = _keeping_old(endpoint, f"{prefix}/hf/model.safetensors")
    # Small files go up in one PUT, large ones as a multipart upload completed by a POST.
    for method in ("PUT", "POST"):
        path = r"/hf/model\.safetensors(\?uploadId=[^&]*)?$"
        proxy.add("rewrite", method=method, path=path, rewrite=rewrite)
    with pytest.raises(IntegrityError, match="not the one this write published"):
        export_safetensors(LocalFileSystem(), str(tmp_path / "src-2"), fs, dst, overwrite=True)
    proxy.clear()
    state = _state(0.0)
    load_safetensors(state, f"s3://{dst}", storage_options=s3_options(endpoint))
    assert all(torch.equal(v, _state(1.0)[k]) for k, v in state.items())


def _without_model_files(asked: Asked, reply: Reply) -> Reply:
    """A listing that lags behind the store: the model's files are left out."""
    entry = rb"<Contents>(?:(?!</Contents>).)*?</Contents>"
    reply.body = re.sub(
        entry, lambda m: b"" if b"model-" in m.group(0) else m.group(0), reply.body, flags=re.S
    )
    return reply


def test_an_export_over_a_model_the_listing_omits_that_fails_leaves_it(
    server: tuple[str, FaultProxy], tmp_path: Path
) -> None:
    """An export in two files over a model in two files, while the folder's listing
    omits them; the upload of its second file then fails. Before, the export took the
    names it did not see listed, so its first file replaced the old model's: the old
    index then named a file of another write, and the model that a failed export
    promises to leave no longer loaded. Each name is now also asked for by name."""
    endpoint, proxy = server
    proxy.clear()
    for value in (1.0, 2.0):
        storage.save(_state(value), str(tmp_path / f"src-{value:g}"))
    fast = {"retries": {"mode": "standard", "total_max_attempts": 1}}
    fs = storage.S3FileSystem(storage_options=s3_options(proxy.url, config_kwargs=fast))
    dst = f"{BUCKET}/{uuid.uuid4().hex}/hf"
    export_safetensors(LocalFileSystem(), str(tmp_path / "src-1"), fs, dst, max_shard_size=300)
    proxy.add("rewrite", method="GET", path=r"list-type=2", rewrite=_without_model_files)
    proxy.add("500", method="PUT", path=r"/hf/model-([0-9a-f]{8}-)?00002-of-00002\.")
    with pytest.raises(OSError, match="00002-of-00002"):
        export_safetensors(
            LocalFileSystem(), str(tmp_path / "src-2"), fs, dst, max_shard_size=300, overwrite=True
        )
    proxy.clear()
    state = _state(0.0)
    load_safetensors(state, f"s3://{dst}", storage_options=s3_options(endpoint))
    assert all(torch.equal(v, _state(1.0)[k]) for k, v in state.items())
