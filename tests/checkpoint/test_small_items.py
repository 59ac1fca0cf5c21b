"""Loads of runs of small plain items, which are read into memory a window at a time
and copied from there into their targets: each item is still checked (length, CRC-32C,
where its tensor sits in its archive) and named when it is damaged, and targets the
direct copy does not fit (another dtype, a view, a region) get the same values as a
load item by item."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import storage
from extensions.errors import IntegrityError
from storage.checkpoint import fetch
from storage.checkpoint import storage_format as fmt
from tests.support.trees import assert_tree_equal, zeros_like_tree


def small_state(count: int = 40) -> dict[str, object]:
    gen = torch.Generator().manual_seed(3)
    state: dict[str, object] = {
        f"layers.{i}.scale": torch.randn(64, generator=gen) for i in range(count)
    }
    state["half"] = torch.randn(8, 8, generator=gen).to(torch.bfloat16)
    state["empty"] = torch.empty(0, 3)
    state["scalar"] = torch.tensor(2.5)
    state["step"] = 17  # a non-tensor value in the same run
    state["names"] = ["a", "b"]
    return state


def record(path: Path, fqn: str) -> fmt.StoredItem:
    meta = fmt.load_metadata((path / ".metadata").read_bytes(), str(path))
    return fmt.stored_item(meta.storage_data[MetadataIndex(fqn, [0] * _dims(meta, fqn))])


def _dims(meta: object, fqn: str) -> int:
    return len(meta.state_dict_metadata[fqn].size)  # type: ignore[attr-defined]


def loaded(path: Path, like: dict[str, object]) -> dict[str, object]:
    out = zeros_like_tree(like)
    assert isinstance(out, dict)
    storage.load(out, path)
    return out


def test_many_small_items_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small windows: the items of one run span several of them.
    monkeypatch.setattr(fetch, "HELD_WINDOW", 1000)
    copied: list[bool] = []
    real = fetch.copy_held
    monkeypatch.setattr(fetch, "copy_held", lambda *a: copied.append(real(*a)) or copied[-1])
    state = small_state()
    storage.save(state, tmp_path / "c")
    assert_tree_equal(state, loaded(tmp_path / "c", state))
    assert sum(copied) >= 40  # the small tensors went the direct way


def test_targets_the_direct_copy_does_not_fit_get_the_same_values(tmp_path: Path) -> None:
    state = small_state()
    storage.save(state, tmp_path / "c")
    base = torch.zeros(64, 2)
    out = zeros_like_tree(state)
    assert isinstance(out, dict)
    out["layers.0.scale"] = base[:, 0]  # a strided view: not contiguous
    out["layers.1.scale"] = torch.zeros(64, dtype=torch.float64)  # another dtype
    out["half"] = torch.zeros(8, 8, dtype=torch.float32)
    storage.load(out, tmp_path / "c")
    assert torch.equal(base[:, 0], state["layers.0.scale"])  # type: ignore[arg-type]
    assert torch.equal(out["layers.1.scale"], state["layers.1.scale"].double())  # type: ignore[union-attr]
    assert torch.equal(out["half"], state["half"].float())  # type: ignore[union-attr]
    assert torch.equal(out["layers.2.scale"], state["layers.2.scale"])  # type: ignore[arg-type]


def test_a_flipped_byte_in_one_small_item_is_named(tmp_path: Path) -> None:
    state = small_state()
    storage.save(state, tmp_path / "c")
    item = record(tmp_path / "c", "layers.7.scale")
    data = tmp_path / "c" / item.relative_path
    raw = bytearray(data.read_bytes())
    raw[item.offset + item.length - 300] ^= 0x01  # inside its tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"item 'layers\.7\.scale'.*checksum mismatch"):
        loaded(tmp_path / "c", state)


def test_a_data_file_cut_short_names_the_first_item_past_its_end(tmp_path: Path) -> None:
    state = {f"t{i:02d}": torch.full((32,), float(i)) for i in range(20)}
    storage.save(state, tmp_path / "c")
    item = record(tmp_path / "c", "t12")
    data = tmp_path / "c" / item.relative_path
    data.write_bytes(data.read_bytes()[: item.offset + 10])
    with pytest.raises(IntegrityError, match=r"item 't12'.*truncated"):
        loaded(tmp_path / "c", state)


def test_a_record_that_misplaces_the_tensor_is_refused_not_copied(tmp_path: Path) -> None:
    """The held bytes are copied straight only where the record's facts fit them; a
    record whose tensor offset points past its item goes the checked way, which
    refuses it."""
    state = {f"t{i:02d}": torch.full((32,), float(i)) for i in range(6)}
    storage.save(state, tmp_path / "c")
    meta = fmt.load_metadata((tmp_path / "c" / ".metadata").read_bytes(), str(tmp_path / "c"))
    index = MetadataIndex("t03", [0])
    info = meta.storage_data[index]
    info.dcp_storage["data_offset"] = fmt.stored_item(info).length  # past its bytes
    (tmp_path / "c" / ".metadata").write_bytes(fmt.dump_metadata(meta))
    with pytest.raises(Exception, match=r"t03"):
        loaded(tmp_path / "c", state)


@pytest.mark.parametrize(
    "make",
    [lambda: torch._efficientzerotensor(64), lambda: torch.zeros(64).to_mkldnn()],
    ids=["zero-tensor", "mkldnn"],
)
def test_targets_without_memory_of_their_own_fail_as_item_by_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: object
) -> None:
    """A target whose data pointer is not its values (a ZeroTensor's is null: a copy to
    it crashed the process) is never copied into straight: the load fails naming the
    item, as it does item by item."""
    state = small_state()
    storage.save(state, tmp_path / "c")
    errors = []
    for held in (fetch.HELD_ITEM, 0):
        monkeypatch.setattr(fetch, "HELD_ITEM", held)
        out = zeros_like_tree(state)
        assert isinstance(out, dict)
        out["layers.3.scale"] = make()  # type: ignore[operator]
        with pytest.raises(Exception, match=r"layers\.3\.scale") as caught:
            storage.load(out, tmp_path / "c")
        errors.append((caught.type, str(caught.value)))
    assert errors[0] == errors[1]
