"""Read-once loads where the default process group cannot send CPU tensors (an
NCCL-only job), and read-once's pipeline of batches.

There is no GPU here, so the NCCL-only default group is played by a backend that
serves CUDA tensors only: registered with torch's public
``Backend.register_backend(..., devices=["cuda"])`` (it is gloo underneath, but torch
routes only CUDA tensors to it). On it, as on NCCL, a collective of CPU tensors fails
("No backend type associated with device type cpu") and object collectives try CUDA.
DCP's own collectives run on a gloo group the test passes to ``dcp.load`` (on a real
NCCL job they run on CUDA); the reader's ``process_group`` is left at the default
group, so anything of ours that sent a CPU tensor over it would fail the load.

What this cannot show: NCCL's own behaviour (its communicator setup, CUDA streams), nor
that creating the gloo group next to a live NCCL communicator is free of side effects.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import storage
from storage.checkpoint import read_once as sharing
from storage.checkpoint import share_groups
from tests.support.distributed import spawn
from tests.support.scale_fs import ProbeFileSystem

WORLD = 4


def _cuda_only(store: Any, rank: int, world: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _state() -> dict[str, torch.Tensor]:
    """16 replicated items of 8 KiB."""
    gen = torch.Generator().manual_seed(3)
    return {f"t{i:02d}": torch.randn(32, 64, generator=gen) for i in range(16)}


class _RemoteProbe(ProbeFileSystem):
    """Reads counted as an object store's: read-once is on by default."""

    local_reads = False


def _load(path: str, group: Any, **options: Any) -> tuple[dict[str, torch.Tensor], int]:
    """A load of the replicated state into zeros; the bytes all ranks fetched. One
    target is not contiguous, so its chunk travels through a buffer, not in place."""
    probe = _RemoteProbe if options.pop("remote", False) else ProbeFileSystem
    fs = probe(**options.pop("probe", {}))
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    target["t05"] = torch.zeros(64, 32).t()
    reader = storage.CheckpointReader(path, filesystem=fs, **options)
    dcp.load(target, storage_reader=reader, process_group=group)
    fetched = torch.tensor([fs.data_bytes])
    dist.all_reduce(fetched, group=group)
    return target, int(fetched)


def _worker(rank: int, store: str, path: str) -> None:
    dist.Backend.register_backend("cudaonly", _cuda_only, devices=["cuda"])
    dist.init_process_group("cudaonly", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        with pytest.raises(RuntimeError, match="device type cpu"):
            dist.all_reduce(torch.ones(1))  # the default group refuses CPU tensors
        dcp_group = dist.new_group(backend="gloo")
        state = _state()
        md = storage.CheckpointReader(path).read_metadata()
        stored = sum(info.length for info in md.storage_data.values())

        # On by default for a remote backend: the exchange group can be made.
        assert storage.CheckpointReader("memory://x/ckpt").read_once
        # Eight batches (read-once's pipeline), fetched ahead of the exchange.
        sharing.BATCH_BYTES = sharing.MIN_BATCH_BYTES = 16 << 10
        target, fetched = _load(path, dcp_group, read_once=True)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        assert fetched == stored  # each stored byte fetched by one rank
        made = share_groups.exchange_group(None)
        assert dist.get_backend(made) == "gloo"
        assert dist.get_process_group_ranks(made) == list(range(WORLD))
        target, fetched = _load(path, dcp_group, read_once=True)
        assert all(torch.equal(target[k], v) for k, v in state.items()) and fetched == stored
        assert share_groups.exchange_group(None) is made  # made once, not per load

        # A rank that fails in the pipeline is named on every rank.
        with pytest.raises(CheckpointException, match="rank 2: loading item 't"):
            _load(path, dcp_group, read_once=True, probe={"fail": (2, "read")})

        # A subgroup without gloo: off by default, and read_once=True says what to do.
        sub = dist.new_group([0, 1], backend="cudaonly")
        sub_dcp = dist.new_group([0, 1], backend="gloo")
        if rank in (0, 1):
            assert not storage.CheckpointReader("memory://x/ckpt", process_group=sub).read_once
            with pytest.raises(CheckpointException, match="pass a gloo group"):
                _load(path, sub_dcp, read_once=True, process_group=sub)
            target, fetched = _load(path, sub_dcp, process_group=sub)
            assert all(torch.equal(target[k], v) for k, v in state.items())
            assert fetched == 2 * stored  # local disk: read_once is off by default
            # dcp.load on a subgroup, the reader's group left at the default group: the
            # exchange would wait for ranks 2 and 3, which are not in the load. Off by
            # default (each rank reads for itself, as stock), refused when asked for.
            target, fetched = _load(path, sub_dcp, remote=True)
            assert all(torch.equal(target[k], v) for k, v in state.items())
            assert fetched == 2 * stored
            with pytest.raises(CheckpointException, match="dcp.load runs on another group"):
                _load(path, sub_dcp, read_once=True)
        dist.barrier(dcp_group)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/support/distributed.py's gloo_group: gloo's teardown may abort


def test_nccl_only_default_group_gets_a_gloo_group_of_its_own(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    storage.save(_state(), path)
    spawn(_worker, args=(str(tmp_path / "store"), path), nprocs=WORLD, join=True)
