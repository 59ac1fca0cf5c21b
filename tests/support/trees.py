"""Compare and blank nested state dicts (tensors, dicts, lists, plain values)."""

from __future__ import annotations

from typing import Any

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


def tiny_llama(seed: int) -> tuple[Any, Any]:
    """A 2-layer, 64-wide Llama built from its config (no download): ``(config, model)``;
    skips the test when transformers is not installed."""
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
    )
    torch.manual_seed(seed)
    return config, transformers.LlamaForCausalLM(config)
