"""AES256GCM through storage.save/load: round trips, key handling, tampering, goldens.

Tampering tests rewrite the stored bytes *and* fix up the metadata (offsets, lengths,
CRC32C), as an attacker with write access could, so only AES-GCM authentication
stands between the change and the loaded tensors.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import logging
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import storage
from extensions import (
    AES256GCM,
    ByteShuffle,
    ExtensionRegistry,
    IntegrityError,
    ItemInfo,
    MissingKeyError,
    UnknownTransformError,
    ZStandard,
    keys_from_environment,
)
from extensions._aes_stream import TAG_SIZE
from extensions._aes_stream import associated_prefix as _associated_prefix
from extensions.testing import FlushOnlyClose
from storage.checkpoint import storage_format as fmt
from tests.support.sealing import resealed
from tests.support.trees import assert_tree_equal, zeros_like_tree

KEY = hashlib.sha256(b"dcp-storage test key").digest()
OTHER_KEY = hashlib.sha256(b"another key").digest()
HEADER = 37
CHUNK = 4096
GOLDENS = Path(__file__).parents[1] / "golden"
# AES format 1 (written by an earlier release) and format 2, each with its manifest.
GOLDEN_SETS = [GOLDENS / "transforms", GOLDENS / "transforms-aes2", GOLDENS / "transforms-aes3"]
GOLDEN_KEY = bytes(range(32))  # the golden items' key; test-only, never a real secret


def two_tensors() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 64, generator=gen), "b": torch.randn(64, 64, generator=gen)}


def save_encrypted(path: Path, state: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    state = state if state is not None else two_tensors()
    aes = AES256GCM(key=KEY, key_id="k1", chunk_size=CHUNK)
    storage.save(state, path, transforms=kw.pop("transforms", [aes]), thread_count=1, **kw)
    return state


def load_into(path: Path, state: dict[str, Any], **kw: Any) -> dict[str, Any]:
    target = zeros_like_tree(state)
    assert isinstance(target, dict)
    storage.load(target, path, **kw)
    return target


def rewrite(ckpt: Path, edit: Callable[[dict[str, bytes]], None]) -> None:
    """Let ``edit`` change items' stored bytes (by fqn), then re-lay the data files and
    fix offsets, lengths and checksums in the metadata."""
    meta_path = ckpt / ".metadata"
    metadata = fmt.load_metadata(meta_path.read_bytes(), str(ckpt))
    infos = {index.fqn: info for index, info in metadata.storage_data.items()}
    stored = {
        fqn: (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        for fqn, info in infos.items()
    }
    edit(stored)
    for name in {info.relative_path for info in infos.values()}:
        layout = bytearray()
        for fqn, info in sorted(infos.items(), key=lambda kv: kv[1].offset):
            if info.relative_path != name:
                continue
            info.offset, info.length = len(layout), len(stored[fqn])
            getattr(info, fmt.EXTRA)[fmt.CRC32C] = crc32c.crc32c(stored[fqn])
            layout += stored[fqn]
        (ckpt / name).write_bytes(bytes(layout))
    # Resealed, as its writer would: these tests reach the items' own checks.
    meta_path.write_bytes(resealed(metadata, AES256GCM(key=KEY, key_id="k1")))


def records(data: bytes) -> list[bytes]:
    body = data[HEADER:]
    size = CHUNK + TAG_SIZE
    return [body[i : i + size] for i in range(0, len(body), size)]


def join(header: bytes, chunks: list[bytes]) -> bytes:
    return header + b"".join(chunks)


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


# --- round trips ----------------------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    if request.param == "local":
        return tmp_path / "ckpt", {}
    return "ckpt", {"filesystem": storage.MemoryFileSystem()}


@pytest.mark.parametrize("chain", ["aes", "zstd+aes", "shuffle+zstd+aes"])
@pytest.mark.parametrize("keys_kind", ["mapping", "callable"])
def test_round_trip(
    location: tuple[Any, dict[str, Any]], state_dict: dict[str, Any], chain: str, keys_kind: str
) -> None:
    path, options = location
    aes = AES256GCM(key=KEY, key_id="k1", chunk_size=CHUNK)
    chains: dict[str, list[Any]] = {
        "aes": [aes],
        "zstd+aes": [ZStandard(), aes],
        "shuffle+zstd+aes": [ByteShuffle(), ZStandard(level=1), aes],
    }
    storage.save(state_dict, path, transforms=chains[chain], **options)
    keys: Any = {"k1": KEY} if keys_kind == "mapping" else (lambda key_id: {"k1": KEY}[key_id])
    assert_tree_equal(state_dict, load_into(path, state_dict, keys=keys, **options))


def test_keys_from_environment_load(tmp_path: Path) -> None:
    state = save_encrypted(tmp_path)
    keys = keys_from_environment({"DCP_STORAGE_KEYS": f"other={OTHER_KEY.hex()},k1={KEY.hex()}"})
    assert_tree_equal(state, load_into(tmp_path, state, keys=keys))


def test_compression_happens_before_encryption(tmp_path: Path) -> None:
    state = {"zeros": torch.zeros(1 << 18)}  # 1 MiB that compresses to almost nothing
    save_encrypted(tmp_path, state, transforms=[ZStandard(), AES256GCM(key=KEY, key_id="k1")])
    metadata = fmt.load_metadata((tmp_path / ".metadata").read_bytes(), str(tmp_path))
    (info,) = metadata.storage_data.values()
    assert info.transform_descriptors[0] == "stream.zstd/1"
    assert info.transform_descriptors[1].startswith("dcp_storage.aes256gcm/3;key_id=k1;")
    assert info.length < 10_000


def test_key_never_appears(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    aes = AES256GCM(key=KEY, key_id="k1", chunk_size=CHUNK)
    state = save_encrypted(tmp_path, transforms=[ZStandard(), aes])
    messages = [repr(aes), str(aes), aes.get_descriptor()]
    for keys in ({"k1": OTHER_KEY}, {}, {"k1": KEY[:16]}):
        with pytest.raises((IntegrityError, MissingKeyError)) as info:
            load_into(tmp_path, state, keys=keys)
        messages.append(str(info.value))
    load_into(tmp_path, state, keys={"k1": KEY})
    needles = [KEY, KEY.hex().encode(), KEY.hex().upper().encode(), base64.b64encode(KEY)]
    haystacks = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    haystacks += [m.encode() for m in messages] + [caplog.text.encode()]
    assert len(haystacks) >= 3
    for needle in needles:
        assert not any(needle in hay for hay in haystacks)


# --- bad keys -------------------------------------------------------------------------


def test_wrong_key_names_checkpoint_and_item(tmp_path: Path) -> None:
    state = save_encrypted(tmp_path)
    with pytest.raises(IntegrityError, match=r"item '(a|b)'.*not the key") as info:
        load_into(tmp_path, state, keys={"k1": OTHER_KEY})
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    "keys",
    [None, {}, {"other": KEY}, lambda key_id: None, lambda key_id: {}[key_id]],
    ids=["none", "empty", "other-id", "callable-none", "callable-keyerror"],
)
def test_missing_key_names_key_id_and_item(tmp_path: Path, keys: Any) -> None:
    state = save_encrypted(tmp_path)
    with pytest.raises(MissingKeyError, match=r"item '(a|b)'.*key_id 'k1'"):
        load_into(tmp_path, state, keys=keys)


def test_unusable_key_on_read(tmp_path: Path) -> None:
    state = save_encrypted(tmp_path)
    with pytest.raises(MissingKeyError, match="32 bytes"):
        load_into(tmp_path, state, keys={"k1": KEY[:16]})
    with pytest.raises(MissingKeyError, match="must be bytes"):
        load_into(tmp_path, state, keys={"k1": KEY.hex()})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"key": KEY[:16]}, ValueError, "32 bytes long, got 16"),
        ({"key": KEY + b"x"}, ValueError, "32 bytes long, got 33"),
        ({"key": KEY.hex()}, TypeError, "must be bytes, got str"),
        ({"key": KEY, "key_id": "a;b"}, ValueError, "key_id"),
        ({"key": KEY, "key_id": ""}, ValueError, "key_id"),
        ({"key": KEY, "chunk_size": 100}, ValueError, "chunk_size"),
    ],
)
def test_bad_construction(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match) as info:
        AES256GCM(**kwargs)
    assert KEY.hex() not in str(info.value)


def test_saving_without_key_fails(tmp_path: Path) -> None:
    with pytest.raises(MissingKeyError, match="no key"):
        storage.save(two_tensors(), tmp_path, transforms=[AES256GCM(key_id="k1")])
    assert not (tmp_path / ".metadata").exists()


# --- tampering ------------------------------------------------------------------------


def _tamper_cases() -> dict[str, Callable[[dict[str, bytes]], None]]:
    def on_a(change: Callable[[bytes, list[bytes]], bytes]) -> Callable[[dict[str, bytes]], None]:
        def edit(stored: dict[str, bytes]) -> None:
            stored["a"] = change(stored["a"][:HEADER], records(stored["a"]))

        return edit

    def swap_chunk(stored: dict[str, bytes]) -> None:
        a, b = records(stored["a"]), records(stored["b"])
        a[1], b[1] = b[1], a[1]
        stored["a"] = join(stored["a"][:HEADER], a)
        stored["b"] = join(stored["b"][:HEADER], b)

    def swap_items(stored: dict[str, bytes]) -> None:
        stored["a"], stored["b"] = stored["b"], stored["a"]

    def flip_in(chunk: int) -> Callable[[bytes, list[bytes]], bytes]:
        return lambda h, r: join(
            h, [flip(c, 7) if i == chunk % len(r) else c for i, c in enumerate(r)]
        )

    return {
        "flip-first-chunk": on_a(flip_in(0)),
        "flip-middle-chunk": on_a(flip_in(2)),
        "flip-last-chunk": on_a(flip_in(-1)),
        "flip-tag": on_a(lambda h, r: join(h, [r[0][:-1] + bytes([r[0][-1] ^ 1])] + r[1:])),
        "flip-header-salt": on_a(lambda h, r: join(flip(h, 10), r)),
        "truncate-at-chunk-edge": on_a(lambda h, r: join(h, r[:-1])),
        "truncate-mid-chunk": on_a(lambda h, r: join(h, r)[:-100]),
        "truncate-header": on_a(lambda h, r: h[:20]),
        "drop-middle-chunk": on_a(lambda h, r: join(h, r[:1] + r[2:])),
        "duplicate-chunk": on_a(lambda h, r: join(h, r[:2] + r[1:])),
        "reorder-chunks": on_a(lambda h, r: join(h, [r[1], r[0]] + r[2:])),
        "extend-after-final": on_a(lambda h, r: join(h, r) + b"\x00" * 16),
        "swap-chunk-between-items": swap_chunk,
        "swap-whole-items": swap_items,
    }


@pytest.mark.parametrize("case", sorted(_tamper_cases()))
def test_tampering_is_detected(tmp_path: Path, case: str) -> None:
    state = save_encrypted(tmp_path)
    rewrite(tmp_path, _tamper_cases()[case])
    with pytest.raises(IntegrityError, match=r"item '(a|b)'") as info:
        load_into(tmp_path, state, keys={"k1": KEY})
    assert str(tmp_path) in str(info.value)


def test_rewrite_helper_keeps_an_untampered_checkpoint_loading(tmp_path: Path) -> None:
    # Guards the tampering tests: the rewrite itself must not break anything.
    state = save_encrypted(tmp_path)
    rewrite(tmp_path, lambda stored: None)
    assert_tree_equal(state, load_into(tmp_path, state, keys={"k1": KEY}))


def test_unknown_descriptor_version_names_the_item(tmp_path: Path) -> None:
    state = save_encrypted(tmp_path)
    meta_path = tmp_path / ".metadata"
    metadata = fmt.load_metadata(meta_path.read_bytes(), str(tmp_path))
    for info in metadata.storage_data.values():
        info.transform_descriptors = [
            d.replace("aes256gcm/3", "aes256gcm/4") for d in info.transform_descriptors
        ]
    meta_path.write_bytes(fmt.dump_metadata(metadata))
    with pytest.raises(UnknownTransformError, match=r"item '(a|b)'.*aes256gcm/4"):
        load_into(tmp_path, state, keys={"k1": KEY})


# --- memory bound ---------------------------------------------------------------------


class _Counter(io.RawIOBase):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.count += memoryview(data).nbytes
        return memoryview(data).nbytes


def test_memory_stays_within_a_few_chunks() -> None:
    size, chunk = 24 << 20, 1 << 20
    data = bytearray(os.urandom(size))
    item = ItemInfo(checkpoint="mem", item="w", keys={"k1": KEY}.__getitem__)
    aes = AES256GCM(key=KEY, key_id="k1", chunk_size=chunk)
    tracemalloc.start()
    try:
        counter = _Counter()
        writer = aes.encode(counter, item)  # type: ignore[arg-type]
        writer.write(data)
        writer.close()
        _, encode_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counter.count == HEADER + size + (size // chunk + 1) * TAG_SIZE
    assert encode_peak < 4 * chunk

    sealed = io.BytesIO()
    writer = aes.encode(FlushOnlyClose(sealed), item)  # type: ignore[arg-type]
    writer.write(data)
    writer.close()
    source = io.BytesIO(sealed.getvalue())
    out = bytearray(size)
    tracemalloc.start()
    try:
        reader = aes.decode(source, item)
        got = 0
        while n := reader.readinto(memoryview(out)[got:]):  # type: ignore[attr-defined]
            got += n
        _, decode_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == size and out == data
    assert decode_peak < 4 * chunk


# --- goldens --------------------------------------------------------------------------


@pytest.mark.parametrize("golden", GOLDEN_SETS, ids=lambda p: p.name)
def test_golden_items_keep_decoding(golden: Path) -> None:
    manifest = json.loads((golden / "manifest.json").read_text())
    plain = (golden / manifest["plain"]).read_bytes()
    assert hashlib.sha256(plain).hexdigest() == manifest["plain_sha256"]
    assert len(manifest["items"]) >= 3
    for entry in manifest["items"]:
        item = ItemInfo(
            checkpoint="golden",
            item=entry["item"],
            element_size=entry["element_size"],
            keys={"golden": GOLDEN_KEY}.__getitem__,
            save=entry.get("save"),
        )
        raw = io.BytesIO((golden / entry["file"]).read_bytes())
        decoded = ExtensionRegistry().decoding_stream(entry["descriptors"], raw, item)
        assert decoded.read() == plain, entry["file"]


@pytest.mark.parametrize("golden", GOLDEN_SETS, ids=lambda p: p.name)
@pytest.mark.parametrize("name", ["ckpt-zstd-aes", "ckpt-shuffle-zstd-aes"])
def test_golden_checkpoints_keep_loading(golden: Path, name: str) -> None:
    expected = torch.load(golden / "expected.pt", weights_only=True)
    loaded = load_into(golden / name, expected, keys={"golden": GOLDEN_KEY})
    assert_tree_equal(expected, loaded)
    with pytest.raises(MissingKeyError):
        load_into(golden / name, expected)


def test_golden_sets_hold_every_format() -> None:
    # Guards the goldens themselves: older formats must stay covered once a newer one
    # is written, and format 3's checkpoints carry their seal.
    for golden, version in zip(GOLDEN_SETS, ("1", "2", "3"), strict=True):
        metadata = fmt.load_metadata((golden / "ckpt-zstd-aes" / ".metadata").read_bytes(), "g")
        for info in metadata.storage_data.values():
            assert info.transform_descriptors[-1].startswith(f"dcp_storage.aes256gcm/{version};")
        assert (fmt.SEAL in fmt.checkpoint_facts(metadata)) == (version == "3")


# --- what the associated data binds -----------------------------------------------------


def test_the_item_binding_is_unambiguous_and_pinned() -> None:
    # Before (format 1): the name "w@[4]" was bound for both the key "w@[4]" and the
    # chunk of "w" at offset 4, so either item's bytes authenticated as the other's.
    def bound(fqn: str, offsets: tuple[int, ...]) -> bytes:
        return _associated_prefix(ItemInfo(item="shown", identity=(fqn, offsets)), 2)

    assert bound("w", (4,)) == (
        b"dcp_storage.aes256gcm/2\x00"
        + b"\x00\x00\x00\x01w"
        + b"\x00\x00\x00\x01"
        + (4).to_bytes(8)
    )
    pairs = [
        (("w", (4,)), ("w@[4]", ())),
        (("w", (4, 0)), ("w", (4,))),
        (("a\x00", ()), ("a", (0,))),
        (("w", (1, 2)), ("w", (258,))),
    ]
    for one, other in pairs:
        assert bound(*one) != bound(*other), (one, other)
    # Outside a checkpoint (no identity) the name is bound, with no offsets.
    assert _associated_prefix(ItemInfo(item="w"), 2) == bound("w", ())
    # Format 3 binds the save after the identity, length-prefixed.
    assert _associated_prefix(ItemInfo(item="w", identity=("w", (4,)), save="s1"), 3) == (
        b"dcp_storage.aes256gcm/3\x00"
        + b"\x00\x00\x00\x01w"
        + b"\x00\x00\x00\x01"
        + (4).to_bytes(8)
        + b"\x00\x00\x00\x02s1"
    )
    # Format 1's binding is kept, byte for byte, for the items earlier releases wrote.
    assert _associated_prefix(ItemInfo(item="w@[4]", identity=("w", (4,))), 1) == (
        b"dcp_storage.aes256gcm/1\x00w@[4]\x00"
    )


def test_format_1_is_read_only() -> None:
    legacy = AES256GCM.from_descriptor("1;key_id=k1;chunk=4096")
    assert legacy.format == 1 and legacy.get_descriptor().startswith("dcp_storage.aes256gcm/1;")
    with pytest.raises(ValueError, match="format 1 is read only"):
        AES256GCM(key=KEY, format=1).transform_to(io.BytesIO())
    with pytest.raises(ValueError, match="format must be one of"):
        AES256GCM(key=KEY, format=4)


def test_an_item_of_a_save_is_bound_to_it_and_one_outside_any_is_not() -> None:
    # Format 3 binds an item to the save that wrote it and asks for a sealed metadata;
    # where no save is known (the transform used outside a checkpoint of ours, e.g. by
    # stock DCP's writer) items are written in format 2, which needs neither.
    aes = AES256GCM(key=KEY, key_id="k1")
    assert aes.get_descriptor().startswith("dcp_storage.aes256gcm/2;")
    bound = aes.for_item(ItemInfo(item="x", save="s1"))
    assert bound.get_descriptor().startswith("dcp_storage.aes256gcm/3;")
    assert AES256GCM.seal_key_ids(bound.get_descriptor().partition("/")[2]) == ("k1",)
    assert AES256GCM.seal_key_ids(aes.get_descriptor().partition("/")[2]) == ()
    sealed = bound.seal_key()
    assert sealed is not None and sealed[0] == "k1" and KEY not in sealed[1]
    assert sealed[1] != aes.fingerprint_key()  # a key of its own
    assert aes.seal_key() is None
    with pytest.raises(ValueError, match="names none"):
        AES256GCM(key=KEY, format=3).transform_to(io.BytesIO())


def test_an_item_read_as_another_saves_fails_authentication() -> None:
    out = io.BytesIO()
    aes = AES256GCM(key=KEY, key_id="k1", chunk_size=CHUNK)
    item = ItemInfo(item="x", identity=("x", ()), save="s1")
    stream = aes.for_item(item).transform_to(FlushOnlyClose(out))  # type: ignore[arg-type]
    stream.write(b"payload" * 100)
    stream.close()
    version = aes.for_item(item).get_descriptor().partition("/")[2]
    for save, told in (("s2", "another save's"), (None, "names no save")):
        reader = AES256GCM.from_descriptor(version).for_item(
            dataclasses.replace(item, save=save, keys={"k1": KEY}.__getitem__)
        )
        with pytest.raises(IntegrityError, match=told):
            reader.transform_from(io.BytesIO(out.getvalue())).read()
    reader = AES256GCM.from_descriptor(version).for_item(
        dataclasses.replace(item, keys={"k1": KEY}.__getitem__)
    )
    assert reader.transform_from(io.BytesIO(out.getvalue())).read() == b"payload" * 100


def test_writer_with_aes_pickles_for_process_based_async_save(tmp_path: Path) -> None:
    import pickle

    aes = AES256GCM(key=KEY, key_id="k1", chunk_size=CHUNK)
    writer = storage.CheckpointWriter(tmp_path, transforms=[ZStandard(), aes])
    clone = pickle.loads(pickle.dumps(writer))
    (copy,) = [t for t in clone.transforms if isinstance(t, AES256GCM)]
    assert repr(copy) == repr(aes) and copy.get_descriptor() == aes.get_descriptor()
    out = io.BytesIO()
    item = ItemInfo(item="x", keys={"k1": KEY}.__getitem__)
    writer_stream = copy.encode(FlushOnlyClose(out), item)  # type: ignore[arg-type]
    writer_stream.write(b"payload")
    writer_stream.close()
    assert aes.decode(io.BytesIO(out.getvalue()), item).read() == b"payload"


def test_a_key_passed_as_key_id_is_never_echoed() -> None:
    # Before: AES256GCM(key=k, key_id=<the key in base64>), a slip when both come from
    # the environment, raised "key_id must be ..., got '2oSUNQ...wv4='": the key in the
    # message, and so in the job's log.
    key = bytes(range(7, 39))
    for slip in (base64.b64encode(key).decode(), key.hex() + "!", key):
        with pytest.raises(ValueError, match="key_id must be") as info:
            AES256GCM(key=key, key_id=slip)  # type: ignore[arg-type]
        told = str(info.value)
        assert "not shown" in told
        for secret in (base64.b64encode(key).decode(), key.hex(), repr(key)):
            assert secret not in told
    with pytest.raises(ValueError, match="got 'bad id'"):
        AES256GCM(key=key, key_id="bad id")  # a short one is still shown


def test_a_save_with_a_keyless_cipher_names_the_fix(tmp_path: Path) -> None:
    # The writer's message, not a reader's: the seal key is asked for before any item.
    with pytest.raises(MissingKeyError, match=r"has no key; pass key=\.\.\. to encrypt"):
        storage.save({"a": torch.ones(3)}, tmp_path / "c", transforms=[AES256GCM(key_id="x")])
    assert not (tmp_path / "c" / ".metadata").exists()
