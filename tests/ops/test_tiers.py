"""Tiered checkpoints: local tier, background drain to the root, retention per tier,
fallback on load, restart, failures, and peer replication across simulated nodes."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed as dist

from extensions import AES256GCM
from extensions.errors import TierFullError
from storage import S3FileSystem
from storage.backends import cancel as cancelling
from storage.backends._local import LocalFileSystem
from storage.checkpoint.api import load as storage_load
from storage.checkpoint.committed import open_committed
from storage.checkpoint.deadline import DeadlineExceededError
from storage.checkpoint.layout import is_committed
from storage.ops.describe import describe
from storage.ops.manager import CheckpointManager
from tests.support.distributed import gloo_group, spawn
from tests.support.servers import (
    FaultProxy,
    boto3_client,
    create_bucket,
    list_keys,
    moto_endpoint,
    open_uploads,
    s3_options,
)
from tests.support.subprocess_jobs import kill_when_marked
from tests.support.tiers import blank_state, step_state, tiered

BUCKET = "dcp-tiers"


def _first_data_file(directory: Path) -> Path:
    return next(p for p in sorted(directory.iterdir()) if p.suffix == ".distcp")


def test_save_commits_locally_then_drains_byte_for_byte(tmp_path: Path) -> None:
    key = os.urandom(32)
    mgr = tiered(tmp_path, transforms=[AES256GCM(key=key, key_id="k")], keys={"k": key})
    mgr.save(1, step_state(1))
    assert is_committed(mgr.tiers.local.fs, str(tmp_path / "local" / "step-1"))  # type: ignore[union-attr]
    mgr.wait()
    assert mgr.durable_steps() == [1]
    local, durable = (
        describe(LocalFileSystem(), str(tmp_path / t / "step-1")) for t in ("local", "durable")
    )
    assert [(r.item, r.stored, r.transforms) for r in local.items] == [
        (r.item, r.stored, r.transforms) for r in durable.items
    ]
    assert all(any("aes" in t for t in r.transforms) for r in durable.items)  # still encrypted
    local_bytes = _first_data_file(tmp_path / "local" / "step-1").read_bytes()
    assert local_bytes == _first_data_file(tmp_path / "durable" / "step-1").read_bytes()
    target = blank_state()
    step = mgr.load(target)
    assert (step, step.tier) == (1, "local")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(1)["w"])


def test_retention_per_tier_and_listing(tmp_path: Path) -> None:
    mgr = tiered(tmp_path, keep_local=2, keep_last=3)
    for step in range(1, 6):
        mgr.save(step, step_state(step))
        mgr.wait()
    assert mgr.tiers.local.steps() == [4, 5]  # type: ignore[union-attr]
    assert mgr.durable_steps() == [3, 4, 5]
    assert mgr.steps() == [3, 4, 5] and mgr.latest() == 5
    assert {e.step: e.tiers for e in mgr.entries()} == {
        3: ("durable",),
        4: ("local", "durable"),
        5: ("local", "durable"),
    }


def test_cli_ls_shows_the_tiers_holding_each_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from storage.cli import main

    # Step 1 is durable and still local, step 2 only local (not drained yet): what a
    # crash between a tiered save and its drain leaves. ls must say where each step is.
    for tier, steps in (("durable", (1,)), ("local", (1, 2))):
        for step in steps:
            mgr = CheckpointManager(tmp_path / tier)
            mgr.save(step, step_state(step))
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    assert main(["ls", root, "--local", local, "--json"]) == 0
    rows = {c["name"]: c["tiers"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows == {"step-1": ["local", "durable"], "step-2": ["local"]}
    assert main(["ls", root, "--local", local]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "TIERS" and lines[2].split()[-1] == "local"


def test_local_copies_stay_until_durable(tmp_path: Path) -> None:
    # The root cannot be written (a plain file stands where its directory should be):
    # every drain fails, so nothing may leave the local tier.
    (tmp_path / "durable").write_text("not a directory")
    mgr = tiered(tmp_path, keep_local=1)
    mgr.save(1, step_state(1))
    with pytest.raises(OSError):
        mgr.wait()
    mgr.save(2, step_state(2))  # the error was surfaced already; this save's drain fails too
    with pytest.raises(OSError):
        mgr.wait()
    with pytest.raises(TierFullError, match=r"holds steps \[1, 2\], more than keep_local=1"):
        mgr.save(3, step_state(3))
    assert mgr.tiers.local.steps() == [1, 2]  # type: ignore[union-attr]
    assert {e.step: e.tiers for e in mgr.entries()} == {1: ("local",), 2: ("local",)}


def test_corrupted_local_copy_falls_back_to_durable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = tiered(tmp_path)
    mgr.save(3, step_state(3))
    mgr.wait()
    data = _first_data_file(tmp_path / "local" / "step-3")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = blank_state()
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        step = mgr.load(target)
    assert (step, step.tier) == (3, "durable")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(3)["w"])
    assert "loading the durable copy" in caplog.text and "IntegrityError" in caplog.text


def test_restart_drains_what_is_only_local(tmp_path: Path) -> None:
    (tmp_path / "durable").write_text("down")
    crashed = tiered(tmp_path)
    crashed.save(7, step_state(7))
    with pytest.raises(OSError):
        crashed.wait()
    (tmp_path / "durable").unlink()  # the bucket is back; the job restarts
    restarted = tiered(tmp_path)
    restarted.wait()
    assert restarted.durable_steps() == [7]
    assert restarted.load(blank_state()) == 7


def test_a_restarted_tier_prunes_a_step_only_where_the_root_holds_its_own_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a restart, the local steps drained by the process before are pruned once
    the root's ``.metadata`` is read back and found to be a copy of the local step's
    save. Before, the root's ``.metadata`` existing was enough: a root holding another
    save's checkpoint at that step (here step 2's metadata put at step-1) let local
    retention delete the only copy of step 1. Now step 1 stays local, with a warning
    naming the step, the root and the saves; step 2, a copy of its save, goes."""
    first = tiered(tmp_path)
    for step in (1, 2, 3):
        first.save(step, step_state(step))
    first.wait()
    durable = tmp_path / "durable"
    shutil.copyfile(durable / "step-2" / ".metadata", durable / "step-1" / ".metadata")
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        restarted = tiered(tmp_path, keep_local=1)  # its first drain pass prunes
        restarted.wait()
    assert restarted.tiers is not None and restarted.tiers.local.steps() == [1, 3]
    (warning,) = [r.getMessage() for r in caplog.records if "step 1 at" in r.getMessage()]
    assert str(durable / "step-1") in warning and "it holds a copy of save" in warning


_KILLED_AFTER_ITS_DATA = """
import sys
from pathlib import Path
from tests.support.subprocess_jobs import park_on_rm_file
from tests.support.tiers import step_state, tiered
park_on_rm_file("/local/step-2/.heartbeat-", sys.argv[2])  # its data files written, whole
mgr = tiered(Path(sys.argv[1]), keep_local=1, persist="thread")
mgr.save(1, step_state(1))
mgr.wait()
mgr.save(2, step_state(2))
"""


def test_a_restarted_tier_removes_what_a_killed_save_left_in_the_local_tier(
    tmp_path: Path,
) -> None:
    """kill -9 of the training process after a local save wrote its data files, before
    its metadata: the files are a copy of the rank's state in the local tier (tmpfs:
    memory). Before, nothing ever removed them: `cleanup` and `gc` look at the root
    only, and local retention deletes committed steps only (and later saves of step 2
    left them beside their own files, where deleting the step leaves them too). Now the
    local tier's leader removes them once they are older than an hour (checked at the
    restart and at most every ten minutes after)."""
    mark = tmp_path / "parked"
    kill_when_marked(
        _KILLED_AFTER_ITS_DATA, [str(tmp_path), str(mark)], mark, "the end of the save's data files"
    )
    left = tmp_path / "local" / "step-2"
    data = [p for p in left.iterdir() if p.name.endswith(".distcp")]
    assert data and not (left / ".metadata").exists()
    # An hour later: the writer's heartbeat says when it last beat, the files their age.
    hour_ago = time.time() - 3700
    for beat in left.glob(".heartbeat-*"):
        beat.write_text(json.dumps({"time": hour_ago}))
    for entry in left.iterdir():
        os.utime(entry, (hour_ago, hour_ago))
    restarted = tiered(tmp_path, keep_local=1, persist="thread")
    restarted.wait()
    assert not left.exists()
    assert restarted.steps() == [1]
    restarted.save(2, step_state(2))
    restarted.wait()
    assert restarted.load(blank_state()) == 2 and restarted.durable_steps() == [1, 2]


def test_incremental_tier_never_bases_on_a_linked_local_step(tmp_path: Path) -> None:
    # A base is recorded by the name of the step that holds its bytes, and one that
    # resolves outside its directory is refused: a linked local step
    # (a shared checkpoint linked in) must not be picked as a base, or every save fails.
    shared = tmp_path / "shared" / "pretrained"
    CheckpointManager(shared.parent).save(0, step_state(0))
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "step-0").symlink_to(shared.parent / "step-0")
    mgr = tiered(tmp_path, incremental=True)
    mgr.save(1, step_state(1))
    mgr.save(2, step_state(1))
    mgr.wait()
    assert _refs(tmp_path / "local", 1) == set()
    assert _refs(tmp_path / "local", 2) == {"step-1"}
    assert mgr.load(blank_state()) == 2


class _FullDisk(LocalFileSystem):
    """Our local backend, out of space once ``full`` is set."""

    full = False

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "wb" and self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        with super().create_stream(path, mode, sync=sync) as stream:
            yield stream


def test_full_local_tier_is_a_named_error_and_deletes_nothing(tmp_path: Path) -> None:
    disk = _FullDisk()
    mgr = tiered(tmp_path, keep_local=1, local_filesystem=disk)
    mgr.save(1, step_state(1))
    mgr.wait()
    disk.full = True
    with pytest.raises(TierFullError, match="local tier .* is full"):
        mgr.save(2, step_state(2))
    assert mgr.tiers.local.steps() == [1] and mgr.durable_steps() == [1]  # type: ignore[union-attr]
    assert not (tmp_path / "local" / "step-2").exists() or not any(
        (tmp_path / "local" / "step-2").iterdir()
    )


class _PublishDisk(LocalFileSystem):
    """Our local backend, whose metadata publish fails as ``how`` says: ``"lost"``
    publishes, then raises as if the answer had been lost; ``"refused"`` raises without
    publishing; ``"stalled"`` waits ``STALL`` seconds first (or until the save's deadline
    cancels it)."""

    STALL = 20.0
    how: str | None = None

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        how = self.how if path.endswith(".metadata") else None
        if how == "refused":
            raise ConnectionResetError("refused before the metadata landed")
        if how == "stalled":
            cancel = cancelling.current()
            if cancel is None:  # no deadline runs the publish: it just takes long
                time.sleep(self.STALL)
            else:
                cancel.wait(self.STALL)
        super().write_atomic(path, data, exclusive=exclusive)
        if how == "lost":
            raise ConnectionResetError("response lost after the metadata landed")


def test_local_commit_that_landed_but_raised_keeps_its_files(tmp_path: Path) -> None:
    # Before: the tier's local publish had no "may have landed" rule: the writer's
    # abort removed the step's data files under the metadata that had landed, leaving
    # a committed local step that did not load.
    disk = _PublishDisk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    disk.how = "lost"
    with pytest.raises(ConnectionResetError):
        mgr.save(1, step_state(1))
    disk.how = None
    target = blank_state()
    storage_load(target, str(tmp_path / "local" / "step-1"))  # the local copy is whole
    torch.testing.assert_close(target["w"], step_state(1)["w"])


def test_local_commit_refused_removes_the_steps_files(tmp_path: Path) -> None:
    disk = _PublishDisk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    disk.how = "refused"
    with pytest.raises(ConnectionResetError):
        mgr.save(1, step_state(1))
    mgr.wait()
    assert mgr.tiers.local.steps() == [] and mgr.durable_steps() == []  # type: ignore[union-attr]
    assert not any((tmp_path / "local" / "step-1").iterdir())


def test_local_commit_is_bounded_by_the_save_timeout(tmp_path: Path) -> None:
    # Before: the writer's timeout bounded the tier's data writes but not its local
    # publish, so a stalled publish held the save for as long as it stalled.
    disk = _PublishDisk()
    mgr = tiered(tmp_path, local_filesystem=disk, timeout=1.0)
    disk.how = "stalled"
    with pytest.raises(DeadlineExceededError):
        mgr.save(1, step_state(1))
    assert mgr.tiers.local.steps() == []  # type: ignore[union-attr]


# --- asynchronous saves ------------------------------------------------------------------


class _GatedDisk(LocalFileSystem):
    """Our local backend, whose data file writes wait until ``gate`` is set (``arrived``
    is set once one got there)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.arrived = threading.Event()

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "wb" and path.endswith(".distcp"):
            self.arrived.set()
            assert self.gate.wait(300), "the test never opened the gate"
        with super().create_stream(path, mode, sync=sync) as stream:
            yield stream


def test_async_save_stages_commits_locally_then_drains(tmp_path: Path) -> None:
    disk = _GatedDisk()
    mgr = tiered(tmp_path, local_filesystem=disk)
    state = step_state(1)
    expected = state["w"].clone()
    disk.gate.clear()
    future = mgr.save(1, state, blocking=False)
    assert future is not None and not future.done()  # staged; the write waits for the gate
    state["w"].zero_()  # training goes on: the staged copy is what gets saved
    assert mgr.tiers is not None and mgr.tiers.local.steps() == []
    disk.gate.set()
    future.result(timeout=120)
    assert mgr.tiers.local.steps() == [1]
    mgr.wait()
    assert mgr.durable_steps() == [1]
    for tier in ("local", "durable"):
        target = blank_state()
        storage_load(target, tmp_path / tier / "step-1")
        assert torch.equal(target["w"], expected)


def test_async_save_waits_for_the_previous_local_commit(tmp_path: Path) -> None:
    disk = _GatedDisk()
    mgr = tiered(tmp_path, local_filesystem=disk, keep_local=1)
    disk.gate.clear()
    first = mgr.save(1, step_state(1), blocking=False)
    second: list[Any] = []
    thread = threading.Thread(
        target=lambda: second.append(mgr.save(2, step_state(2), blocking=False))
    )
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not second  # at most one save in flight
    disk.gate.set()
    thread.join(120)
    assert first is not None and first.done() and first.exception() is None
    second[0].result(timeout=120)
    mgr.wait()
    assert mgr.durable_steps() == [1, 2]
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [2]


class _CountingDisk(_GatedDisk):
    """A gated local tier that counts the bytes read through ``open_slice`` (the drain)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self._count_lock = threading.Lock()

    @contextlib.contextmanager
    def open_slice(self, path: str, offset: int, length: int) -> Iterator[IO[bytes]]:
        with super().open_slice(path, offset, length) as stream:
            disk = self

            class Counted(io.RawIOBase):
                def readable(self) -> bool:
                    return True

                def readinto(self, buffer: Any) -> int:
                    n = stream.readinto(buffer) or 0  # type: ignore[attr-defined]
                    with disk._count_lock:
                        disk.read += n
                    return n

            yield Counted()  # type: ignore[misc]


class _HeldDisk(LocalFileSystem):
    """A durable tier whose data file writes wait while ``held`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        with super().create_stream(path, mode, sync=sync) as stream:
            if mode == "wb" and path.endswith(".distcp"):
                write = stream.write

                def held(data: Any) -> int:
                    deadline = time.monotonic() + 300  # bounds a failure only
                    while self.held.is_set() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    return write(data)

                stream.write = held  # type: ignore[method-assign]
            yield stream


def test_the_drain_pauses_while_a_save_writes_locally(tmp_path: Path) -> None:
    # The drain's writes are held until the save is at its gate: a drain slowed by a
    # clock instead could finish before the save began where this thread was held a
    # while (a loaded machine), and one left to run at full speed copies all 16 MiB.
    local = _CountingDisk()
    durable = _HeldDisk()
    durable.held.set()
    mgr = CheckpointManager(
        tmp_path / "durable",
        filesystem=durable,
        local=tmp_path / "local",
        local_filesystem=local,
    )
    big = {"w": torch.randn(4 << 20), "meta": {"step": 1}}  # 16 MiB
    mgr.save(1, big)  # its drain starts now, held at its first write
    local.gate.clear()
    local.arrived.clear()
    future = mgr.save(2, step_state(2), blocking=False)  # writing: blocked at the gate
    assert future is not None
    assert local.arrived.wait(120), "the save never wrote"  # the drain is paused now
    before = local.read
    durable.held.clear()  # the drain may go on: it is paused only by the save
    time.sleep(0.5)
    # At most the read in progress when the save began (1 MiB per copy thread) lands.
    assert local.read - before <= 8 << 20
    assert not is_committed(mgr.fs, mgr.step_path(1))  # the drain is paused, not done
    local.gate.set()
    future.result(timeout=120)
    mgr.wait()
    assert mgr.durable_steps() == [1, 2]
    assert local.read >= 16 << 20


def _drained(mgr: CheckpointManager) -> None:
    # The last queued drain pass has run; unlike wait(), raises nothing, so its error is
    # left for the next save to surface.
    assert mgr.tiers is not None
    mgr.tiers.finish_commit()
    mgr.tiers.drains.wait()


def test_async_save_errors_and_recovery(tmp_path: Path) -> None:
    # A failed local commit goes to that save's future; a failed drain is raised by the
    # next save before it stages anything; a tier over keep_local retries the drain,
    # then names the problem; once the bucket is back, the next save drains everything.
    (tmp_path / "durable").write_text("the bucket is down")
    disk = _FullDisk()
    mgr = tiered(tmp_path, keep_local=1, local_filesystem=disk)
    assert mgr.tiers is not None
    disk.full = True
    failed = mgr.save(1, step_state(1), blocking=False)
    assert failed is not None
    with pytest.raises(TierFullError, match="local tier .* is full"):
        failed.result(timeout=120)
    disk.full = False
    for step in (1, 2):
        mgr.save(step, step_state(step), blocking=False).result(timeout=120)  # type: ignore[union-attr]
        _drained(mgr)
        with pytest.raises(OSError):
            mgr.save(step + 1, step_state(step + 1), blocking=False)  # before anything is staged
        assert mgr.tiers.local.steps() == list(range(1, step + 1))
    with pytest.raises(TierFullError, match=r"holds steps \[1, 2\], more than keep_local=1"):
        mgr.save(3, step_state(3), blocking=False)
    assert mgr.tiers.local.steps() == [1, 2]
    (tmp_path / "durable").unlink()  # the bucket is back
    mgr.save(3, step_state(3), blocking=False).result(timeout=120)  # type: ignore[union-attr]
    mgr.wait()
    assert mgr.durable_steps() == [1, 2, 3]
    assert mgr.tiers.local.steps() == [3]


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint, seed=7) as p:
        yield p


def test_drain_failure_stays_local_surfaces_and_retries(tmp_path: Path, proxy: FaultProxy) -> None:
    prefix = f"{uuid.uuid4().hex}/run"
    opts = s3_options(proxy.url, config_kwargs={"retries": {"total_max_attempts": 2}})
    bucket = S3FileSystem(storage_options=opts, part_size=5 << 20)
    big = {"w": torch.randn(3 << 19), "meta": {"step": 1}}  # 6 MiB: a multipart upload
    mgr = CheckpointManager(f"s3://{BUCKET}/{prefix}", filesystem=bucket, local=tmp_path / "l")
    proxy.add("503", method="PUT")  # a 503 storm on every upload
    mgr.save(1, big)  # returns: the local commit does not wait for the bucket
    with pytest.raises(OSError):
        mgr.wait()
    assert mgr.tiers.local.steps() == [1] and mgr.durable_steps() == []  # type: ignore[union-attr]
    s3 = boto3_client(moto_endpoint())
    assert list_keys(s3, BUCKET, prefix) == [] and open_uploads(s3, BUCKET, prefix) == []
    proxy.clear()
    mgr.save(2, step_state(2))
    mgr.wait()  # the retry drained step 1 as well
    assert mgr.durable_steps() == [1, 2]
    assert open_uploads(s3, BUCKET, prefix) == []


# --- four ranks, two simulated nodes ---------------------------------------------------

WORLD = 4


class _LosesRank3(LocalFileSystem):
    """A node-local tier whose reads of rank 3's data files fail once ``broken`` exists."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    def open_slice(self, path: str, offset: int, length: int) -> Any:
        if os.path.exists(self.flag) and os.path.basename(path).startswith("__3_"):
            raise FileNotFoundError(path)
        return super().open_slice(path, offset, length)


def _tier_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, WORLD, store):
        node = f"{base}/node{rank // 2}"
        flag = f"{base}/broken"
        mgr = CheckpointManager(
            f"{base}/durable",
            local=node,
            replicate=True,
            local_filesystem=_LosesRank3(flag),
        )
        state = {f"rank{rank}": torch.full((1000,), float(rank))}
        mgr.save(1, state)
        mgr.wait()
        own = sum(
            os.path.getsize(f"{node}/step-1/{n}")
            for n in os.listdir(f"{node}/step-1")
            if n.startswith(f"__{rank}_")
        )
        assert mgr.tiers is not None and mgr.tiers.replicated_bytes == own  # 1.00x per replica
        if rank == 0:
            names = os.listdir(f"{base}/durable/step-1")
            assert ".metadata" in names and {n[:4] for n in names if n.endswith(".distcp")} == {
                f"__{r}_" for r in range(WORLD)
            }
            open(flag, "w").close()
        dist.barrier()
        # Rank 3 cannot read its files: no rank's files may be committed in the bucket.
        mgr.save(2, state)
        with pytest.raises(Exception, match="rank 3|__3_"):
            mgr.wait()
        dist.barrier()
        if rank == 0:
            assert not os.path.exists(f"{base}/durable/step-2/.metadata")
            leftovers = (
                os.listdir(f"{base}/durable/step-2")
                if os.path.isdir(f"{base}/durable/step-2")
                else []
            )
            assert [n for n in leftovers if n.endswith(".distcp")] == []
            os.remove(flag)
            shutil.rmtree(f"{base}/node1")  # node 1 is lost before step 2 is durable
        dist.barrier()
        target = {f"rank{rank}": torch.zeros(1000)}
        step = mgr.load(target)
        assert (step, step.tier) == (2, "local")  # type: ignore[attr-defined]
        assert torch.equal(target[f"rank{rank}"], state[f"rank{rank}"])
        mgr.wait()  # with node 1 restored from its peer, the retry drains step 2
        assert mgr.durable_steps() == [1, 2]


def test_four_ranks_two_nodes_replicate_drain_and_restore(tmp_path: Path) -> None:
    spawn(_tier_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)


def _async_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store):
        node = f"{base}/node{rank}"
        mgr = CheckpointManager(f"{base}/durable", local=node, replicate=True)
        state = {f"rank{rank}": torch.full((1 << 16,), float(rank))}
        future = mgr.save(1, state, blocking=False)
        assert future is not None
        state[f"rank{rank}"].fill_(-1.0)  # the staged copy is saved, not this
        total = torch.zeros(1)
        for _ in range(20):  # the job's own collectives, while the commit runs behind
            total += 1
            dist.all_reduce(total)
        future.result(timeout=60)
        mgr.save(2, {f"rank{rank}": torch.full((1 << 16,), 2.0 + rank)}, blocking=False)
        mgr.wait()  # the commit of step 2, then the drains
        assert mgr.durable_steps() == [1, 2]
        peer = f"{base}/node{1 - rank}/step-1"
        assert any(n.startswith(f"__{rank}_") for n in os.listdir(peer))  # the replica
        target = {f"rank{rank}": torch.zeros(1 << 16)}
        step = mgr.load(target, 1)
        assert (step, step.tier) == (1, "local")  # type: ignore[attr-defined]
        assert torch.equal(target[f"rank{rank}"], torch.full((1 << 16,), float(rank)))


def test_two_ranks_async_saves_replicate_and_drain(tmp_path: Path) -> None:
    spawn(_async_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


# --- incremental saves in both tiers ------------------------------------------------------

FROZEN = torch.arange(4096, dtype=torch.float32)  # the same at every step: referenced


def _incr_state(step: int) -> dict[str, Any]:
    return {"frozen": FROZEN.clone(), **step_state(step)}


def _incr_blank() -> dict[str, Any]:
    return {"frozen": torch.zeros(4096), **blank_state()}


def _refs(root: Path, step: int) -> set[str]:
    return set(open_committed(LocalFileSystem(), str(root / f"step-{step}")).references())


def _own_bytes(root: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (root / f"step-{step}").glob("*.distcp"))


def test_incremental_tiered_references_in_both_tiers_and_retention_keeps_bases(
    tmp_path: Path,
) -> None:
    mgr = tiered(tmp_path, incremental=True, keep_local=2, keep_last=2)
    local, durable = tmp_path / "local", tmp_path / "durable"
    for step in range(1, 5):
        mgr.save(step, _incr_state(step))
        mgr.wait()
    # Step 1 is the full save every later one references (the frozen tensor): each tier
    # keeps it beside the steps its retention keeps, and the drain kept the references.
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [1, 3, 4]
    assert mgr.durable_steps() == [1, 3, 4]
    for root in (local, durable):
        assert _refs(root, 4) == {"step-1"} and _refs(root, 1) == set()
        assert _own_bytes(root, 4) < _own_bytes(root, 1)
    for root in (local, durable):  # each tier's copy loads alone (plain storage.load)
        target = _incr_blank()
        storage_load(target, root / "step-4")
        assert torch.equal(target["frozen"], FROZEN) and torch.equal(
            target["w"], step_state(4)["w"]
        )
    mgr.save(5, _incr_state(5))  # the base does not count against keep_local
    mgr.wait()
    assert mgr.tiers.local.steps() == [1, 4, 5] and mgr.durable_steps() == [1, 4, 5]
    target = _incr_blank()
    step = mgr.load(target)
    assert (step, step.tier) == (5, "local")  # type: ignore[attr-defined]
    assert torch.equal(target["frozen"], FROZEN) and torch.equal(target["w"], step_state(5)["w"])
    # The local base is damaged: the load falls back to the durable copy, whose own base
    # is intact.
    data = _first_data_file(local / "step-1")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = _incr_blank()
    step = mgr.load(target)
    assert (step, step.tier) == (5, "durable")  # type: ignore[attr-defined]
    assert torch.equal(target["frozen"], FROZEN) and torch.equal(target["w"], step_state(5)["w"])


def test_incremental_tiered_drains_bases_first_and_copies_what_the_root_lacks(
    tmp_path: Path,
) -> None:
    (tmp_path / "durable").write_text("the bucket is down")
    mgr = tiered(tmp_path, incremental=True, full_every=2)
    for step in (1, 2, 3, 4):
        with contextlib.suppress(OSError):  # an earlier drain's error; committed locally
            mgr.save(step, _incr_state(step))
    with pytest.raises(OSError):
        mgr.wait()
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [1, 2, 3, 4]
    local, durable = tmp_path / "local", tmp_path / "durable"
    # full_every=2: every other save is a full one.
    assert [_refs(local, s) for s in (1, 2, 3, 4)] == [set(), {"step-1"}, set(), {"step-3"}]
    (tmp_path / "durable").unlink()  # back: the backlog drains oldest first, bases first
    mgr.save(5, _incr_state(5))
    mgr.wait()
    assert mgr.durable_steps() == [1, 2, 3, 4, 5]
    assert [_refs(durable, s) for s in (1, 2, 3, 4, 5)] == [
        set(),
        {"step-1"},
        set(),
        {"step-3"},
        set(),
    ]
    # The root's step-3 is replaced behind the manager's back (other bytes): the next
    # drain of step 4 cannot reference it, so its durable copy takes the bytes.
    mgr.delete(5)
    mgr.delete(4)
    CheckpointManager(durable).save(3, {"frozen": FROZEN + 1, **step_state(3)})
    mgr.save(6, _incr_state(6))  # its drain pass drains step 4 again, then step 6
    mgr.wait()
    assert mgr.durable_steps() == [1, 2, 3, 4, 5, 6]  # 5 is still local: drained again
    assert _refs(local, 4) == {"step-3"} and _refs(durable, 4) == set()
    target = _incr_blank()
    storage_load(target, durable / "step-4")
    assert torch.equal(target["frozen"], FROZEN) and torch.equal(target["w"], step_state(4)["w"])


def _incremental_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store):
        node = f"{base}/node{rank}"
        mgr = CheckpointManager(f"{base}/durable", local=node, replicate=True, incremental=True)
        frozen = torch.full((1 << 14,), 7.0 + rank)
        for step in (1, 2):
            mgr.save(step, {f"frozen{rank}": frozen, f"w{rank}": torch.full((64,), float(step))})
        mgr.wait()
        for root in (f"{base}/node0", f"{base}/node1", f"{base}/durable"):
            assert open_committed(LocalFileSystem(), f"{root}/step-2").references() == {"step-1"}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{base}/node1")  # node 1 is lost: steps 1 and 2 come from node 0
        dist.barrier()
        target = {f"frozen{rank}": torch.zeros(1 << 14), f"w{rank}": torch.zeros(64)}
        step = mgr.load(target)
        assert (step, step.tier) == (2, "local")  # type: ignore[attr-defined]
        assert torch.equal(target[f"frozen{rank}"], frozen)
        assert torch.equal(target[f"w{rank}"], torch.full((64,), 2.0))
        assert sorted(os.listdir(f"{base}/node1")) == ["step-1", "step-2"]


def test_two_nodes_incremental_replicas_restore_the_base_first(tmp_path: Path) -> None:
    spawn(_incremental_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


# --- an incremental base the local tier cannot use: a full save, as at the root ----------


def _break(step_dir: Path, how: str) -> None:
    if how == "unreadable":
        (step_dir / ".metadata").write_bytes(b"not metadata")
    elif how == "missing":
        _first_data_file(step_dir).unlink()
    else:  # committed only by rank-local metadata
        (step_dir / ".metadata").rename(step_dir / "__0.metadata")


@pytest.mark.parametrize("how", ["unreadable", "missing", "rank-local"])
def test_incremental_tiered_save_over_an_unusable_local_base_is_a_full_save(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest local step cannot be a base (its metadata cannot be read, a data file
    of it is missing, or only rank-local metadata commits it): the save is a full one
    and says why, as a save to the root alone is. Before, the tiered save failed (the
    unreadable metadata's error, "lost ... during the save", or "committed only by
    rank-local metadata")."""
    mgr = tiered(tmp_path, incremental=True)
    mgr.save(1, step_state(1))
    mgr.wait()
    _break(tmp_path / "local" / "step-1", how)
    with caplog.at_level(logging.INFO, logger="storage.ops.tiers"):
        mgr.save(2, step_state(1))  # the same values: every item would be referenced
        mgr.wait()
    assert "step 2 is saved in full: step 1 is no base" in caplog.text
    assert _refs(tmp_path / "local", 2) == set() and _refs(tmp_path / "durable", 2) == set()
    target = blank_state()
    assert mgr.load(target, 2) == 2 and torch.equal(target["w"], step_state(1)["w"])


def _other_saves_worker(rank: int, store: str, base: str) -> None:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("storage.ops.tiers").addHandler(handler)
    logging.getLogger("storage.ops.tiers").setLevel(logging.INFO)
    with gloo_group(rank, 2, store):
        node = f"{base}/node{rank}"
        mgr = CheckpointManager(f"{base}/durable", local=node, replicate=True, incremental=True)
        mgr.save(2, {f"frozen{rank}": torch.full((1 << 12,), 7.0 + rank)})
        mgr.wait()
        for root in (f"{base}/node0", f"{base}/node1", f"{base}/durable"):
            assert open_committed(LocalFileSystem(), f"{root}/step-2").references() == set()
        if rank == 0:
            assert any("step 1 is no base (the nodes' local copies" in s for s in said), said
        target = {f"frozen{rank}": torch.zeros(1 << 12)}
        assert mgr.load(target) == 2
        assert torch.equal(target[f"frozen{rank}"], torch.full((1 << 12,), 7.0 + rank))


def test_two_nodes_whose_base_copies_are_other_saves_save_in_full(tmp_path: Path) -> None:
    """Each node's local step 1 is committed, with the same content, but by another
    save (other data file names): a reference recorded from one node's copy names files
    the other node lacks, so the save is a full one and says why. Before, the commit
    failed on the node whose copy lacked the referenced files."""
    state = {f"frozen{r}": torch.full((1 << 12,), 7.0 + r) for r in range(2)}
    for rank in range(2):
        CheckpointManager(tmp_path / f"node{rank}", incremental=True).save(1, state)
    spawn(_other_saves_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


class _GatedRoot(LocalFileSystem):
    """Our local backend as a root whose writes into ``step-N`` wait for ``gates[N]``."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = {1: threading.Event(), 2: threading.Event()}

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        for step, gate in self.gates.items():
            if f"step-{step}/" in path:
                assert gate.wait(120), f"gate of step {step} never opened"
        with super().create_stream(path, mode, sync=sync) as stream:
            yield stream


def test_a_save_that_needs_room_waits_for_the_oldest_drain_only(tmp_path: Path) -> None:
    """Before, a save whose local tier was over keep_local waited for every queued
    drain, the steps saved after the one it needed durable included: with a slow root
    its stall was the drain of the whole backlog, not of the oldest step."""
    root = _GatedRoot()
    mgr = CheckpointManager(
        tmp_path / "durable",
        filesystem=root,
        local=tmp_path / "local",
        keep_local=1,
        persist="thread",
    )
    try:
        mgr.save(1, step_state(1))
        mgr.save(2, step_state(2))  # both wait for their drains: steps 1 and 2 are local
        saving = threading.Thread(target=mgr.save, args=(3, step_state(3)))
        saving.start()
        root.gates[1].set()  # step 1 may drain now; step 2 stays behind its gate
        saving.join(100)
        assert not saving.is_alive(), "the save waited for step 2's drain too"
        assert not root.gates[2].is_set()
        assert mgr.durable_steps() == [1]
    finally:
        for gate in root.gates.values():
            gate.set()
        saving.join(120)
    mgr.wait()
    assert mgr.durable_steps() == [1, 2, 3]
