"""Compare and blank nested state dicts (tensors, dicts, lists, plain values)."""

from __future__ import annotations

import torch


def zeros_like_tree(tree: object) -> object:
    """Same structure with every tensor zeroed and plain values blanked."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree.contiguous())
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [0 for _ in tree]
    if isinstance(tree, str):
        return ""
    if isinstance(tree, int):
        return 0
    return tree


def assert_tree_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_tree_equal(a[k], b[k])
    else:
        assert a == b, f"{a!r} != {b!r}"
