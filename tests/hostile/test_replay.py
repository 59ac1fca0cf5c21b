"""Encrypted items replayed by someone with write access and no key: item records
swapped within a checkpoint, items carried over from another checkpoint under the same
key, a state-dict key that spells another item's chunk (``w@[4]``), and a descriptor
relabelled to the legacy format (docs/transforms.md, "Threat model").

Each attack rewrites only the metadata (and copies data files), as an attacker would:
records keep their own checksums, so AES-GCM alone stands between the change and the
loaded tensors. Each test says what happened before the fix it guards."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItemType

import storage
from extensions.encryption import AES256GCM
from extensions.errors import IntegrityError
from storage.checkpoint import storage_format as fmt

KEY = bytes(range(100, 132))


def _aes() -> AES256GCM:
    return AES256GCM(key=KEY, key_id="k1", chunk_size=1024)


def _metadata(ckpt: Path) -> Metadata:
    return fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))


def _write_metadata(ckpt: Path, metadata: Metadata) -> None:
    (ckpt / ".metadata").write_bytes(fmt.dump_metadata(metadata))


def _load(ckpt: Path, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    storage.load(target, ckpt, keys={"k1": KEY})
    return target


def _swap(ckpt: Path, one: MetadataIndex, other: MetadataIndex) -> None:
    """Swap two items' records: each name then points at the other's stored bytes."""
    metadata = _metadata(ckpt)
    data = metadata.storage_data
    data[one], data[other] = data[other], data[one]
    _write_metadata(ckpt, metadata)


def test_items_swapped_within_a_checkpoint_fail_naming_checkpoint_and_item(
    tmp_path: Path,
) -> None:
    # Guards the binding of each item's ciphertext to its own key: with the records of
    # two same-sized items swapped, each would load the other's values.
    ckpt = tmp_path / "ckpt"
    storage.save(
        {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}, ckpt, transforms=[_aes()]
    )
    _swap(ckpt, MetadataIndex("a", [0]), MetadataIndex("b", [0]))
    with pytest.raises(IntegrityError, match=r"item '(a|b)'") as info:
        _load(ckpt, {"a": torch.zeros(64), "b": torch.zeros(64)})
    told = str(info.value)
    assert str(ckpt) in told
    assert "failed authentication" in told and "another item's encrypted bytes" in told


class _Halves(DefaultSavePlanner):
    """Saves the 1-D tensor ``w`` as two chunks, at offsets 0 and ``half``, as a
    sharded save would."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if item.index.fqn != "w":
                items.append(item)
                continue
            assert item.tensor_data is not None
            half = item.tensor_data.size[0] // 2
            for offset in (0, half):
                chunk = ChunkStorageMetadata(torch.Size([offset]), torch.Size([half]))
                items.append(
                    dataclasses.replace(
                        item,
                        index=MetadataIndex("w", torch.Size([offset])),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk, item.tensor_data.properties, item.tensor_data.size
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn != "w":
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        return self.state_dict["w"].narrow(0, chunk.offsets[0], chunk.sizes[0])


def test_a_key_spelling_another_items_chunk_cannot_stand_in_for_it(tmp_path: Path) -> None:
    # Before: the associated data bound the item's name as messages show it, "w@[4]"
    # for both the key "w@[4]" and the chunk of "w" at offset 4, so with their records
    # swapped the load returned the values of "w@[4]" as the second half of "w".
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.arange(8.0), "w@[4]": torch.full((4,), 666.0)}
    writer = storage.CheckpointWriter(ckpt, transforms=[_aes()], thread_count=1)
    dcp.save(state, storage_writer=writer, planner=_Halves(), no_dist=True)
    target = _load(ckpt, {"w": torch.zeros(8), "w@[4]": torch.zeros(4)})
    assert torch.equal(target["w"], state["w"])  # the two chunks load as saved

    _swap(ckpt, MetadataIndex("w", [4]), MetadataIndex("w@[4]", [0]))
    with pytest.raises(IntegrityError, match=r"item 'w@\[4\]'.*failed authentication"):
        _load(ckpt, {"w": torch.zeros(8), "w@[4]": torch.zeros(4)})


def _two_saves(tmp_path: Path) -> tuple[Path, Path]:
    """Two checkpoints under one key: ``old`` and ``new``, the same keys, other values."""
    old, new = tmp_path / "old", tmp_path / "new"
    for ckpt, value in ((old, 1.0), (new, 2.0)):
        state = {"a": torch.full((64,), value), "b": torch.full((64,), value + 10)}
        storage.save(state, ckpt, transforms=[_aes()], thread_count=1)
    return old, new


def _carry_over(old: Path, new: Path, source: str, target: str) -> None:
    """Put ``old``'s item ``source`` in place of ``new``'s item ``target``: its data
    file copied beside ``new``'s (data file names are unique per save) and the record."""
    theirs = _metadata(old).storage_data[MetadataIndex(source, [0])]
    shutil.copy(old / theirs.relative_path, new / theirs.relative_path)
    metadata = _metadata(new)
    metadata.storage_data[MetadataIndex(target, [0])] = theirs
    _write_metadata(new, metadata)


def test_another_item_of_another_checkpoint_cannot_stand_in(tmp_path: Path) -> None:
    # Guards the item binding across saves: "b" of an older checkpoint put in place of
    # "a" (data file copied over, record rewritten) would load as "a".
    old, new = _two_saves(tmp_path)
    _carry_over(old, new, "b", "a")
    with pytest.raises(IntegrityError, match=r"item 'a'.*another item's encrypted bytes"):
        _load(new, {"a": torch.zeros(64), "b": torch.zeros(64)})


def test_limit_the_same_item_of_an_older_checkpoint_still_loads(tmp_path: Path) -> None:
    # The documented limit (docs/transforms.md, "Rollback"): ciphertext is bound to the
    # item, not to one save, and the metadata is not authenticated, so the same item of
    # an older checkpoint under the same key authenticates. If this starts failing,
    # the binding grew stronger: update the threat model, then this test.
    old, new = _two_saves(tmp_path)
    _carry_over(old, new, "a", "a")
    target = _load(new, {"a": torch.zeros(64), "b": torch.zeros(64)})
    assert torch.equal(target["a"], torch.full((64,), 1.0))


def _relabel_to_format_1(ckpt: Path, *, header_too: bool) -> None:
    """Rewrite item "a"'s AES descriptor to the legacy format 1 and, with ``header_too``,
    its header's format byte as well (and its checksum, so only AES can tell)."""
    metadata = _metadata(ckpt)
    info = metadata.storage_data[MetadataIndex("a", [0])]
    info.transform_descriptors = [
        d.replace("aes256gcm/2;", "aes256gcm/1;") for d in info.transform_descriptors
    ]
    if header_too:
        path = ckpt / info.relative_path
        data = bytearray(path.read_bytes())
        assert data[info.offset + 4] == 2  # "DCPE", then the format byte
        data[info.offset + 4] = 1
        path.write_bytes(bytes(data))
        stored = bytes(data[info.offset : info.offset + info.length])
        getattr(info, fmt.EXTRA)[fmt.CRC32C] = crc32c.crc32c(stored)
    _write_metadata(ckpt, metadata)


@pytest.mark.parametrize("header_too", [False, True], ids=["descriptor", "descriptor+header"])
def test_a_relabelled_legacy_descriptor_is_refused(tmp_path: Path, header_too: bool) -> None:
    # Guards the downgrade: an item written in format 2 and relabelled as format 1 must
    # not be checked under format 1's weaker (ambiguous) binding. With the header still
    # saying 2 the mismatch is named; with both rewritten, format 2's associated data
    # (its own label first) does not authenticate as format 1's.
    ckpt = tmp_path / "ckpt"
    storage.save({"a": torch.full((64,), 1.0)}, ckpt, transforms=[_aes()], thread_count=1)
    _relabel_to_format_1(ckpt, header_too=header_too)
    told = "failed authentication" if header_too else "header says format 2 but its descriptor"
    with pytest.raises(IntegrityError, match=rf"item 'a'.*{told}"):
        _load(ckpt, {"a": torch.zeros(64)})
