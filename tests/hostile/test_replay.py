"""Encrypted items replayed by someone with write access and no key: item records
swapped within a checkpoint, items carried over from another checkpoint under the same
key (another item, or the same item rolled back), a state-dict key that spells another
item's chunk (``w@[4]``), and a descriptor relabelled to an older format
(docs/transforms.md, "Threat model").

Each attack rewrites only the metadata (and copies data files), as an attacker would:
records keep their own checksums. Two defences stand between such a change and the
loaded tensors, and each attack is tried against both (the ``reseal`` fixture): as an
attacker leaves it, the metadata's seal no longer verifies; resealed, as only a key
holder could (a buggy tool holding the key), the item's own binding (its key, chunk
offsets and save, in AES-GCM's associated data) must still refuse it. Each test says
what happened before the fix it guards."""

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
from storage.checkpoint.seal import make_seals, seals_of
from tests.support.rank_local import RankWriter

KEY = bytes(range(100, 132))


def _aes() -> AES256GCM:
    return AES256GCM(key=KEY, key_id="k1", chunk_size=1024)


def _metadata(ckpt: Path) -> Metadata:
    return fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))


@pytest.fixture(params=[False, True], ids=["as-an-attacker-leaves-it", "resealed"])
def reseal(request: pytest.FixtureRequest) -> bool:
    """Whether a tampered metadata is resealed under the key before it is loaded."""
    return bool(request.param)


def _write_metadata(ckpt: Path, metadata: Metadata, reseal: bool) -> None:
    """Write ``metadata`` back: with the seal it had (which no longer verifies), or
    resealed under the key, so the items' own binding alone must refuse the change."""
    seals = make_seals(metadata, [_aes()], "r", ".metadata") if reseal else seals_of(metadata)
    (ckpt / ".metadata").write_bytes(fmt.dump_metadata(metadata, **{fmt.SEAL: seals}))


def _refusal(reseal: bool, binding: str) -> str:
    """What the load's error says: the seal's refusal, else the binding's (``binding``)."""
    return binding if reseal else "seal does not verify: the metadata was altered"


def _load(ckpt: Path, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    storage.load(target, ckpt, keys={"k1": KEY})
    return target


def _swap(ckpt: Path, one: MetadataIndex, other: MetadataIndex, reseal: bool) -> None:
    """Swap two items' records: each name then points at the other's stored bytes."""
    metadata = _metadata(ckpt)
    data = metadata.storage_data
    data[one], data[other] = data[other], data[one]
    _write_metadata(ckpt, metadata, reseal)


def test_items_swapped_within_a_checkpoint_fail_naming_checkpoint_and_item(
    tmp_path: Path, reseal: bool
) -> None:
    # Guards the binding of each item's ciphertext to its own key: with the records of
    # two same-sized items swapped, each would load the other's values.
    ckpt = tmp_path / "ckpt"
    storage.save(
        {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}, ckpt, transforms=[_aes()]
    )
    _swap(ckpt, MetadataIndex("a", [0]), MetadataIndex("b", [0]), reseal)
    with pytest.raises(IntegrityError, match=r"item '(a|b)'") as info:
        _load(ckpt, {"a": torch.zeros(64), "b": torch.zeros(64)})
    told = str(info.value)
    assert str(ckpt) in told
    assert _refusal(reseal, "failed authentication") in told
    assert not reseal or "another item's encrypted bytes" in told


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


def test_a_key_spelling_another_items_chunk_cannot_stand_in_for_it(
    tmp_path: Path, reseal: bool
) -> None:
    # Before: the associated data bound the item's name as messages show it, "w@[4]"
    # for both the key "w@[4]" and the chunk of "w" at offset 4, so with their records
    # swapped the load returned the values of "w@[4]" as the second half of "w".
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.arange(8.0), "w@[4]": torch.full((4,), 666.0)}
    writer = storage.CheckpointWriter(ckpt, transforms=[_aes()], thread_count=1)
    dcp.save(state, storage_writer=writer, planner=_Halves(), no_dist=True)
    target = _load(ckpt, {"w": torch.zeros(8), "w@[4]": torch.zeros(4)})
    assert torch.equal(target["w"], state["w"])  # the two chunks load as saved

    _swap(ckpt, MetadataIndex("w", [4]), MetadataIndex("w@[4]", [0]), reseal)
    told = _refusal(reseal, "failed authentication")
    with pytest.raises(IntegrityError, match=rf"item 'w(@\[4\])?'.*{told}"):
        _load(ckpt, {"w": torch.zeros(8), "w@[4]": torch.zeros(4)})


def _two_saves(tmp_path: Path) -> tuple[Path, Path]:
    """Two checkpoints under one key: ``old`` and ``new``, the same keys, other values."""
    old, new = tmp_path / "old", tmp_path / "new"
    for ckpt, value in ((old, 1.0), (new, 2.0)):
        state = {"a": torch.full((64,), value), "b": torch.full((64,), value + 10)}
        storage.save(state, ckpt, transforms=[_aes()], thread_count=1)
    return old, new


def _carry_over(old: Path, new: Path, source: str, target: str, reseal: bool) -> None:
    """Put ``old``'s item ``source`` in place of ``new``'s item ``target``: its data
    file copied beside ``new``'s (data file names are unique per save) and the record."""
    theirs = _metadata(old).storage_data[MetadataIndex(source, [0])]
    shutil.copy(old / theirs.relative_path, new / theirs.relative_path)
    metadata = _metadata(new)
    metadata.storage_data[MetadataIndex(target, [0])] = theirs
    _write_metadata(new, metadata, reseal)


def test_another_item_of_another_checkpoint_cannot_stand_in(tmp_path: Path, reseal: bool) -> None:
    # Guards the item binding across saves: "b" of an older checkpoint put in place of
    # "a" (data file copied over, record rewritten) would load as "a".
    old, new = _two_saves(tmp_path)
    _carry_over(old, new, "b", "a", reseal)
    told = _refusal(reseal, "another item's encrypted bytes")
    with pytest.raises(IntegrityError, match=rf"item 'a'.*{told}"):
        _load(new, {"a": torch.zeros(64), "b": torch.zeros(64)})


def test_the_same_item_of_an_older_checkpoint_cannot_roll_it_back(tmp_path: Path) -> None:
    # Before: ciphertext was bound to the item, not to one save, and the metadata was
    # not authenticated, so "a" of an older checkpoint under the same key, with its
    # record, loaded in place of this checkpoint's "a": a silent rollback of one item.
    # Now the changed record breaks the seal.
    old, new = _two_saves(tmp_path)
    _carry_over(old, new, "a", "a", reseal=False)
    with pytest.raises(IntegrityError, match=r"item 'a'.*seal does not verify"):
        _load(new, {"a": torch.zeros(64), "b": torch.zeros(64)})


def test_older_bytes_under_this_saves_record_cannot_roll_an_item_back(
    tmp_path: Path, reseal: bool
) -> None:
    # The older checkpoint's bytes of "a" put under a record that still names this
    # save (pointed at them, checksum to match; resealed, as if the checksums had
    # collided, or the bytes written over this item's own): the bytes are bound to the
    # save that wrote them, and must not authenticate as this save's.
    old, new = _two_saves(tmp_path)
    theirs = fmt.stored_item(_metadata(old).storage_data[MetadataIndex("a", [0])])
    shutil.copy(old / theirs.relative_path, new / theirs.relative_path)
    metadata = _metadata(new)
    index = MetadataIndex("a", [0])
    ours = fmt.stored_item(metadata.storage_data[index])
    assert ours.save != theirs.save
    metadata.storage_data[index] = fmt.new_storage_info(dataclasses.replace(theirs, save=ours.save))
    _write_metadata(new, metadata, reseal)
    told = _refusal(reseal, "another save's")
    with pytest.raises(IntegrityError, match=rf"item 'a'.*{told}"):
        _load(new, {"a": torch.zeros(64), "b": torch.zeros(64)})


def test_a_metadata_without_its_seal_is_refused(tmp_path: Path) -> None:
    # A sealed checkpoint's metadata rewritten without the seal (as a tool that drops
    # unknown facts would) must not load its items as if nothing were sealed.
    _, new = _two_saves(tmp_path)
    (new / ".metadata").write_bytes(fmt.dump_metadata(_metadata(new)))
    with pytest.raises(IntegrityError, match=r"item '(a|b)'.*carries no seal for this key"):
        _load(new, {"a": torch.zeros(64), "b": torch.zeros(64)})


@pytest.mark.parametrize("change", ["flattening", "dtype"], ids=["the-flattening-map", "a-dtype"])
def test_a_changed_state_dict_entry_breaks_the_seal(tmp_path: Path, change: str) -> None:
    # What the state means is sealed too, not only the records: the planner's map of
    # which state-dict path each key loads into (two layers' weights swapped there
    # would load each into the other), and each entry's dtype.
    ckpt = tmp_path / "ckpt"
    state = {"m": {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}}
    storage.save(state, ckpt, transforms=[_aes()], thread_count=1)
    metadata = _metadata(ckpt)
    if change == "flattening":
        mapping = metadata.planner_data
        mapping["m.a"], mapping["m.b"] = mapping["m.b"], mapping["m.a"]
    else:
        metadata.state_dict_metadata["m.a"].properties.dtype = torch.int32
    _write_metadata(ckpt, metadata, reseal=False)
    target = {"m": {"a": torch.zeros(64), "b": torch.zeros(64)}}
    with pytest.raises(IntegrityError, match=r"seal does not verify"):
        storage.load(target, ckpt, keys={"k1": KEY})


def _relabel(ckpt: Path, format: int, *, header_too: bool) -> None:
    """Rewrite item "a"'s AES descriptor to the older ``format`` and, with
    ``header_too``, its header's format byte as well (and its checksum, so only AES can
    tell); the seal is left as it was, as an attacker would (an older format needs none)."""
    metadata = _metadata(ckpt)
    info = metadata.storage_data[MetadataIndex("a", [0])]
    info.transform_descriptors = [
        d.replace("aes256gcm/3;", f"aes256gcm/{format};") for d in info.transform_descriptors
    ]
    if header_too:
        path = ckpt / info.relative_path
        data = bytearray(path.read_bytes())
        assert data[info.offset + 4] == 3  # "DCPE", then the format byte
        data[info.offset + 4] = format
        path.write_bytes(bytes(data))
        stored = bytes(data[info.offset : info.offset + info.length])
        getattr(info, fmt.EXTRA)[fmt.CRC32C] = crc32c.crc32c(stored)
    _write_metadata(ckpt, metadata, reseal=False)


@pytest.mark.parametrize("format", [1, 2], ids=["to-format-1", "to-format-2"])
@pytest.mark.parametrize("header_too", [False, True], ids=["descriptor", "descriptor+header"])
def test_a_relabelled_older_descriptor_is_refused(
    tmp_path: Path, header_too: bool, format: int
) -> None:
    # Guards the downgrade: an item written in format 3 and relabelled to an older
    # format must not be checked under its weaker binding (format 1's is ambiguous,
    # neither binds the save, neither asks for the seal). With the header still saying
    # 3 the mismatch is named; with both rewritten, format 3's associated data (its own
    # label first) does not authenticate as the older format's.
    ckpt = tmp_path / "ckpt"
    storage.save({"a": torch.full((64,), 1.0)}, ckpt, transforms=[_aes()], thread_count=1)
    _relabel(ckpt, format, header_too=header_too)
    told = (
        "failed authentication"
        if header_too
        else f"header says format 3 but its descriptor says format {format}"
    )
    with pytest.raises(IntegrityError, match=rf"item 'a'.*{told}"):
        _load(ckpt, {"a": torch.zeros(64)})


def test_one_ranks_part_cannot_stand_in_for_anothers(tmp_path: Path) -> None:
    # Under rank-local metadata (use_collectives=False) each rank loads its own
    # __{rank}.metadata. Before the seal named its file, rank 1's metadata copied over
    # rank 0's (its data files are beside it already) loaded rank 1's state on rank 0.
    ckpt = tmp_path / "ckpt"
    for rank in (0, 1):
        writer = RankWriter(rank, ckpt, transforms=[_aes()], thread_count=1)
        state = {"a": torch.full((64,), float(rank)), "b": torch.full((64,), 10.0 + rank)}
        dcp.save(state, storage_writer=writer, use_collectives=False, no_dist=True)
    assert _load(ckpt, {"a": torch.zeros(64), "b": torch.zeros(64)})["a"][0] == 0.0
    shutil.copy(ckpt / "__1.metadata", ckpt / "__0.metadata")
    with pytest.raises(IntegrityError, match=r"item '(a|b)'.*seal does not verify"):
        _load(ckpt, {"a": torch.zeros(64), "b": torch.zeros(64)})
