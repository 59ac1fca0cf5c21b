"""Sealed metadata in the paths that write or carry it: a save seals its metadata and
binds each encrypted item to itself; a copy of the stored bytes carries the seal with
no key; a re-encoding copy seals afresh; an incremental save seals the references it
takes from its base; the tiered manager's drain keeps the checkpoint loadable; a
checkpoint written before sealing (format 2) loads as it did. Attacks on the seal are in
tests/hostile/test_replay.py and test_read.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import storage
from extensions import AES256GCM, ZStandard
from extensions.errors import IntegrityError
from storage.checkpoint import storage_format as fmt
from storage.ops.copy import copy_checkpoint
from storage.ops.verify import verify
from tests.support.tiers import tiered

KEY = bytes(range(7, 39))  # test-only
KEYS = {"k1": KEY}


def _aes() -> AES256GCM:
    return AES256GCM(key=KEY, key_id="k1", chunk_size=1024)


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((300,), value), "b": torch.arange(50.0) + value}


def _metadata(ckpt: Path) -> Metadata:
    return fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))


def _load(ckpt: Path, **kw: object) -> dict[str, torch.Tensor]:
    target = {"a": torch.zeros(300), "b": torch.zeros(50)}
    storage.load(target, ckpt, **kw)  # type: ignore[arg-type]
    return target


def _saves(metadata: Metadata) -> set[str | None]:
    return {fmt.stored_item(i).save for i in metadata.storage_data.values()}


def test_a_save_binds_its_items_to_itself_and_seals_its_metadata(tmp_path: Path) -> None:
    storage.save(_state(1.0), tmp_path / "c", transforms=[ZStandard(), _aes()])
    metadata = _metadata(tmp_path / "c")
    assert _saves(metadata) == {metadata.storage_meta.save_id}
    assert set(fmt.checkpoint_facts(metadata)[fmt.SEAL]) == {"k1"}
    assert torch.equal(_load(tmp_path / "c", keys=KEYS)["a"], _state(1.0)["a"])


def test_an_unencrypted_save_records_no_save_and_no_seal(tmp_path: Path) -> None:
    # Nothing would check them: plain and compressed checkpoints stay as they were.
    storage.save(_state(1.0), tmp_path / "c", transforms=[ZStandard()])
    metadata = _metadata(tmp_path / "c")
    assert _saves(metadata) == {None} and fmt.SEAL not in fmt.checkpoint_facts(metadata)


def test_a_copy_of_the_stored_bytes_keeps_the_seal_without_a_key(tmp_path: Path) -> None:
    storage.save(_state(1.0), tmp_path / "src", transforms=[_aes()])
    copy_checkpoint(
        storage.LocalFileSystem(),
        str(tmp_path / "src"),
        storage.LocalFileSystem(),
        str(tmp_path / "dst"),
    )
    src, dst = _metadata(tmp_path / "src"), _metadata(tmp_path / "dst")
    assert fmt.checkpoint_facts(dst)[fmt.SEAL] == fmt.checkpoint_facts(src)[fmt.SEAL]
    assert {i.relative_path for i in dst.storage_data.values()}.isdisjoint(
        {i.relative_path for i in src.storage_data.values()}
    )  # moved: the seal covers no location
    assert torch.equal(_load(tmp_path / "dst", keys=KEYS)["b"], _state(1.0)["b"])


def test_a_reencoding_copy_binds_the_items_to_itself_and_seals_afresh(tmp_path: Path) -> None:
    storage.save(_state(1.0), tmp_path / "src", transforms=[_aes()])
    fs = storage.LocalFileSystem()
    copy_checkpoint(
        fs,
        str(tmp_path / "src"),
        fs,
        str(tmp_path / "dst"),
        transforms=[ZStandard(), _aes()],
        keys=KEYS,
    )
    src, dst = _metadata(tmp_path / "src"), _metadata(tmp_path / "dst")
    assert _saves(dst) == {dst.storage_meta.save_id} != _saves(src)
    assert fmt.checkpoint_facts(dst)[fmt.SEAL] != fmt.checkpoint_facts(src)[fmt.SEAL]
    assert torch.equal(_load(tmp_path / "dst", keys=KEYS)["a"], _state(1.0)["a"])


def test_a_reencoding_copy_of_a_plain_checkpoint_is_sealed(tmp_path: Path) -> None:
    storage.save(_state(1.0), tmp_path / "src")
    fs = storage.LocalFileSystem()
    copy_checkpoint(
        fs, str(tmp_path / "src"), fs, str(tmp_path / "dst"), transforms=[_aes()], keys=KEYS
    )
    assert set(fmt.checkpoint_facts(_metadata(tmp_path / "dst"))[fmt.SEAL]) == {"k1"}
    assert torch.equal(_load(tmp_path / "dst", keys=KEYS)["b"], _state(1.0)["b"])


def test_an_incremental_save_seals_the_references_it_takes(tmp_path: Path) -> None:
    # "a" is unchanged, so the second save references the first's bytes: its record,
    # copied into the new (sealed) metadata, still names the save that wrote them.
    storage.save(_state(1.0), tmp_path / "step-1", transforms=[_aes()], fingerprint=True)
    changed = {"a": _state(1.0)["a"], "b": _state(2.0)["b"]}
    storage.save(changed, tmp_path / "step-2", transforms=[_aes()], base=str(tmp_path / "step-1"))
    first, second = _metadata(tmp_path / "step-1"), _metadata(tmp_path / "step-2")
    a = fmt.stored_item(second.storage_data[MetadataIndex("a", [0])])
    b = fmt.stored_item(second.storage_data[MetadataIndex("b", [0])])
    assert a.ref == "step-1" and a.save == first.storage_meta.save_id
    assert b.ref is None and b.save == second.storage_meta.save_id
    loaded = _load(tmp_path / "step-2", keys=KEYS)
    assert torch.equal(loaded["a"], changed["a"]) and torch.equal(loaded["b"], changed["b"])


def test_a_reference_turned_to_an_older_base_is_refused(tmp_path: Path) -> None:
    # step-3 references step-2's "a"; pointing that reference at step-1's "a" (which
    # differs) must not load step-1's values: the record is sealed.
    for step, value in ((1, 1.0), (2, 2.0)):
        storage.save(
            _state(value), tmp_path / f"step-{step}", transforms=[_aes()], fingerprint=True
        )
    storage.save(
        _state(2.0), tmp_path / "step-3", transforms=[_aes()], base=str(tmp_path / "step-2")
    )
    older = fmt.stored_item(_metadata(tmp_path / "step-1").storage_data[MetadataIndex("a", [0])])
    metadata = _metadata(tmp_path / "step-3")
    index = MetadataIndex("a", [0])
    assert fmt.stored_item(metadata.storage_data[index]).ref == "step-2"
    metadata.storage_data[index] = fmt.new_storage_info(dataclasses.replace(older, ref="step-1"))
    seals = fmt.checkpoint_facts(metadata)[fmt.SEAL]
    (tmp_path / "step-3" / ".metadata").write_bytes(
        fmt.dump_metadata(metadata, **{fmt.SEAL: seals})
    )
    with pytest.raises(IntegrityError, match="seal does not verify"):
        _load(tmp_path / "step-3", keys=KEYS)


def test_a_tiered_save_drains_to_a_sealed_checkpoint(tmp_path: Path) -> None:
    manager = tiered(tmp_path, transforms=[_aes()], keys=KEYS)
    manager.save(1, _state(3.0))
    manager.wait()
    ckpt = tmp_path / "durable" / "step-1"
    assert set(fmt.checkpoint_facts(_metadata(ckpt))[fmt.SEAL]) == {"k1"}
    assert torch.equal(_load(ckpt, keys=KEYS)["a"], _state(3.0)["a"])


def test_a_wrong_key_is_named_as_such(tmp_path: Path) -> None:
    # The seal's key check tells a wrong key from an altered metadata.
    storage.save(_state(1.0), tmp_path / "c", transforms=[_aes()])
    with pytest.raises(IntegrityError, match=r"wrong key for key_id 'k1'.*pass the right key"):
        _load(tmp_path / "c", keys={"k1": bytes(32)})


def test_verify_with_a_wrong_key_says_every_item_under_the_key_fails(
    tmp_path: Path,
) -> None:
    # The seal is checked once for the whole metadata; its refusal named only the item it
    # happened to check with, so verify reported every item as failing "item 'a'".
    storage.save(_state(1.0), tmp_path / "c", transforms=[_aes()])
    report = verify(storage.LocalFileSystem(), str(tmp_path / "c"), keys={"k1": bytes(32)})
    assert sorted(report.bad) and not report.ok
    for label, why in report.bad.items():
        assert "wrong key for key_id 'k1'" in why, (label, why)
        assert "every other item under that key id" in why, (label, why)
