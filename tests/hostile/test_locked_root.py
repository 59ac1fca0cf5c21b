"""Another user on the host who can only read a root of checkpoints locks it.

On local disk the latest-step pointer is replaced under a ``flock`` of the root, taken
after every commit into it; ``flock`` needs nothing but a descriptor, so anyone who can
read the directory (a root left ``0755``, as most are) can hold a lock on it for ever.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import storage
from storage.backends import swap

_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


@pytest.fixture
def locked_root(tmp_path: Path) -> Iterator[Path]:
    """A root whose directory another process holds a shared lock of, read-only."""
    root = tmp_path / "root"
    root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield root
    finally:
        holder.kill()
        holder.wait()


def test_a_save_into_a_root_another_process_keeps_locked_returns(
    locked_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the save committed step-1, then waited for ever on the lock to point the
    # latest-step pointer at it: every save of the job hung.
    monkeypatch.setattr(swap, "LOCK_WAIT", 0.2, raising=False)
    manager = storage.CheckpointManager(str(locked_root), persist="thread")
    done = threading.Event()

    def save() -> None:
        manager.save(1, {"w": torch.ones(4)})
        done.set()

    with caplog.at_level(logging.WARNING, logger="storage.backends.swap"):
        threading.Thread(target=save, daemon=True).start()
        assert done.wait(60), "the save hung on the lock another process holds"
    assert (locked_root / ".dcp-latest").read_text() == "step-1\n"
    assert manager.latest() == 1
    warned = [r.getMessage() for r in caplog.records if r.name == "storage.backends.swap"]
    assert any(str(locked_root) in m and "held a lock" in m for m in warned), warned
