"""A local step saved again, or removed, while its drain reads it: the drain starts again
on the new save (or leaves the removed step) and reports neither as a failure, the root
ends up holding one whole save of the step, and a real failure is still reported."""

from __future__ import annotations

import datetime
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from extensions.errors import CheckpointNotFoundError
from storage import S3FileSystem
from storage.backends._local import LocalFileSystem
from storage.checkpoint.api import load as storage_load
from storage.checkpoint.committed import open_committed
from storage.checkpoint.layout import is_committed
from storage.ops.manager import CheckpointManager
from tests.support.distributed import gloo_group, spawn
from tests.support.servers import boto3_client, create_bucket, list_keys, moto_endpoint, s3_options
from tests.support.tiers import blank_state, step_state

BUCKET = "dcp-tiers-resave"


class _HeldReads(LocalFileSystem):
    """The local tier, where the first read of a data file of ``step-{step}`` once
    :meth:`arm` was called (the drain's) waits for ``go``; ``reading`` is set once it got
    there, and ``path`` is the file it reads."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self.reading, self.go = threading.Event(), threading.Event()
        self.path: str | None = None
        self._armed, self._lock = False, threading.Lock()

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def open_slice(self, path: str, offset: int, length: int) -> Any:
        with self._lock:
            hold = self._armed and f"/step-{self.step}/" in path and path.endswith(".distcp")
            if hold:
                self._armed, self.path = False, path
        if hold:
            self.reading.set()
            assert self.go.wait(120), "the test never let the drain read"
        return super().open_slice(path, offset, length)


class _HeldPublish(LocalFileSystem):
    """A durable root whose first publish of ``step-1/.metadata`` waits for ``go``
    (``publishing`` is set once it got there): every data file is copied by then."""

    def __init__(self) -> None:
        super().__init__()
        self.publishing, self.go = threading.Event(), threading.Event()
        self._held = False

    def write_atomic_in(
        self, directory: str, name: str, data: bytes, *, exclusive: bool = False
    ) -> None:
        if name == ".metadata" and directory.rstrip("/").endswith("/step-1") and not self._held:
            self._held = True
            self.publishing.set()
            assert self.go.wait(120), "the test never let the drain publish"
        super().write_atomic_in(directory, name, data, exclusive=exclusive)


def _manager(tmp_path: Path, local: LocalFileSystem, **options: Any) -> CheckpointManager:
    return CheckpointManager(
        options.pop("root", tmp_path / "durable"),
        local=tmp_path / "local",
        local_filesystem=local,
        persist="thread",  # the drain reads through this process's held filesystem
        **options,
    )


def _loads(path: Path, step: int) -> bool:
    target = blank_state()
    storage_load(target, path)
    return torch.equal(target["w"], step_state(step)["w"])


def _only_its_own_files(path: Path) -> None:
    """The root's step holds the data files its metadata names, and no other."""
    named = open_committed(LocalFileSystem(), str(path)).data_files()
    assert named and {p.name for p in path.iterdir() if p.suffix == ".distcp"} == set(named)


def test_a_step_saved_again_under_its_drain_is_drained_again_and_no_error(
    tmp_path: Path,
) -> None:
    # Before, the drain of the first save failed with "data file ... is missing" (the
    # second save's commit had removed the files it read), and wait() raised it though
    # the next pass drained the new save.
    disk = _HeldReads(1)
    mgr = _manager(tmp_path, disk)
    disk.arm()
    mgr.save(1, step_state(1))
    assert disk.reading.wait(120), "the drain never read step 1"
    future = mgr.save(1, step_state(2), blocking=False)  # the same step, another state
    assert future is not None
    future.result(timeout=120)  # committed locally: the first save's files are gone
    disk.go.set()
    mgr.wait()  # nothing to report
    assert mgr.durable_steps() == [1]
    assert _loads(tmp_path / "durable" / "step-1", 2)
    _only_its_own_files(tmp_path / "durable" / "step-1")
    # A file missing from a step that was neither saved again nor removed is a failure.
    held = _HeldReads(2)
    mgr = _manager(tmp_path / "b", held)
    held.arm()
    mgr.save(2, step_state(2))
    assert held.reading.wait(120) and held.path is not None
    os.remove(held.path)
    held.go.set()
    with pytest.raises(CheckpointNotFoundError, match=r"data file .* is missing"):
        mgr.wait()
    assert not is_committed(LocalFileSystem(), str(tmp_path / "b" / "durable" / "step-2"))


def test_a_step_saved_again_while_its_copy_is_published_is_drained_again(
    tmp_path: Path,
) -> None:
    # Before, the first save's copy was published, the step counted as drained (the
    # second save's drain request lost) and durable: the root kept the old state for
    # good, and the local tier could prune the new one.
    root = _HeldPublish()
    mgr = _manager(tmp_path, LocalFileSystem(), filesystem=root)
    mgr.save(1, step_state(1))
    assert root.publishing.wait(120), "the drain never published step 1"
    future = mgr.save(1, step_state(2), blocking=False)
    assert future is not None
    future.result(timeout=120)
    root.go.set()
    mgr.wait()
    assert mgr.durable_steps() == [1]
    assert _loads(tmp_path / "durable" / "step-1", 2)
    _only_its_own_files(tmp_path / "durable" / "step-1")
    assert mgr.tiers is not None and mgr.tiers.durable(1)


def test_a_step_saved_again_is_not_durable_until_its_new_save_drains(tmp_path: Path) -> None:
    # Before, a step drained once counted as durable after it was saved again, while the
    # root held the old save: what a preemption save's durability check and the local
    # tier's retention ask.
    disk = _HeldReads(1)
    mgr = _manager(tmp_path, disk)
    mgr.save(1, step_state(1))
    mgr.wait()
    assert mgr.tiers is not None and mgr.tiers.durable(1)
    disk.arm()
    mgr.save(1, step_state(2))
    assert disk.reading.wait(120), "the drain never read step 1 again"
    try:
        assert not mgr.tiers.durable(1)  # the root holds the first save
    finally:
        disk.go.set()
    mgr.wait()
    assert mgr.tiers.durable(1) and _loads(tmp_path / "durable" / "step-1", 2)


def test_a_step_deleted_locally_under_its_drain_is_left_without_error(tmp_path: Path) -> None:
    # Before, delete_local() of a step whose drain was reading it made wait() raise the
    # drain's "data file ... is missing".
    disk = _HeldReads(1)
    mgr = _manager(tmp_path, disk)
    disk.arm()
    mgr.save(1, step_state(1))
    assert disk.reading.wait(120), "the drain never read step 1"
    assert mgr.tiers is not None
    mgr.tiers.delete_local(1)
    disk.go.set()
    mgr.wait()
    assert mgr.durable_steps() == [] and mgr.tiers.local.steps() == []
    left = tmp_path / "durable" / "step-1"
    assert not left.exists() or not [p for p in left.iterdir() if p.suffix == ".distcp"]
    mgr.save(2, step_state(2))
    mgr.wait()
    assert mgr.durable_steps() == [2]


def test_a_step_removed_under_its_drain_otherwise_is_reported_once(tmp_path: Path) -> None:
    # Not by delete_local: a step this manager saved will never be durable, which wait()
    # says, naming it, once (before: a missing data file, then every later pass failed).
    disk = _HeldReads(1)
    mgr = _manager(tmp_path, disk)
    disk.arm()
    mgr.save(1, step_state(1))
    assert disk.reading.wait(120), "the drain never read step 1"
    shutil.rmtree(tmp_path / "local" / "step-1")
    disk.go.set()
    with pytest.raises(CheckpointNotFoundError, match=r"step-1: it was removed .*not by delete"):
        mgr.wait()
    mgr.save(2, step_state(2))
    mgr.wait()  # step 1 is not drained again, nor reported again
    assert mgr.durable_steps() == [2]


def test_a_step_saved_again_under_its_drain_to_s3_is_drained_whole(tmp_path: Path) -> None:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    prefix = f"{uuid.uuid4().hex}/run"
    bucket = S3FileSystem(storage_options=s3_options(endpoint))
    disk = _HeldReads(1)
    root = f"s3://{BUCKET}/{prefix}"
    mgr = _manager(tmp_path, disk, root=root, filesystem=bucket)
    disk.arm()
    mgr.save(1, step_state(1))
    assert disk.reading.wait(120), "the drain never read step 1"
    future = mgr.save(1, step_state(2), blocking=False)
    assert future is not None
    future.result(timeout=120)
    disk.go.set()
    mgr.wait()
    assert mgr.durable_steps() == [1]
    target = blank_state()
    CheckpointManager(root, filesystem=bucket).load(target, 1)
    assert torch.equal(target["w"], step_state(2)["w"])
    named = open_committed(mgr.fs, mgr.step_path(1)).data_files()
    keys = list_keys(boto3_client(endpoint), BUCKET, f"{prefix}/step-1/")
    data = {k.rsplit("/", 1)[-1] for k in keys if k.endswith(".distcp")}
    assert named and data == set(named)


def _two_nodes_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store, timeout=datetime.timedelta(seconds=120)):
        disk = _HeldReads(1)
        mgr = CheckpointManager(
            f"{base}/durable", local=f"{base}/node{rank}", local_filesystem=disk, persist="thread"
        )
        name = f"rank{rank}"
        if rank == 0:  # rank 1's copy of the first save may be done, or not, meanwhile
            disk.arm()
        mgr.save(1, {name: torch.full((4096,), 1.0 + rank)})
        if rank == 0:
            assert disk.reading.wait(120), "the drain never read step 1"
        dist.barrier()
        future = mgr.save(1, {name: torch.full((4096,), 10.0 + rank)}, blocking=False)
        assert future is not None
        future.result(timeout=120)  # committed on both nodes
        disk.go.set()
        mgr.wait()  # nothing to report, on either rank
        assert mgr.durable_steps() == [1]
        target = {name: torch.zeros(4096)}
        storage_load(target, f"{base}/durable/step-1")
        assert torch.equal(target[name], torch.full((4096,), 10.0 + rank))
        if rank == 0:
            _only_its_own_files(Path(base) / "durable" / "step-1")


def test_two_nodes_drain_a_step_saved_again_under_one_ranks_drain(tmp_path: Path) -> None:
    # Only rank 0 finds the step replaced: every rank must drop the copy alike, and
    # drain the new save together.
    spawn(_two_nodes_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
