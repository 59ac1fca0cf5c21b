"""Seeded generators of varied state dicts, and the bit-exact comparison of what a load
returned (tests/checkpoint/test_roundtrip_fuzz.py).

Every case is a pure function of its seed (``random.Random`` and ``torch.Generator``),
so a failing seed reproduces alone. Tensor contents are random bytes (NaN payloads,
signalling NaNs, -0.0, denormals and infinities come out of those) with those special
bit patterns also written at fixed places of each floating tensor.
"""

from __future__ import annotations

import io
import math
import random
import struct
from collections.abc import Callable
from typing import Any

import torch


def _dtypes() -> list[torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "bool", "complex32", "complex64", "complex128",
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


DTYPES = _dtypes()
FLOATS = [d for d in DTYPES if d.is_floating_point]

# Bit patterns for each float width: -0.0, a quiet NaN with a payload, a negative
# signalling NaN, the smallest denormal, -inf (all as unsigned ints of that width).
_SPECIAL_BITS = {
    8: [0x80, 0x7F, 0xFF, 0x01, 0xFC],
    16: [0x8000, 0x7E01, 0xFD01, 0x0001, 0xFC00],
    32: [0x80000000, 0x7FC00001, 0xFFA00001, 0x00000001, 0xFF800000],
    64: [1 << 63, 0x7FF8000000000001, 0xFFF4000000000001, 1, 0xFFF0000000000000],
}
_UINT = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32, 64: torch.uint64}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes of ``dtype`` (bool: 0/1), with the special float patterns first."""
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    flat = raw.view(dtype)
    width = dtype.itemsize * 8 // (2 if dtype.is_complex else 1)
    if (dtype.is_floating_point or dtype.is_complex) and width in _SPECIAL_BITS:
        lanes = raw.view(_UINT[width])
        for i, bits in enumerate(_SPECIAL_BITS[width][: lanes.numel()]):
            lanes[i] = bits if bits < 1 << (width - 1) else bits - (1 << width)
    return flat.reshape(shape)


def blank_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``t``'s dtype and shape holding zero bytes (torch.zeros has
    no kernel for some dtypes)."""
    n = t.numel() * t.dtype.itemsize
    return torch.zeros(n, dtype=torch.uint8).view(t.dtype).reshape(t.shape)


# --- one entry of a state dict --------------------------------------------------------

Maker = Callable[[random.Random, torch.Generator, torch.dtype], Any]


def _shape(rng: random.Random) -> tuple[int, ...]:
    return rng.choice([(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 5), (33, 17), (1, 1, 1)])


def _plain(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    return random_tensor(dtype, _shape(rng), gen)


def _transposed(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    return random_tensor(dtype, (rng.randint(2, 9), rng.randint(2, 9)), gen).t()


def _stepped(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    base = random_tensor(dtype, (6, 11), gen)
    return base[1::2, rng.randint(0, 2) :: rng.randint(2, 4)]


def _expanded(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    return random_tensor(dtype, (1, rng.randint(1, 5)), gen).expand(rng.randint(2, 4), -1)


def _channels_last(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    base = random_tensor(dtype, (2, 3, 4, 5), gen)
    return base.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # NHWC strides


def _offset(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    base = random_tensor(dtype, (50,), gen)
    start = rng.randint(1, 20)
    return base[start : start + rng.randint(0, 25)]


def _lazy_view(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    """A lazy conjugate (``x.conj()``) or negative (``x.conj().imag``) view, whose bytes
    are its base's: only torch's ops resolve them."""
    base = random_tensor(rng.choice([torch.complex64, torch.complex128]), (3, 4), gen)
    return base.conj() if rng.random() < 0.5 else base.conj().imag


def _parameter(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    return torch.nn.Parameter(random_tensor(dtype, _shape(rng), gen), requires_grad=False)


def _big(rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> Any:
    n = (rng.randint(1, 3) << 20) // dtype.itemsize + rng.randint(1, 99)  # a few MB, odd
    return random_tensor(dtype, (n,), gen)


TENSOR_MAKERS: dict[str, Maker] = {
    "plain": _plain,
    "transposed": _transposed,
    "stepped": _stepped,
    "expanded": _expanded,
    "channels_last": _channels_last,
    "offset": _offset,
    "lazy_view": _lazy_view,
    "parameter": _parameter,
}


def _plain_value(rng: random.Random) -> Any:
    return rng.choice(
        [
            rng.randint(-(2**70), 2**70),
            rng.choice([0.5, -0.0, float("inf"), 1e-310, math.pi]),
            "".join(rng.choice("aé€\U0001f600 .\n") for _ in range(rng.randint(0, 12))),
            bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))),
            None,
            True,
            [rng.randint(0, 9) for _ in range(rng.randint(0, 5))],
            (1, "two", 3.0),
            {"lr": 0.1, "betas": (0.9, 0.999)},
        ]
    )


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        key = rng.choice(
            [
                f"k{rng.randrange(10**6)}",
                f"layer.{rng.randrange(100)}.weight",  # dots, as module paths have
                "ключ_" + "🔑" * rng.randint(1, 3),
                "x" * rng.randint(200, 600),
                f"sp ace/{rng.randrange(99)}",
            ]
        )
        if key not in used:
            used.add(key)
            return key


def make_case(seed: int, *, big: bool = False) -> dict[str, Any]:
    """A state dict of tensors (every layout, random dtypes), plain values, BytesIO,
    nested dicts and lists, and tied views; deterministic in ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    used: set[str] = set()
    state: dict[str, Any] = {}
    for _ in range(rng.randint(4, 10)):
        kind = rng.choice(sorted(TENSOR_MAKERS))
        state[_key(rng, used)] = TENSOR_MAKERS[kind](rng, gen, rng.choice(DTYPES))
    for _ in range(rng.randint(1, 3)):
        state[_key(rng, used)] = _plain_value(rng)
    if rng.random() < 0.7:
        state[_key(rng, used)] = io.BytesIO(
            bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 33])))
        )
    shared = random_tensor(rng.choice(DTYPES), (4, 6), gen)
    state["tied"] = {"a": shared, "b": shared, "row": shared[1], "t": shared.t()}
    nested = {"inner": {"w": _plain(rng, gen, rng.choice(DTYPES)), "n": rng.randint(0, 9)}}
    state["nested"] = nested
    state["list"] = [_plain(rng, gen, rng.choice(DTYPES)), {"x": _plain_value(rng)}]
    if big:
        state["big"] = {str(d): _big(rng, gen, d) for d in rng.sample(DTYPES, 4)}
        wide = rng.choice(DTYPES)  # past a 4 MiB frame of zstd and the read window, twice
        state["big"]["frames"] = random_tensor(wide, ((9 << 20) // wide.itemsize + 7,), gen)
    return state


def every_dtype_case(seed: int) -> dict[str, Any]:
    """Each dtype as a matrix, a 0-dim scalar, a zero-element tensor and a strided view;
    complex ones also as lazy conj and neg views."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        state[name] = {
            "m": random_tensor(dtype, (5, 7), gen),
            "s": random_tensor(dtype, (), gen),
            "e": random_tensor(dtype, (3, 0, 2), gen),
            "v": random_tensor(dtype, (6, 8), gen)[1::2, ::3].t(),
        }
        if dtype in (torch.complex64, torch.complex128):  # lazy views (see _lazy_view)
            state[name]["conj"] = random_tensor(dtype, (4, 3), gen).conj()
            state[name]["neg"] = random_tensor(dtype, (4, 3), gen).conj().imag
    return state


def optimizer_case(seed: int) -> dict[str, Any]:
    """A small model and its AdamW state after two steps (int param ids, step tensors)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 5)).square().sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2}


# --- what a load returned -------------------------------------------------------------


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes, whatever the strides."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    resolved = [t.resolve_conj().resolve_neg().contiguous().reshape(-1) for t in (a, b)]
    flat = [t.view(torch.uint8) for t in resolved]
    return torch.equal(flat[0], flat[1])


def tree_differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want``: tensors bit for bit, floats by their bits,
    BytesIO by content, containers by type and keys."""
    where = path or "<root>"
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{where}: {type(got).__name__} instead of a tensor"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"]
        return [] if same_bits(got, want) else [f"{where}: bytes differ ({want.dtype})"]
    if type(got) is not type(want):
        return [f"{where}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{where}: keys {list(got)!r:.200} != {list(want)!r:.200}"]
        return [d for k in want for d in tree_differences(got[k], want[k], f"{path}/{k!r}")]
    if isinstance(want, list | tuple):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        pairs = enumerate(zip(got, want, strict=True))
        return [d for i, (g, w) in pairs for d in tree_differences(g, w, f"{path}[{i}]")]
    if isinstance(want, io.BytesIO):
        return [] if got.getvalue() == want.getvalue() else [f"{where}: BytesIO differs"]
    if isinstance(want, float):
        same = struct.pack("<d", got) == struct.pack("<d", want)
        return [] if same else [f"{where}: {got!r} != {want!r}"]
    return [] if got == want else [f"{where}: {got!r:.80} != {want!r:.80}"]


def half_changed(tree: Any, _count: list[int] | None = None) -> Any:
    """``tree`` with every other tensor (in walk order) blanked: a base for an
    incremental save of ``tree`` that holds half its items."""
    count = [0] if _count is None else _count
    if isinstance(tree, torch.Tensor):
        count[0] += 1
        return blank_like(tree) if count[0] % 2 else tree
    if isinstance(tree, dict):
        return type(tree)((k, half_changed(v, count)) for k, v in tree.items())
    if isinstance(tree, list):
        return [half_changed(v, count) for v in tree]
    return tree


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (dicts and lists), in walk order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in tensors_of(v)]
    return []


def _overlaps(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _cast_to(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128 if dtype != torch.complex128 else torch.complex64
    if dtype.is_floating_point:
        return torch.float64 if dtype != torch.float64 else torch.bfloat16
    return dtype if dtype == torch.bool else torch.int64


def blank_tree(
    tree: Any, *, mirror: bool, cast: bool = False, _memo: dict[int, torch.Tensor] | None = None
) -> Any:
    """A load target of ``tree``'s structure: tensors blanked, plain values ``None``,
    BytesIO empty. ``mirror`` keeps each tensor's strides, storage offset and sharing
    (tied views stay tied) where the layout has no self-overlap; else contiguous.
    ``cast`` gives every tensor target another dtype (a load casts, as ``copy_``). A
    mirrored lazy conj/neg view is a lazy view of a blank (which the load fills through)."""
    memo = {} if _memo is None else _memo
    if isinstance(tree, torch.Tensor):
        if cast:
            return torch.zeros(tree.shape, dtype=_cast_to(tree.dtype))
        if mirror and tree.is_conj():  # lazy views as targets too: the load must resolve
            return blank_like(tree).conj()
        if mirror and tree.is_neg():
            return torch.zeros(tree.shape, dtype=tree.dtype.to_complex()).conj().imag
        if not mirror or _overlaps(tree) or tree.numel() == 0:
            return blank_like(tree)
        source = tree.untyped_storage()
        flat = memo.get(source.data_ptr())
        if flat is None:
            flat = torch.zeros(source.nbytes(), dtype=torch.uint8)
            memo[source.data_ptr()] = flat
        whole = flat.view(tree.dtype)
        return whole.as_strided(tree.shape, tree.stride(), tree.storage_offset())
    if isinstance(tree, dict):
        pairs = ((k, blank_tree(v, mirror=mirror, cast=cast, _memo=memo)) for k, v in tree.items())
        return type(tree)(pairs)
    if isinstance(tree, list):
        return [blank_tree(v, mirror=mirror, cast=cast, _memo=memo) for v in tree]
    if isinstance(tree, io.BytesIO):
        return io.BytesIO()
    return None
