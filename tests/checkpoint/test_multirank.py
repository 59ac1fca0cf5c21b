"""Two ranks with gloo on CPU: each saves its shard; load back resharded on 2 ranks and on 1;
what a load of a missing checkpoint asks of storage."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import storage
from extensions import AES256GCM, ZStandard
from storage.checkpoint import storage_format as fmt
from tests.support.distributed import gloo_group, spawn
from tests.support.scale_fs import ProbeFileSystem

WORLD = 2
KEY = bytes(range(32))  # test-only


def _transforms(chain: str) -> list[object]:
    return {"none": [], "zstd": [ZStandard()], "zstd+aes": [ZStandard(), AES256GCM(key=KEY)]}[chain]


def _keys(chain: str) -> dict[str, bytes] | None:
    return {"default": KEY} if "aes" in chain else None


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    return {
        "w": torch.randn(8, 6, generator=gen),
        "emb": torch.randn(10, 4, generator=gen).to(torch.bfloat16),
        "bias": torch.arange(6, dtype=torch.float32),
    }


def _save_worker(rank: int, store: str, path: str, chain: str) -> None:
    with gloo_group(rank, WORLD, store):
        mesh = init_device_mesh("cpu", (WORLD,))
        full = _full()
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(0)]),
            "bias": full["bias"],  # replicated plain tensor: deduplicated across ranks
            "step": 5,
        }
        storage.save(state, path, transforms=_transforms(chain))


def _load_worker(rank: int, store: str, path: str, chain: str) -> None:
    with gloo_group(rank, WORLD, store):
        mesh = init_device_mesh("cpu", (WORLD,))
        full = _full()
        # Different layout than at save time (Shard(1) instead of Shard(0)): resharding.
        state = {
            "w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(1)]),
            "emb": distribute_tensor(torch.zeros_like(full["emb"]), mesh, [Shard(1)]),
            "bias": torch.zeros(6),
            "step": 0,
        }
        storage.load(state, path, keys=_keys(chain))
        for key in ("w", "emb"):
            local = state[key]
            assert isinstance(local, DTensor)
            assert torch.equal(local.full_tensor(), full[key]), key
        assert torch.equal(state["bias"], full["bias"])
        assert state["step"] == 5


@pytest.mark.parametrize("chain", ["none", "zstd", "zstd+aes"])
def test_two_rank_save_reload_on_two_and_one(tmp_path: Path, chain: str) -> None:
    path = str(tmp_path / "ckpt")
    spawn(_save_worker, args=(str(tmp_path / "store1"), path, chain), nprocs=WORLD)
    names = sorted(os.listdir(path))
    assert ".metadata" in names
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    if "aes" in chain:  # both ranks' items bound to their save, one seal over them all
        metadata = fmt.load_metadata((Path(path) / ".metadata").read_bytes(), path)
        assert set(fmt.checkpoint_facts(metadata)[fmt.SEAL]) == {"default"}
        saves = {
            fmt.file_rank(i.relative_path): fmt.stored_item(i).save
            for i in metadata.storage_data.values()
        }
        assert set(saves) == {0, 1} and None not in saves.values()

    spawn(_load_worker, args=(str(tmp_path / "store2"), path, chain), nprocs=WORLD)

    # One process, no process group: the full tensors are assembled from both shards.
    full = _full()
    single = {
        "w": torch.zeros(8, 6),
        "emb": torch.zeros(10, 4, dtype=torch.bfloat16),
        "bias": torch.zeros(6),
        "step": 0,
    }
    storage.load(single, path, keys=_keys(chain))
    for key in ("w", "emb", "bias"):
        assert torch.equal(single[key], full[key]), key
    assert single["step"] == 5


def _missing_worker(rank: int, store: str, root: str) -> None:
    with gloo_group(rank, WORLD, store):
        target = {"w": torch.zeros(4)}
        for name, message in (("nope", "no checkpoint at"), ("empty", "not a committed")):
            fs = ProbeFileSystem()
            with pytest.raises(storage.CheckpointNotFoundError, match=message):
                storage.load(target, os.path.join(root, name), filesystem=fs)
            # The coordinator reads .metadata and lists the location once; the other
            # rank asks storage nothing, not even for its rank-local metadata.
            mine = {k: fs.requests[k] for k in ("read_bytes", "ls")}
            assert mine == ({"read_bytes": 1, "ls": 1} if rank == 0 else {"read_bytes": 0, "ls": 0})
        # A checkpoint committed by rank-local metadata still loads: the listing names
        # each rank's file, which that rank alone reads.
        writer = storage.CheckpointWriter(os.path.join(root, "local"))
        dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=writer, use_collectives=False)
        torch.distributed.barrier()
        fs = ProbeFileSystem()
        storage.load(target, os.path.join(root, "local"), filesystem=fs)
        assert torch.equal(target["w"], torch.full((4,), float(rank)))
        mine = {k: fs.requests[k] for k in ("read_bytes", "ls")}
        assert mine == ({"read_bytes": 2, "ls": 1} if rank == 0 else {"read_bytes": 1, "ls": 0})
        # Read-once (on by default on object stores) shares an item several ranks need;
        # under rank-local metadata the same key names each rank's own item, never shared.
        target["w"].zero_()
        storage.load(target, os.path.join(root, "local"), read_once=True)
        assert torch.equal(target["w"], torch.full((4,), float(rank)))


def test_missing_checkpoint_is_listed_once(tmp_path: Path) -> None:
    """Before: loading a checkpoint that does not exist listed the location on every
    rank (twice on the coordinator): the rank-local metadata fallback read and listed
    again on each rank. Now the coordinator's one listing answers every rank."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a checkpoint")
    spawn(_missing_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    fs = ProbeFileSystem()  # one process: one read, one listing
    with pytest.raises(storage.CheckpointNotFoundError, match="no checkpoint at"):
        storage.load({"w": torch.zeros(4)}, str(tmp_path / "nope"), filesystem=fs)
    assert (fs.requests["read_bytes"], fs.requests["ls"]) == (1, 1)


def _async_beside_the_job_worker(rank: int, store: str, root: str) -> None:
    import torch.distributed as dist

    # Without a group of its own the ranks hang in mismatched collectives: the timeout
    # turns that into an error.
    with gloo_group(rank, WORLD, store, timeout=datetime.timedelta(seconds=60)):
        manager = storage.CheckpointManager(root)
        state = {f"rank{rank}": torch.full((1 << 16,), float(rank))}
        for step in (1, 2):
            future = manager.save(step, state, blocking=False)
            assert future is not None
            for _ in range(50):  # the job goes on: DDP-like all-reduces on the default group
                dist.all_reduce(torch.ones(1 << 14))
            future.result()


def test_manager_async_saves_beside_the_jobs_collectives(tmp_path: Path) -> None:
    """A manager's asynchronous save runs its collectives on a group of its own. Before,
    they ran on the default group in a background thread while the job's all-reduces ran
    on it too: gloo aborted a rank ('Received data size doesn't match expected size')."""
    root = str(tmp_path / "run")
    store = str(tmp_path / "store")
    spawn(_async_beside_the_job_worker, args=(store, root), nprocs=WORLD, join=True)
    loaded = {"rank0": torch.zeros(1 << 16), "rank1": torch.zeros(1 << 16)}
    assert storage.CheckpointManager(root).load(loaded) == 2
    assert torch.equal(loaded["rank1"], torch.ones(1 << 16)) and not loaded["rank0"].any()


class _HidingStep2(storage.LocalFileSystem):
    """Local disk whose listings miss ``step-2`` (one host's lagging listing)."""

    def ls(self, path: str) -> list[str]:
        return [n for n in super().ls(path) if n != "step-2"]


def _incremental_worker(rank: int, store: str, root: str) -> None:
    with gloo_group(rank, WORLD, store, timeout=datetime.timedelta(seconds=120)):
        fs = _HidingStep2() if rank == 1 else None
        manager = storage.CheckpointManager(root, incremental=True, filesystem=fs)
        manager.save(3, {f"r{rank}": torch.full((256,), float(rank))})


def test_every_rank_references_the_base_rank_0_chose(tmp_path: Path) -> None:
    """Before: each rank chose the base of an incremental save from its own listing;
    rank 1, whose listing missed step-2 (on a root without a latest pointer, written
    before it existed), referenced step-1 while rank 0 referenced step-2, so one
    save held two bases. Rank 0 chooses now and every rank takes its choice."""
    from storage.ops.describe import describe

    root = tmp_path / "run"
    state = {f"r{r}": torch.full((256,), float(r)) for r in range(WORLD)}
    for step in (1, 2):
        storage.save(state, str(root / f"step-{step}"), fingerprint=True)
    (root / ".dcp-latest").unlink()
    spawn(_incremental_worker, args=(str(tmp_path / "store"), str(root)), nprocs=WORLD)
    refs = {r.item: r.ref for r in describe(storage.LocalFileSystem(), str(root / "step-3")).items}
    assert refs == {"r0": "step-2", "r1": "step-2"}, refs
