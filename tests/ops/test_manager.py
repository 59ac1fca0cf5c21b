"""CheckpointManager: steps, latest, load, retention, cleanup, async saves; DCP's
process-based async executor with our writer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest
import torch

import storage
from extensions.errors import CheckpointNotFoundError
from extensions.zstd import ZStandard
from storage.checkpoint.deletion import delete_checkpoint
from storage.checkpoint.layout import is_metadata_name, parse_step
from storage.ops.manager import CheckpointManager


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(32, 16, generator=gen),
        "b": torch.randn(16, generator=gen).to(torch.bfloat16),
        "meta": {"step": step, "name": "net"},
    }


def _blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(32, 16),
        "b": torch.zeros(16, dtype=torch.bfloat16),
        "meta": {"step": -1, "name": ""},
    }


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, storage.FileSystemBase]:
    if request.param == "local":
        fs: storage.FileSystemBase = storage.LocalFileSystem()
        return str(tmp_path / "run"), fs
    return f"dcpmem://bucket/{uuid.uuid4().hex}", storage.MemoryFileSystem()


def _manager(backend: tuple[str, storage.FileSystemBase], **kw: Any) -> CheckpointManager:
    root, fs = backend
    return CheckpointManager(root, filesystem=fs, **kw)


def _put(fs: storage.FileSystemBase, path: str, data: bytes = b"x") -> None:
    with fs.create_stream(path, "wb") as stream:
        stream.write(data)


def test_step_name_pattern() -> None:
    assert [parse_step(n) for n in ("step-0", "step-7", "step-300")] == [0, 7, 300]
    for name in (
        "step-3.14",
        "step--1",
        "latest",
        "step-300_extra",
        "step-07",
        "step-",
        "step-1 ",
        "Step-1",
        "step-١",
        "xstep-1",
    ):
        assert parse_step(name) is None, name


def test_save_list_load_roundtrip(backend: tuple[str, storage.FileSystemBase]) -> None:
    mgr = _manager(backend, transforms=[ZStandard(level=1)])
    assert mgr.steps() == [] and mgr.latest() is None
    for step in (2, 10, 9):
        mgr.save(step, _state(step))
    assert mgr.steps() == [2, 9, 10]  # integers, not strings
    assert mgr.latest() == 10
    out = _blank()
    assert mgr.load(out) == 10
    assert torch.equal(out["w"], _state(10)["w"]) and out["meta"] == {"step": 10, "name": "net"}
    out = _blank()
    assert mgr.load(out, step=2) == 2
    assert torch.equal(out["b"], _state(2)["b"])
    # Stock-readable layout: root/step-N/.metadata.
    fs = backend[1]
    assert fs.exists(fs.concat_path(mgr.step_path(9), ".metadata"))


def test_load_without_checkpoint_says_so(backend: tuple[str, storage.FileSystemBase]) -> None:
    mgr = _manager(backend)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint under"):
        mgr.load(_blank())
    mgr.save(1, _state(1))
    with pytest.raises(CheckpointNotFoundError, match=r"step-5 is not a committed.*\[1\]"):
        mgr.load(_blank(), step=5)


def test_crashed_save_is_never_listed_and_triggers_no_retention(
    backend: tuple[str, storage.FileSystemBase],
) -> None:
    mgr = _manager(backend, keep_last=1)
    mgr.save(1, _state(1))
    bad = dict(_state(2), hook=lambda: None)  # cannot be pickled: the save fails midway
    with pytest.raises(Exception, match="(?i)pickle|lambda"):
        mgr.save(2, bad)
    assert mgr.steps() == [1]  # retention did not run for the failed step
    assert [e.committed for e in mgr.entries() if e.step == 2] in ([], [False])
    # A leftover by hand: data file, no metadata.
    fs = backend[1]
    _put(fs, fs.concat_path(mgr.step_path(3), "__0_0-abc.distcp"))
    assert mgr.steps() == [1] and mgr.latest() == 1
    assert [(e.step, e.committed) for e in mgr.entries() if e.step != 2] == [(1, True), (3, False)]


def test_retention_keep_last_and_keep_every(backend: tuple[str, storage.FileSystemBase]) -> None:
    mgr = _manager(backend, keep_last=2, keep_every=3)
    for step in range(8):
        mgr.save(step, _state(step))
    assert mgr.steps() == [0, 3, 6, 7]
    # Saving an older step keeps it (the step just saved is never pruned).
    mgr.save(4, _state(4))
    assert mgr.steps() == [0, 3, 4, 6, 7]
    mgr.save(8, _state(8))
    assert mgr.steps() == [0, 3, 6, 7, 8]
    out = _blank()
    mgr.load(out, step=6)
    assert torch.equal(out["w"], _state(6)["w"])


def test_no_retention_without_keep_last(backend: tuple[str, storage.FileSystemBase]) -> None:
    mgr = _manager(backend)
    for step in range(4):
        mgr.save(step, _state(step))
    assert mgr.apply_retention() == [] and mgr.steps() == [0, 1, 2, 3]


def test_strangers_are_left_alone(tmp_path: Any) -> None:
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root), keep_last=1)
    mgr.save(1, _state(1))
    committed = sorted(os.listdir(root / "step-1"))
    strangers = ["step-3.14", "step--1", "step-300_extra", "step-07", "other", "latest.d"]
    old = time.time() - 10 * 86400
    for name in strangers:  # each looks like a checkpoint (a copy of one) and is old
        d = root / name
        d.mkdir()
        for f in committed:
            (d / f).write_bytes((root / "step-1" / f).read_bytes())
            os.utime(d / f, (old, old))
    # Uncommitted step directory that also holds a user's file: not ours to delete.
    (root / "step-4").mkdir()
    (root / "step-4" / "__0_0-x.distcp").write_bytes(b"partial")
    (root / "step-4" / "notes.txt").write_bytes(b"mine")
    for p in (root / "step-4").iterdir():
        os.utime(p, (old, old))
    (root / "latest").write_text("1")
    (root / "step-9").write_text("a plain file named like a step")
    (root / "notes.txt").write_text("hello")
    ours = {"step-1", ".dcp-latest"}  # the pointer at the newest step is the manager's
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not ours & {*p.parts}}

    for step in (2, 3):
        mgr.save(step, _state(step))
    assert mgr.cleanup(grace_seconds=0) == []
    assert mgr.steps() == [3]
    ours = {"step-3", ".dcp-latest"}
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not ours & {*p.parts}}
    assert after == before and (root / ".dcp-latest").read_text() == "step-3\n"


def test_delete_removes_metadata_first(tmp_path: Any) -> None:
    calls: list[str] = []

    class Recording(storage.MemoryFileSystem):
        def rm_file(self, path: str) -> None:
            calls.append(path.rsplit("/", 1)[-1])
            super().rm_file(path)

        def rm_dir(self, path: str) -> None:
            calls.append("<dir>")
            super().rm_dir(path)

        def rename(self, path: str, new_path: str) -> None:
            calls.append("mv " + path.rsplit("/", 1)[-1])
            super().rename(path, new_path)

    fs = Recording()
    mgr = CheckpointManager("dcpmem://b/run", filesystem=fs, single_file_per_rank=False)
    mgr.save(1, _state(1))
    calls.clear()  # the save removed its heartbeat
    mgr.delete(1)
    # The metadata is moved aside (a temporary name: no longer a checkpoint), then,
    # nothing referencing it, removed before any data file; the root's latest pointer,
    # which named it, goes with it.
    assert calls[0] == "mv .metadata" and calls[1].startswith(".metadata.tmp-")
    assert calls[2] == ".dcp-latest" and calls[-1] == "<dir>"
    assert len(calls) > 5 and all(c.endswith(".distcp") for c in calls[3:-1])
    assert mgr.steps() == [] and not fs.exists(mgr.step_path(1))
    with pytest.raises(CheckpointNotFoundError):
        mgr.delete(1)


def test_delete_of_an_uncommitted_step_says_so_and_removes_nothing(tmp_path: Any) -> None:
    # Before: delete() of a step directory without metadata (an interrupted save, or a
    # save in flight in another process) returned quietly, the step still there.
    mgr = CheckpointManager(str(tmp_path / "run"))
    mgr.save(1, _state(1))
    leftover = tmp_path / "run" / "step-5" / "__0_0-0123456789ab.distcp"
    leftover.parent.mkdir()
    leftover.write_bytes(b"a save in flight")
    with pytest.raises(CheckpointNotFoundError, match=r"step-5 is not a committed.*cleanup"):
        mgr.delete(5)
    assert leftover.read_bytes() == b"a save in flight"
    assert mgr.steps() == [1]


def test_delete_interrupted_after_metadata_is_not_a_checkpoint() -> None:
    class FailsOnData(storage.MemoryFileSystem):
        def rm_file(self, path: str) -> None:
            if path.endswith(".distcp"):
                raise PermissionError(path)
            super().rm_file(path)

    fs = FailsOnData()
    mgr = CheckpointManager("dcpmem://b/run", filesystem=fs)
    mgr.save(1, _state(1))
    with pytest.raises(PermissionError):
        delete_checkpoint(fs, mgr.step_path(1))
    assert mgr.steps() == []  # half-deleted is never mistaken for a checkpoint


def test_cleanup_removes_only_old_uncommitted_leftovers(tmp_path: Any) -> None:
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root))
    mgr.save(4, _state(4))
    old = time.time() - 7200
    (root / "step-5").mkdir()
    for name in ("__0_0-a.distcp", "__0_1-a.distcp", ".metadata.tmp-0123abcd"):
        (root / "step-5" / name).write_bytes(b"partial")
    (root / "step-6").mkdir()  # a save in progress: fresh files
    (root / "step-6" / "__0_0-b.distcp").write_bytes(b"partial")
    (root / "step-7").mkdir()  # crashed before writing anything
    for p in [*(root / "step-5").iterdir(), root / "step-7", *(root / "step-4").iterdir()]:
        os.utime(p, (old, old))
    assert mgr.cleanup(grace_seconds=3600, dry_run=True) == [5, 7]
    assert (root / "step-5").exists()
    assert mgr.cleanup(grace_seconds=3600) == [5, 7]
    assert not (root / "step-5").exists() and not (root / "step-7").exists()
    assert (root / "step-6" / "__0_0-b.distcp").exists()
    assert mgr.steps() == [4]  # committed and old: cleanup never touches it
    assert mgr.cleanup(grace_seconds=3600) == []


def test_cleanup_removes_old_unreferenced_data_files_in_committed_steps(tmp_path: Any) -> None:
    # What a 2-rank save that failed on the other rank leaves in a committed step.
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root))
    mgr.save(3, _state(3))
    step = root / "step-3"
    own = sorted(p.name for p in step.iterdir())
    old, fresh = step / "__1_0-deadbeef0000.distcp", step / "__1_0-feedface0000.distcp"
    old.write_bytes(b"orphan")
    fresh.write_bytes(b"maybe a save in progress")
    (step / "notes.txt").write_text("not ours")
    long_ago = time.time() - 7200
    for p in [old, step / "notes.txt", *(step / n for n in own)]:
        os.utime(p, (long_ago, long_ago))
    assert mgr.cleanup(grace_seconds=3600) == []  # the step itself stays
    assert not old.exists() and fresh.exists() and (step / "notes.txt").exists()
    assert sorted(p.name for p in step.iterdir() if p.name not in (fresh.name, "notes.txt")) == own
    out = _blank()
    assert mgr.load(out) == 3 and torch.equal(out["w"], _state(3)["w"])


def test_cleanup_never_takes_a_committed_step_whose_listing_misses_its_metadata(
    tmp_path: Any,
) -> None:
    # Before: a listing that missed the .metadata of a committed step (a stale or
    # lagging listing) made it look like an interrupted save, and cleanup removed the
    # data files of that committed checkpoint once they were older than the grace.
    class MissesMetadata(storage.LocalFileSystem):
        def ls(self, path: str) -> list[str]:
            names = super().ls(path)
            return [n for n in names if n != ".metadata"] if path.endswith("step-3") else names

    root = tmp_path / "run"
    CheckpointManager(str(root)).save(3, _state(3))
    long_ago = time.time() - 7200
    for p in (root / "step-3").iterdir():
        os.utime(p, (long_ago, long_ago))
    own = sorted(p.name for p in (root / "step-3").iterdir())
    mgr = CheckpointManager(str(root), filesystem=MissesMetadata())
    assert mgr.cleanup(grace_seconds=3600) == []
    assert sorted(p.name for p in (root / "step-3").iterdir()) == own
    out = _blank()
    assert CheckpointManager(str(root)).load(out) == 3


def test_cleanup_keeps_leftovers_of_unknown_age() -> None:
    # The memory backend cannot tell an object's age: nothing may be assumed stale.
    fs = storage.MemoryFileSystem()
    mgr = CheckpointManager("dcpmem://b/run", filesystem=fs)
    _put(fs, fs.concat_path(mgr.step_path(5), "__0_0-a.distcp"))
    if fs.modified(fs.concat_path(mgr.step_path(5), "__0_0-a.distcp")) is None:
        assert mgr.cleanup(grace_seconds=0) == []
        assert fs.exists(fs.concat_path(mgr.step_path(5), "__0_0-a.distcp"))
    else:  # a memory backend that records times ages like any other
        assert mgr.cleanup(grace_seconds=3600) == []


def test_cleanup_of_a_root_of_steps_says_nothing_of_the_root(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A root of steps is no interrupted save of its own. Before, every ``cleanup`` and
    ``gc`` of one (and each sweep of a recovery transport's replica directory) took the
    root for one and logged that it was "not cleaned up, it holds files that are not
    ours", a warning about nothing, after asking the store for metadata there."""
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    mgr.save(1, {"w": torch.ones(4)})
    with caplog.at_level("INFO", logger="storage.ops.manager"):
        assert mgr.cleanup(grace_seconds=0) == []
    assert [r.getMessage() for r in caplog.records if "not cleaned up" in r.getMessage()] == []
    assert mgr.steps() == [1]


class _CountsMetadataReads:
    """Mixed into a backend: counts the reads of metadata files (``create_stream`` in
    ``"rb"``, which ``read_bytes`` goes through on local disk and in memory)."""

    reads = 0

    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Any:
        if mode == "rb" and is_metadata_name(path.rpartition("/")[2]):
            self.reads += 1
        return super().create_stream(path, mode, sync=sync)  # type: ignore[misc]


class _CountingLocal(_CountsMetadataReads, storage.LocalFileSystem):
    pass


class _CountingMemory(_CountsMetadataReads, storage.MemoryFileSystem):
    pass


def test_gc_reads_each_step_once_per_pass(backend: tuple[str, storage.FileSystemBase]) -> None:
    # Before: `gc --keep-last 1` over 40 incremental steps loaded
    # metadata 823 times (each deletion re-read every sibling: quadratic in the steps).
    # Now each pass (retention, cleanup, the referenced-by report) reads each step at
    # most once: 44 reads here.
    root, plain = backend
    mgr = CheckpointManager(root, filesystem=plain, incremental=True)
    frozen = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    steps = 40
    for step in range(steps):
        mgr.save(step, {"frozen": frozen, **_state(step)})
    fs: _CountingLocal | _CountingMemory = (
        _CountingMemory(plain.name)
        if isinstance(plain, storage.MemoryFileSystem)
        else _CountingLocal()
    )
    gc = CheckpointManager(root, filesystem=fs, keep_last=1)
    # What `dcp-storage gc ROOT --keep-last 1` runs.
    assert gc.apply_retention() == list(range(1, steps - 1))
    assert gc.cleanup(grace_seconds=0) == []
    assert gc.referenced_by() == {0: [steps - 1]}
    assert gc.steps() == [0, steps - 1]
    assert fs.reads <= 2 * steps, fs.reads


def test_async_save_stages_and_prunes(backend: tuple[str, storage.FileSystemBase]) -> None:
    mgr = _manager(backend, keep_last=1)
    state = _state(1)
    expected = state["w"].clone()
    fut = mgr.save(1, state, blocking=False)
    assert fut is not None
    state["w"].fill_(123.0)  # training goes on right away
    state["meta"]["step"] = 99
    fut.result(timeout=60)
    out = _blank()
    mgr.load(out)
    assert torch.equal(out["w"], expected) and out["meta"]["step"] == 1

    first = mgr.save(2, _state(2), blocking=False)
    second = mgr.save(3, _state(3), blocking=False)
    assert first is not None and second is not None
    assert first.done()  # the second save waited for the first
    second.result(timeout=60)
    assert mgr.steps() == [3]  # retention ran when the async save completed


def test_async_save_failure_reaches_the_future(backend: tuple[str, storage.FileSystemBase]) -> None:
    mgr = _manager(backend, keep_last=1)
    mgr.save(1, _state(1))
    fut = mgr.save(2, dict(_state(2), hook=lambda: None), blocking=False)
    assert fut is not None
    with pytest.raises(Exception, match="(?i)pickle|lambda"):
        fut.result(timeout=60)
    assert mgr.steps() == [1]
    mgr.save(3, _state(3))  # the manager stays usable
    assert mgr.steps() == [3]


def test_bad_arguments(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="keep_every needs keep_last"):
        CheckpointManager(str(tmp_path), keep_every=10)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_last"):
            CheckpointManager(str(tmp_path), keep_last=bad)
    with pytest.raises(TypeError, match="unknown CheckpointManager option"):
        CheckpointManager(str(tmp_path), thread_cont=2)
    for chosen in ("base", "fingerprint", "publish"):  # the manager sets them per save
        with pytest.raises(
            TypeError, match=rf"unknown CheckpointManager option\(s\) \['{chosen}'\]"
        ):
            CheckpointManager(str(tmp_path), **{chosen: None})
    with pytest.raises(TypeError, match="thread_count must be an int"):
        CheckpointManager(str(tmp_path), thread_count=0)  # checked once, before any save
    mgr = CheckpointManager(str(tmp_path))
    for step in (-1, True, "3", 2.0):
        with pytest.raises(ValueError, match="step must be an int"):
            mgr.save(step, _state(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace_seconds"):
        mgr.cleanup(grace_seconds=-5)


_PROCESS_EXECUTOR = """
import os, sys, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
import storage
from extensions.zstd import ZStandard


def main():
    # The store listens on a port of its own (0: the kernel picks), and the checkpoint
    # daemon joins it (DCP_USE_PREFIX_STORE) instead of a port DCP picks by
    # bind-and-close, which another process can take before the daemon listens on it.
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), DCP_USE_PREFIX_STORE="1"
    )
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    path = sys.argv[1]
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 5}
    writer = storage.CheckpointWriter(path, transforms=[ZStandard(level=1)])
    fut = dcp.async_save(state, storage_writer=writer,
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    state["w"].zero_()
    fut = getattr(fut, "upload_completion", fut)
    fut.result(timeout=240)
    out = {"w": torch.zeros(4096), "step": 0}
    storage.load(out, path)
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32)), "content"
    assert out["step"] == 5
    # The same through the one-call helper.
    state["w"] = torch.arange(4096, dtype=torch.float32)
    storage.async_save(state, path + "-helper",
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=240)
    out = {"w": torch.zeros(4096), "step": 0}
    storage.load(out, path + "-helper")
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32)), "helper content"
    print("OK", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # the checkpoint daemon process is torn down with us


if __name__ == "__main__":  # the executor spawns a process that imports this file
    main()
"""


def test_dcp_process_executor_with_our_writer(tmp_path: Any) -> None:
    script = tmp_path / "process_executor.py"
    script.write_text(textwrap.dedent(_PROCESS_EXECUTOR))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_manager_on_s3() -> None:
    from tests.support.servers import (
        boto3_client,
        create_bucket,
        list_keys,
        moto_endpoint,
        s3_options,
    )

    endpoint = moto_endpoint()
    create_bucket(endpoint, "manager-bucket")
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    mgr = CheckpointManager(
        f"s3://manager-bucket/{prefix}", keep_last=2, storage_options=s3_options(endpoint)
    )
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    assert mgr.steps() == [2, 3]
    client = boto3_client(endpoint)
    client.put_object(Bucket="manager-bucket", Key=f"{prefix}/step-4/__0_0-x.distcp", Body=b"p")
    client.put_object(Bucket="manager-bucket", Key=f"{prefix}/step-3.14/.metadata", Body=b"m")
    assert mgr.steps() == [2, 3] and mgr.latest() == 3
    assert mgr.cleanup(grace_seconds=3600) == []  # fresh: may be a save in progress
    time.sleep(1.1)  # S3 times have one-second resolution
    assert mgr.cleanup(grace_seconds=0) == [4]
    out = _blank()
    assert mgr.load(out) == 3 and torch.equal(out["w"], _state(3)["w"])
    keys = list_keys(client, "manager-bucket", prefix)
    assert not any("/step-1/" in k or "/step-4/" in k for k in keys)
    assert f"{prefix}/step-3.14/.metadata" in keys


@pytest.mark.parametrize("blocking", [True, False])
def test_retention_does_not_read_back_what_this_manager_just_saved(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """Retention opens the kept steps to find what they reference; the metadata a
    save of this manager just published is known already. Before: an asynchronous
    save read it back (0.6 s of the training process's CPU for 20,000 items)."""
    from storage.checkpoint import committed

    reads: list[str] = []
    real = committed.read_metadata_file

    def counting(fs: Any, path: str) -> Any:
        reads.append(path)
        return real(fs, path)

    monkeypatch.setattr(committed, "read_metadata_file", counting)
    mgr = CheckpointManager(tmp_path, keep_last=2, persist="thread")
    state = {"w": torch.randn(64)}
    for step in range(4):
        fut = mgr.save(step, state, blocking=blocking)
        if fut is not None:
            fut.result()
    assert mgr.steps() == [2, 3]
    assert reads == []
