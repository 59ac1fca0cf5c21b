"""File modes: what a save creates follows the training process's umask as it is when
the save runs, whichever process writes it, so that nothing is more open to the other
users of the host than the user asked for.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import storage
from storage.checkpoint import persist
from storage.ops.manager import CheckpointManager

#: Bounds the failure of a save that hangs.
HANG = 120.0


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(256, 256), "b": torch.ones(16)}


def _open_to_others(root: Path) -> list[str]:
    """What under ``root`` (itself included) grants anything to group or others."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            found.append(f"{path.relative_to(root.parent)} {oct(mode)}")
    return found


@pytest.fixture
def private_later() -> Iterator[None]:
    """The worker started under umask 022, then the script makes its files private
    (umask 077), as a script does once its setup is done; restored after."""
    persist.worker().close()  # a worker of an earlier test started under another umask
    previous = os.umask(0o022)
    try:
        persist.worker().start()
        os.umask(0o077)
        yield
    finally:
        os.umask(previous)
        persist.worker().close()


def test_a_save_follows_the_umask_set_after_the_worker_started(
    tmp_path: Path, private_later: None
) -> None:
    """Before, the worker kept the umask it started with: a script that set
    ``os.umask(0o077)`` after its manager started the worker had its data files written
    ``0644`` by the worker (weights readable by every user of the host), where a save
    in threads wrote them ``0600``."""
    path = tmp_path / "ckpt"
    storage.async_save(_state(), path, persist="process").result(timeout=HANG)
    assert _open_to_others(path) == []


def test_a_drain_in_the_worker_follows_the_umask_set_after_it_started(
    tmp_path: Path, private_later: None
) -> None:
    """The drain of a tiered manager copies each step to the root in the worker: before,
    with the umask the worker started with, so the durable copy was readable by every
    user while the local one was private."""
    manager = CheckpointManager(tmp_path / "root", local=tmp_path / "local", persist="process")
    future = manager.save(1, _state(), blocking=False)
    assert future is not None
    future.result(timeout=HANG)
    manager.wait()  # the drain
    assert 1 in manager.durable_steps()
    assert _open_to_others(tmp_path / "root" / "step-1") == []
    assert _open_to_others(tmp_path / "local" / "step-1") == []
