"""Which copy a tiered manager loads and how its local tier makes room, where the tiers
meet the other features: key prefixes, linked steps, a local copy that is another save
than the durable one, and a bucket that cannot be reached."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed as dist

from extensions.errors import CheckpointStorageError
from storage import S3FileSystem
from storage.backends._local import LocalFileSystem
from storage.ops.manager import CheckpointManager
from tests.support.distributed import gloo_group, spawn
from tests.support.servers import FaultProxy, create_bucket, moto_endpoint, s3_options
from tests.support.tiers import blank_state, step_state, tiered

BUCKET = "dcp-tier-choice"


def _prefix_dirs(step_dir: Path) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir() if p.is_dir())


# --- key prefixes ----------------------------------------------------------------


def test_prefixed_steps_load_from_the_local_tier_and_drain_with_their_prefixes(
    tmp_path: Path,
) -> None:
    # Before: the per-node report listed only the step directory, so every prefixed data
    # file looked missing and every load went to the bucket ("durable"); the drain also
    # flattened the files into the durable step (no prefixes where they matter most).
    mgr = tiered(tmp_path, key_prefixes=4)
    mgr.save(1, step_state(1))
    mgr.wait()
    target = blank_state()
    step = mgr.load(target)
    assert (step, step.tier) == (1, "local")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(1)["w"])
    assert _prefix_dirs(tmp_path / "local" / "step-1") == ["00"]
    assert _prefix_dirs(tmp_path / "durable" / "step-1") == ["00"]


class _Unlistable(LocalFileSystem):
    """A durable root that cannot be listed while the file ``flag`` exists (an outage)."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    def ls(self, path: str) -> list[str]:
        if os.path.exists(self.flag):
            raise ConnectionError(f"the root is unreachable: {path}")
        return super().ls(path)


def _prefixed_worker(rank: int, store: str, base: str) -> None:
    with gloo_group(rank, 2, store):
        node, flag = f"{base}/node{rank}", f"{base}/outage"
        mgr = CheckpointManager(
            f"{base}/durable",
            filesystem=_Unlistable(flag),
            local=node,
            replicate=True,
            key_prefixes=2,
        )
        state = {f"rank{rank}": torch.full((1 << 12,), float(rank))}
        mgr.save(1, state)
        mgr.wait()
        assert mgr.durable_steps() == [1]
        if rank == 0:
            durable = Path(base, "durable", "step-1")
            assert _prefix_dirs(durable) == ["00", "01"]
            assert [p.name[:3] for p in (durable / "01").iterdir()] == ["__1"]
            import shutil

            shutil.rmtree(f"{base}/node1")  # node 1 is lost: its files come from node 0
        dist.barrier()
        target = {f"rank{rank}": torch.zeros(1 << 12)}
        step = mgr.load(target)
        assert (step, step.tier) == (1, "local")  # type: ignore[attr-defined]
        assert torch.equal(target[f"rank{rank}"], state[f"rank{rank}"])
        # An outage: rank 0 cannot list the root. Before, rank 0 raised alone and rank 1
        # waited for its answer forever; now both load the local copy and say so.
        if rank == 0:
            open(flag, "w").close()
        dist.barrier()
        step = mgr.load(target)
        assert (step, step.tier, step.root_consulted) == (1, "local", False)  # type: ignore[attr-defined]
        expected = ConnectionError if rank == 0 else CheckpointStorageError
        with pytest.raises(expected, match="unreachable"):
            mgr.load(target, 9)


def test_two_nodes_prefixed_replicate_drain_and_restore_from_the_peer(tmp_path: Path) -> None:
    spawn(_prefixed_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)


# --- a linked step in the local tier -------------------------------------------


def test_a_linked_local_step_is_not_ours_and_never_blocks_a_save(tmp_path: Path) -> None:
    # Before: with keep_local=1, the second save raised TierFullError ("not durable
    # yet") although both steps were durable: the linked step could not be deleted, and
    # the failed delete also stopped retention from deleting the steps that could go.
    shared = CheckpointManager(tmp_path / "shared")
    shared.save(0, step_state(0))
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "step-0").symlink_to(tmp_path / "shared" / "step-0")
    mgr = tiered(tmp_path, keep_local=1)
    for step in (1, 2, 3):
        mgr.save(step, step_state(step))
        mgr.wait()
    assert mgr.tiers is not None and mgr.tiers.local.steps() == [0, 3]
    assert mgr.durable_steps() == [1, 2, 3]  # someone else's step is not drained either
    assert (tmp_path / "local" / "step-0").is_symlink()
    assert sorted(p.name for p in (tmp_path / "shared" / "step-0").iterdir())[0] == ".metadata"
    target = blank_state()
    assert mgr.load(target, 0) == 0 and torch.equal(target["w"], step_state(0)["w"])


# --- the local copy is another save ---------------------------------------------


def test_a_local_copy_of_another_save_loses_to_the_durable_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the local step 5 (another run's tier, or a re-save that was never
    # drained) was loaded silently although the durable step 5 is another save.
    CheckpointManager(tmp_path / "durable").save(5, step_state(5))
    CheckpointManager(tmp_path / "local").save(5, step_state(50))
    mgr = tiered(tmp_path)
    target = blank_state()
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        step = mgr.load(target)
    assert (step, step.tier) == (5, "durable")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(5)["w"])
    assert "another save" in caplog.text and "another save" in (step.note or "")  # type: ignore[attr-defined]


def test_the_same_save_loads_locally_after_its_drain(tmp_path: Path) -> None:
    # The drain republishes the metadata (new data file names): it must keep the save's
    # identity, or every drained step would look like another save and load remotely.
    mgr = tiered(tmp_path)
    mgr.save(5, step_state(5))
    mgr.wait()
    restarted = tiered(tmp_path)
    target = blank_state()
    step = restarted.load(target)
    assert (step, step.tier) == (5, "local")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(5)["w"])


class _Breakable(LocalFileSystem):
    """A durable root whose writes fail while ``down`` is set."""

    down = False

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "wb" and self.down:
            raise OSError(f"the root is down: {path}")
        with super().create_stream(path, mode, sync=sync) as stream:
            yield stream


def test_a_re_save_not_drained_yet_loads_locally(tmp_path: Path) -> None:
    # This manager's own re-save of step 5, whose drain has not landed: the local copy is
    # the newest truth, and the durable copy is the older save.
    root = _Breakable()
    mgr = tiered(tmp_path, filesystem=root)
    mgr.save(5, step_state(5))
    mgr.wait()
    root.down = True
    mgr.save(5, step_state(55))
    with pytest.raises(OSError, match="the root is down"):
        mgr.wait()
    target = blank_state()
    step = mgr.load(target)
    assert (step, step.tier) == (5, "local")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(55)["w"])
    # After a crash: the durable copy wins. The first manager is left with its root down,
    # as a crashed one would be: its drain, retried, would otherwise publish the new save
    # over the copy the restarted manager reads.
    restarted = tiered(tmp_path, filesystem=_Breakable())
    target = blank_state()
    step = restarted.load(target)
    assert (step, step.tier) == (5, "durable")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(5)["w"])


# --- the bucket is unreachable --------------------------------------------------


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    endpoint = moto_endpoint()
    create_bucket(endpoint, BUCKET)
    with FaultProxy(endpoint, seed=3) as p:
        yield p


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_a_bucket_outage_loads_the_newest_local_step(
    tmp_path: Path, proxy: FaultProxy, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: load() listed the bucket first and raised its error, although step 2 was
    # committed in the local tier: riding out an outage is what that tier is for.
    opts = s3_options(proxy.url, config_kwargs={"retries": {"total_max_attempts": 2}})
    bucket = S3FileSystem(storage_options=opts)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    mgr = CheckpointManager(url, filesystem=bucket, local=tmp_path / "local")
    for step in (1, 2):
        mgr.save(step, step_state(step))
    mgr.wait()
    proxy.add(fault)  # every request from now on
    target = blank_state()
    with caplog.at_level(logging.WARNING, logger="storage.ops.tiers"):
        step = mgr.load(target)
    assert (step, step.tier) == (2, "local")  # type: ignore[attr-defined]
    assert step.root_consulted is False  # type: ignore[attr-defined]
    assert "not consulted" in (step.note or "") and "not consulted" in caplog.text  # type: ignore[attr-defined]
    assert torch.equal(target["w"], step_state(2)["w"])
    assert mgr.load(blank_state(), 1).tier == "local"  # type: ignore[attr-defined]
    with pytest.raises(OSError):  # only the bucket could have step 9: its error, named
        mgr.load(blank_state(), 9)
    with contextlib.suppress(OSError):
        mgr.wait()  # the drain passes the loads queued failed too
    proxy.clear()
    step = mgr.load(blank_state())
    assert (step, step.tier, step.root_consulted) == (2, "local", True)  # type: ignore[attr-defined]


def test_loaded_step_says_the_root_was_consulted(tmp_path: Path) -> None:
    mgr = tiered(tmp_path)
    mgr.save(1, step_state(1))
    mgr.wait()
    step = mgr.load(blank_state())
    assert (step, step.tier, step.root_consulted, step.note) == (1, "local", True, None)  # type: ignore[attr-defined]


# --- one node's local commit fails --------------------------------------------------


class _RefusesMetadata(LocalFileSystem):
    """Refuses to publish a step's metadata: a clean failure (nothing was written)."""

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if path.endswith(".metadata"):
            raise PermissionError(f"{path}: read-only for this test")
        super().write_atomic(path, data, exclusive=exclusive)


def _one_node_fails_worker(rank: int, store: str, base: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    with gloo_group(rank, 2, store):
        mgr = CheckpointManager(
            f"{base}/durable",
            local=f"{base}/node{rank}",
            local_filesystem=_RefusesMetadata() if rank == 1 else None,
            replicate=True,
        )
        state = {f"rank{rank}": torch.full((1 << 12,), float(rank))}
        with pytest.raises(Exception, match="read-only for this test"):
            mgr.save(1, state)
        dist.barrier()
        if rank == 0:  # node 0's commit landed: every file it names is still there
            target = {"rank0": torch.zeros(1 << 12), "rank1": torch.zeros(1 << 12)}
            dcp.load(target, storage_reader=FileSystemReader(f"{base}/node0/step-1"), no_dist=True)
            assert torch.equal(target["rank0"], torch.full((1 << 12,), 0.0))
            assert torch.equal(target["rank1"], torch.full((1 << 12,), 1.0))


def test_a_node_whose_commit_landed_keeps_its_files_when_another_nodes_fails(
    tmp_path: Path,
) -> None:
    """Before: node 0 committed step 1, node 1's commit failed cleanly, and every rank
    then removed the files it wrote, node 0's ranks too: node 0 was left with a
    committed step whose data files were gone. A landed commit on any node now keeps
    every rank's files (node 1's uncommitted ones are gc's)."""
    spawn(_one_node_fails_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
