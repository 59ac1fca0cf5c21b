"""Node loss: 4 gloo ranks as 2 simulated nodes with ``replicate=True``; one node's ranks
are killed and its local tier deleted; the restarted job restores that node's files from
its peer and resumes from the last local commit, losing no step past it."""

from __future__ import annotations

import shutil
from pathlib import Path

from storage.ops._peers import Group
from storage.ops.restore_plan import Held, plan, read_moves
from tests.support.subprocess_jobs import Job, committed_steps


def test_a_lost_node_is_restored_from_its_peer_and_the_job_resumes(tmp_path: Path) -> None:
    local = tmp_path / "local"
    job = ["--root", str(tmp_path / "durable"), "--local", str(local), "--ranks-per-node", "2"]
    job += ["--replicate", "--save-every", "2", "--pace", "0.02"]
    run = Job(tmp_path, 4, [*job, "--steps", "1000"])
    run.wait_for(0, "@committed 6")
    run.kill([2, 3])  # node 1 dies with its tier
    shutil.rmtree(local / "node1")
    run.kill([0, 1])  # the job is restarted as a whole
    last = committed_steps(local / "node0")[-1]
    printed = [int(words[1]) for words in run.each(0, "@committed", 2)]
    assert last >= max(printed) >= 6  # every save that returned is committed on node 0
    hashes = run.hashes(0)

    resumed = Job(tmp_path, 4, [*job, "--steps", str(last + 2)])
    resumed.finish()
    loaded = resumed.one(0, "@loaded", 5)
    assert loaded[1:4] == [str(last), "local", hashes[last]]  # 0 steps lost, bit-exact
    # Each rank of node 0 sent its peer's files and its own, in parallel: node 1's ranks
    # read their own and, under DDP, the items of the model saved once by ranks 0 and 1.
    restored = {int(r): int(b) for _, r, b in (resumed.one(q, "@restored", 3) for q in range(4))}
    step_dir = local / "node1" / f"step-{last}"
    for sender, receiver in ((0, 2), (1, 3)):
        files = [*step_dir.glob(f"__{receiver}_*.distcp"), *step_dir.glob(f"__{sender}_*.distcp")]
        if sender == 0:  # and node 1's copy of the metadata, last
            files.append(step_dir / ".metadata")
        assert len(files) == 2 + (sender == 0)
        assert restored[sender] == sum(p.stat().st_size for p in files)
    assert restored[2] == restored[3] == 0
    durable = resumed.one(0, "@durable", 2)
    assert str(last + 2) in durable[1].split(",")  # and it goes on saving and draining


def test_a_restore_takes_each_rank_s_files_from_the_rank_holding_its_replica() -> None:
    group = Group(rank=0, world=4, nodes=[[0, 1], [2, 3]], peer={0: 2, 1: 3, 2: 0, 3: 1})
    names = [f"__{r}_0.distcp" for r in range(4)]
    node0 = Held(names, names, [], "s", False)  # node 0 holds every rank's files
    reports = [{5: node0}, {5: node0}, {}, {}]  # node 1 lost its tier
    chosen = plan(group, reports, [], None, lambda s: None)
    assert not isinstance(chosen, str) and chosen.step == 5
    [(step, data, meta)] = chosen.moves
    # Before: rank 0 sent rank 2's and rank 3's files (the first rank holding them) while
    # rank 1 idled.
    assert data == [(0, 2, ["__2_0.distcp"]), (1, 3, ["__3_0.distcp"])]
    assert meta == [(0, 2, [".metadata"])]
    # Ranks reading only their own files (a sharded state) need nothing else ...
    assert read_moves(group, reports, [[(5, n)] for n in names]) == {}
    # ... ranks reading every file (DDP: each replicated item saved by one rank) get the
    # other node's ranks' files too, one copy per node, pairs in parallel.
    every = [[(5, n) for n in names] for _ in range(4)]
    assert read_moves(group, reports, every) == {
        5: [(0, 2, ["__0_0.distcp"]), (1, 3, ["__1_0.distcp"])]
    }


def _announce_worker(rank: int, store: str, root: str, sizes: list[int]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from extensions.errors import CheckpointStorageError
    from storage.backends import LocalFileSystem
    from storage.ops import _peers
    from tests.support.distributed import gloo_group

    with gloo_group(rank, 2, store, timeout=datetime.timedelta(seconds=120)):
        fs = LocalFileSystem()
        names = [".metadata", "__0_0-x.distcp"]
        for size, name in zip(sizes, names):
            if rank == 0:  # a peer announcing a size no file of that kind has
                dist.send(torch.tensor([size], dtype=torch.int64), 1)
                continue
            try:
                _peers._recv_file(fs, root, name, 0, None, sync=False)
            except CheckpointStorageError as exc:
                Path(root, f"{name}.error").write_text(str(exc))


def test_a_peer_announcing_an_impossible_size_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A rank restoring from its peer trusts no size it is sent: a metadata file larger
    than any metadata, or a negative size, is refused naming the file, and nothing is
    allocated or written for it."""
    from storage.checkpoint import storage_format as fmt
    from tests.support.distributed import spawn

    sizes = [fmt.MAX_METADATA_BYTES + 1, -5]
    spawn(_announce_worker, args=(str(tmp_path / "store"), str(tmp_path), sizes), nprocs=2)
    for name, size in zip([".metadata", "__0_0-x.distcp"], sizes):
        message = (tmp_path / f"{name}.error").read_text()
        assert f"rank 0 announced {size} bytes" in message and name in message
        assert not (tmp_path / name).exists()
    assert {p.name for p in tmp_path.iterdir()} <= {
        ".metadata.error",
        "__0_0-x.distcp.error",
        "store",
    }


def _dies_after_commit_worker(rank: int, store: str, base: str) -> None:
    import datetime
    import os
    import time

    import torch
    import torch.distributed as dist

    from storage.ops import local_save
    from storage.ops.manager import CheckpointManager

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=3,
        timeout=datetime.timedelta(seconds=120),
    )
    node0 = Path(base, "node0", "step-1")
    if rank == 2:  # node 1 dies once its copy and node 0's are committed
        commit_node = local_save._commit_node

        def then_die(*args: object, **kwargs: object) -> None:
            commit_node(*args, **kwargs)  # type: ignore[arg-type]
            deadline = time.monotonic() + 60  # a test that went wrong ends by itself
            while not (node0 / ".metadata").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os._exit(0)  # before the gather that ends the save on every rank

        local_save._commit_node = then_die  # type: ignore[assignment]
    mgr = CheckpointManager(
        f"{base}/durable", local=f"{base}/node{rank // 2}", replicate=True, pace=None
    )
    try:
        mgr.save(1, {f"rank{rank}": torch.full((1000,), float(rank))})
        Path(base, f"rank{rank}.saved").touch()
    except Exception as exc:
        Path(base, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    os._exit(0)  # the group lost a rank: nothing may wait on it


def test_a_rank_whose_last_gather_fails_keeps_the_files_its_node_committed(
    tmp_path: Path,
) -> None:
    """A peer that dies after the node commits and before the gather ending the save
    fails that gather on the surviving ranks; their saves raise, but the copy their
    node's leader committed is theirs too: no rank removes its files from it, so the
    surviving node still loads the step (it did not, and a restarted job went back to
    an older step, when each rank removed its own data files from its committed node)."""
    import torch

    import storage
    from tests.support.distributed import spawn

    spawn(_dies_after_commit_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=3)
    for rank in (0, 1):  # the gather failed there: the save raised
        assert (tmp_path / f"rank{rank}.error").exists(), rank
    node0 = tmp_path / "node0" / "step-1"
    assert committed_steps(node0.parent) == [1]
    target = {f"rank{r}": torch.zeros(1000) for r in range(3)}
    storage.load(target, str(node0))  # every rank's bytes, node 1's replica included
    for r in range(3):
        assert torch.equal(target[f"rank{r}"], torch.full((1000,), float(r)))
