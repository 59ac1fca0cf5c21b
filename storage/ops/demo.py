"""``dcp-storage demo``: save a small real model with zstd, load it back, compare."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import torch
from torch import nn

from extensions import ZStandard
from storage.checkpoint.api import load, save


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = nn.Sequential(
        nn.Embedding(4096, 256), nn.TransformerEncoder(layer, num_layers=4), nn.Linear(256, 4096)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        tokens = torch.randint(0, 4096, (4, 32))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()


def _state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _tree_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def run_demo(directory: str | None = None, *, steps: int = 3, keep: bool = False) -> dict[str, Any]:
    """Train a few steps, save with zstd, load into a fresh model, check equality.

    Returns the figures printed by the CLI; raises ``AssertionError`` on a mismatch."""
    workdir = directory or tempfile.mkdtemp(prefix="dcp-storage-demo-")
    path = os.path.join(workdir, "checkpoint")
    model, optim = _build(seed=0)
    _train(model, optim, steps)
    original = _state(model, optim, steps)

    t0 = time.perf_counter()
    save(original, path, transforms=[ZStandard()])
    save_s = time.perf_counter() - t0

    fresh_model, fresh_optim = _build(seed=1)
    _train(fresh_model, fresh_optim, 1)  # creates optimizer state to load into
    restored = _state(fresh_model, fresh_optim, 0)
    t0 = time.perf_counter()
    load(restored, path)
    load_s = time.perf_counter() - t0
    fresh_optim.load_state_dict(restored["optim"])
    if not _equal(original, restored):
        raise AssertionError(f"demo: the state loaded from {path} differs from the one saved")

    logical = sum(t.numel() * t.element_size() for t in _tensors(original))
    stored = _tree_bytes(path)
    items = len(list(_tensors(original)))
    figures = {
        "checkpoint": path,
        "items": items,
        "logical_bytes": logical,
        "stored_bytes": stored,
        "ratio": logical / stored if stored else 0.0,
        "save_s": save_s,
        "load_s": load_s,
        "equal": True,
    }
    if directory is None and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return figures


def _tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def format_figures(f: dict[str, Any]) -> str:
    mb = 1e6
    rows = [
        ("checkpoint", f["checkpoint"]),
        ("tensors", str(f["items"])),
        ("logical size", f"{f['logical_bytes'] / mb:.1f} MB"),
        ("stored size", f"{f['stored_bytes'] / mb:.1f} MB (zstd)"),
        ("ratio", f"{f['ratio']:.3f}"),
        ("save", f"{f['save_s']:.2f} s, {f['logical_bytes'] / mb / f['save_s']:.0f} MB/s"),
        ("load", f"{f['load_s']:.2f} s, {f['logical_bytes'] / mb / f['load_s']:.0f} MB/s"),
        ("loaded == saved", "yes" if f["equal"] else "NO"),
        ("look inside", f"dcp-storage inspect {f['checkpoint']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
