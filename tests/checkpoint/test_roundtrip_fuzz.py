"""Differential round trips: seeded, varied state dicts (tests/support/fuzz_states.py)
through every save/load path of ours, each compared bit for bit with what stock DCP
(``FileSystemWriter``/``FileSystemReader``, ``no_dist=True``) loads from the same state.

The cases: every dtype torch has on CPU (float8 and complex32 included) as a matrix, a
0-dim scalar, a zero-element (3, 0, 2) tensor and a strided view, with NaN payloads,
signalling NaNs, -0.0, denormals and infinities in every float; random mixes of shapes
and layouts (transposed, stepped slices, stride-0 expands, channels_last, storage
offsets, lazy conj/neg views, Parameters), tied views of one storage in several keys,
nested dicts and lists, plain values (big ints, floats, unicode strings, bytes, None,
tuples, lists), ``io.BytesIO`` values (empty too), long, dotted and unicode keys; an
AdamW state after two steps (int keys, ``step`` tensors); multi-MB tensors, one past
two zstd frames. Load targets are blank and contiguous, or mirror the source's strides,
offsets and ties, or have another dtype (a load casts, as ``copy_``).

What stock does, and so what we do: a save stores each key's tensor as its own item
(tied views too: no deduplication); a load fills the caller's tensors in place, so ties
come back as the target has them, and non-tensor values are replaced. A plain value
under a non-str key (``{0: "zero"}``) comes back under ``str(key)`` beside the original
key (DCP flattens keys with ``str``): we match it. What both refuse, and ours names:
test_roundtrip_refusals.py. Where we deliberately differ: a pickled value that is not
plain data (a user's class, ``datetime``, ``Fraction``) loads with stock's
``weights_only=False`` but is refused by ours with ``UnsafeCheckpointError`` naming the
item and ``add_safe_globals``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

import storage
from extensions import AES256GCM, ByteShuffle, WeightCodec, ZStandard
from storage.checkpoint import persist
from tests.support.fuzz_states import (
    blank_tree,
    every_dtype_case,
    half_changed,
    make_case,
    optimizer_case,
    tensors_of,
    tree_differences,
)

KEY = hashlib.sha256(b"dcp-storage fuzz key").digest()  # test-only
KEYS = {"fz": KEY}
REPO = Path(__file__).resolve().parents[2]

# name -> (state dict maker, load target: "blank" contiguous, "mirror" the source's
# layout and ties, or "cast" to another dtype)
CASES: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "every_dtype": (lambda: every_dtype_case(7), "blank"),
    "every_dtype_mirrored": (lambda: every_dtype_case(8), "mirror"),
    "every_dtype_cast": (lambda: every_dtype_case(9), "cast"),
    "adamw": (lambda: optimizer_case(3), "blank"),
    **{
        f"random{seed}": (functools.partial(make_case, seed), ("blank", "mirror", "cast")[seed % 3])
        for seed in range(9)
    },
    "big": (lambda: make_case(100, big=True), "mirror"),
    "big2": (lambda: make_case(101, big=True), "blank"),
}


def _quiet() -> Any:
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return context


@functools.cache
def _case(name: str) -> dict[str, Any]:
    return CASES[name][0]()


def _target(name: str) -> Any:
    mode = CASES[name][1]
    return blank_tree(_case(name), mirror=mode == "mirror", cast=mode == "cast")


@functools.cache
def _stock(name: str, root: str) -> Any:
    """What stock DCP loads back of case ``name`` (saved under ``root``)."""
    path = os.path.join(root, f"stock-{name}")
    target = _target(name)
    dcp.save(_case(name), storage_writer=FileSystemWriter(path), no_dist=True)
    dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return target


@pytest.fixture(scope="module", autouse=True)
def _close_the_worker() -> Iterator[None]:
    """The persist worker and its staging segments are the process's: close what these
    tests started, so later modules find none."""
    yield
    persist.worker().close()


@pytest.fixture(scope="module")
def stock_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("stock"))


# --- the paths: each saves ``state`` at ``path`` and loads it into ``target`` ----------


def _one_call(
    transforms: list[Any], *, url: Callable[[Path], str] = str, read: Any = None, **options: Any
) -> Callable[[Any, Path, Any], None]:
    def run(state: Any, path: Path, target: Any) -> None:
        storage.save(state, url(path), transforms=transforms, **options)
        keys = KEYS if _encrypted(transforms) else None
        storage.load(target, url(path), keys=keys, **(read or {}))

    return run


def _in_memory(path: Path) -> str:
    return f"memory://fuzz{path}"  # fsspec's in-memory store, one name per test


def _encrypted(transforms: list[Any]) -> bool:
    return any(isinstance(t, AES256GCM) for t in transforms)


def _aes() -> AES256GCM:
    return AES256GCM(key=KEY, key_id="fz", chunk_size=4096)


def _dcp_ours(state: Any, path: Path, target: Any) -> None:
    dcp.save(state, storage_writer=storage.CheckpointWriter(path), no_dist=True)
    dcp.load(target, storage_reader=storage.CheckpointReader(path), no_dist=True)


def _ours_then_stock(transforms: list[Any]) -> Callable[[Any, Path, Any], None]:
    def run(state: Any, path: Path, target: Any) -> None:
        storage.save(state, path, transforms=transforms)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)

    return run


def _stock_then_ours(transforms: list[Any]) -> Callable[[Any, Path, Any], None]:
    def run(state: Any, path: Path, target: Any) -> None:
        writer = FileSystemWriter(path, _extensions=transforms)
        dcp.save(state, storage_writer=writer, no_dist=True)
        storage.load(target, path)

    return run


def _async(
    persist: str | None, transforms: list[Any], **options: Any
) -> Callable[[Any, Path, Any], None]:
    def run(state: Any, path: Path, target: Any) -> None:
        future = storage.async_save(state, path, transforms=transforms, persist=persist, **options)
        future.result(timeout=120)
        storage.load(target, path, keys=KEYS if _encrypted(transforms) else None)

    return run


def _incremental(state: Any, path: Path, target: Any) -> None:
    """Half the items referenced in a base (bytes of the base's data files), half new."""
    chain = [WeightCodec(), _aes()]
    base = path.parent / "base"
    storage.save(half_changed(state), base, transforms=chain, fingerprint=True)
    storage.save(state, path, transforms=chain, base=str(base))
    storage.load(target, path, keys=KEYS)


def _loop(
    persist: str | None, *, growing: bool = False, **options: Any
) -> Callable[[Any, Path, Any], None]:
    """A training loop's saves: one writer saves the live state, the state changes in
    place, the writer saves it again (its staging buffers reused); the second must hold
    the new values. ``growing``: the first save holds every other top-level key only
    (as an optimizer's state appears after its first step)."""

    def run(state: Any, path: Path, target: Any) -> None:
        live = copy.deepcopy(state)  # the same layouts, ties and storages, its own memory
        pairs = list(zip(tensors_of(live), tensors_of(state), strict=True))
        for mine, _ in pairs:
            mine.untyped_storage().fill_(0)
        # deepcopy resolves lazy conj/neg views: those take their values by copy_, the
        # rest their storage's bytes (expanded views cannot be copied into)
        lazy = [(m, s) for m, s in pairs if s.is_conj() or s.is_neg()]
        pairs = [(m, s) for m, s in pairs if not (s.is_conj() or s.is_neg())]
        writer = storage.CheckpointWriter(path / "1", persist=persist, **options)
        half = {k: v for i, (k, v) in enumerate(live.items()) if i % 2}
        for step, saved in (("1", half if growing else live), ("2", live)):
            future = dcp.async_save(
                saved, storage_writer=writer, checkpoint_id=path / step, no_dist=True
            )
            future.result(timeout=120)
            for mine, source in pairs:  # the next step's values, in place
                mine.untyped_storage().copy_(source.untyped_storage())
            for mine, source in lazy:
                mine.copy_(source)
        storage.load(target, path / "2")

    return run


def _managed(state: Any, path: Path, target: Any) -> None:
    """The manager's asynchronous, incremental saves: step 4 (the same state) references
    every item of step 3."""
    manager = storage.CheckpointManager(
        path, keep_last=2, transforms=[ZStandard()], incremental=True
    )
    for step in (3, 4):
        future = manager.save(step, state, blocking=False)
        assert future is not None
        future.result(timeout=120)
    assert manager.load(target) == 4


PATHS: dict[str, Callable[[Any, Path, Any], None]] = {
    "save-load": _one_call([]),
    "save-load-zstd": _one_call([ZStandard()]),
    "save-load-weights": _one_call([WeightCodec()]),
    "save-load-weights-compact": _one_call([WeightCodec(compact=True)]),
    "save-load-shuffle-zstd-aes": _one_call([ByteShuffle(), ZStandard(), _aes()]),
    "save-load-files-per-thread": _one_call([], thread_count=3, single_file_per_rank=False),
    "save-load-fsspec-memory-zstd": _one_call([ZStandard()], url=_in_memory),
    "save-load-key-prefixes": _one_call([], key_prefixes=4, single_file_per_rank=False),
    "save-load-read-once-weights": _one_call([WeightCodec()], read={"read_once": True}),
    "save-load-one-thread-zstd": _one_call([ZStandard()], read={"thread_count": 1}),
    "save-load-zstd-aes": _one_call([ZStandard(), _aes()]),
    "save-load-weights-aes": _one_call([WeightCodec(), _aes()]),
    "dcp-writer-reader": _dcp_ours,
    "ours-then-stock": _ours_then_stock([]),
    "ours-zstd-then-stock": _ours_then_stock([ZStandard()]),
    "stock-then-ours": _stock_then_ours([]),
    "stock-zstd-then-ours": _stock_then_ours([TorchZStandard()]),
    "async-thread": _async("thread", []),
    "async-thread-weights-aes": _async("thread", [WeightCodec(), _aes()]),
    "async-default-staging": _async(None, [ZStandard()]),
    "async-cached-staging": _async("thread", [], cache_staged_state_dict=True),
    "async-staging-future": _async(None, [], async_staging=True),
    "loop-default-staging": _loop(None, transforms=[WeightCodec()]),
    "loop-cached-staging": _loop("thread", cache_staged_state_dict=True),
    "loop-growing-cached-staging": _loop("thread", growing=True, cache_staged_state_dict=True),
    "loop-growing-default-staging": _loop(None, growing=True),
    "manager-async-zstd": _managed,
    "incremental-weights-aes": _incremental,
}


def _check(name: str, path_name: str, run: Callable[..., None], where: Path, root: str) -> None:
    target = _target(name)
    quiet = _quiet()
    try:
        want = _stock(name, root)
        run(_case(name), where, target)
    finally:
        quiet.__exit__(None, None, None)
    differences = tree_differences(target, want)
    assert not differences, f"{path_name} on {name}: {differences[:8]}"


@pytest.mark.parametrize("path_name", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_matches_stock(
    name: str, path_name: str, tmp_path: Path, stock_root: str
) -> None:
    _check(name, path_name, PATHS[path_name], tmp_path / "ckpt", stock_root)


@pytest.mark.parametrize("transforms", [[], [WeightCodec(), _aes()]], ids=["plain", "weights-aes"])
@pytest.mark.parametrize("name", ["every_dtype", "random1", "adamw"])
def test_round_trip_through_the_persist_worker(
    name: str, transforms: list[Any], tmp_path: Path, stock_root: str
) -> None:
    _check(name, "async-process", _async("process", transforms), tmp_path / "ckpt", stock_root)


@pytest.mark.parametrize("name", ["every_dtype_mirrored", "random4"])
def test_a_loop_through_the_persist_worker(name: str, tmp_path: Path, stock_root: str) -> None:
    """The worker's staging buffers, reused by the next save of the same tensors, hold
    that save's values."""
    _check(name, "loop-process", _loop("process"), tmp_path / "ckpt", stock_root)
    _check(name, "loop-growing-process", _loop("process", growing=True), tmp_path / "g", stock_root)


def test_stock_loads_back_what_it_saved(stock_root: str) -> None:
    """The reference itself: stock DCP returns every case bit for bit where the target
    has the source's dtypes (the cases hold no plain value under a non-str key, which
    stock moves to ``str(key)``)."""
    quiet = _quiet()
    try:
        for name in [n for n, (_, mode) in CASES.items() if mode != "cast"]:
            assert not tree_differences(_stock(name, stock_root), _case(name)), name
    finally:
        quiet.__exit__(None, None, None)


_FRESH = """
import sys, warnings
warnings.filterwarnings("ignore")
import storage
from tests.support.fuzz_states import blank_tree, every_dtype_case, make_case, tree_differences
for path, state in ((sys.argv[1], every_dtype_case(7)), (sys.argv[2], make_case(5))):
    target = blank_tree(state, mirror=True)
    storage.load(target, path, keys={"fz": bytes.fromhex(sys.argv[3])} if sys.argv[3] else None)
    print(path, tree_differences(target, state)[:8])
"""


@pytest.mark.parametrize("transforms", [[], [WeightCodec(), _aes()]], ids=["plain", "weights-aes"])
def test_a_fresh_process_loads_what_this_one_saved(transforms: list[Any], tmp_path: Path) -> None:
    """Nothing a load needs may live only in the saving process (caches, registries)."""
    quiet = _quiet()
    try:
        storage.save(every_dtype_case(7), tmp_path / "a", transforms=transforms)
        storage.save(make_case(5), tmp_path / "b", transforms=transforms)
    finally:
        quiet.__exit__(None, None, None)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    key = KEY.hex() if _encrypted(transforms) else ""
    run = subprocess.run(
        [sys.executable, "-c", _FRESH, str(tmp_path / "a"), str(tmp_path / "b"), key],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [f"{tmp_path / n} []" for n in "ab"], run.stdout
