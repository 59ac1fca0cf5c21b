"""What the tiered-manager tests share: a small state per step, a blank target for it, and
a manager with a durable root and a local tier under one temporary directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from storage.ops.manager import CheckpointManager


def step_state(step: int) -> dict[str, Any]:
    """A state whose values depend on ``step`` only."""
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=gen), "meta": {"step": step}}


def blank_state() -> dict[str, Any]:
    """A target :func:`step_state`'s checkpoints load into."""
    return {"w": torch.zeros(64, 32), "meta": {"step": -1}}


def tiered(tmp_path: Path, **options: Any) -> CheckpointManager:
    """A manager saving to ``tmp_path/durable`` through the local tier ``tmp_path/local``."""
    return CheckpointManager(tmp_path / "durable", local=tmp_path / "local", **options)
