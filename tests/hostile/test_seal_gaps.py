"""Sealed metadata against an attacker who edits storage only (no key), in the paths
that trusted a metadata without its seal being checked: a load whose plan reads
nothing (every state-dict entry dropped from a partial load; a rank of a read-once load
that only receives what others read), and an incremental save that copies its base's
records into its own metadata and seals them (docs/transforms.md, "Threat model")."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

import storage
from extensions.encryption import AES256GCM
from extensions.errors import IntegrityError
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.api import unwrap_checkpoint_exception
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.seal import seals_of
from tests.support.distributed import gloo_group, spawn

KEY = bytes(range(40, 72))  # test-only
KEYS = {"k1": KEY}


def _aes() -> AES256GCM:
    return AES256GCM(key=KEY, key_id="k1", chunk_size=1024)


def _metadata(ckpt: Path) -> Metadata:
    return fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))


def _write_back(ckpt: Path, metadata: Metadata) -> None:
    """``metadata`` written back as an attacker would: with the seal it had."""
    facts = {k: v for k, v in fmt.checkpoint_facts(metadata).items() if k != fmt.FORMAT}
    facts[fmt.SEAL] = seals_of(metadata)
    (ckpt / ".metadata").write_bytes(fmt.dump_metadata(metadata, **facts))


def _shifted(metadata: Metadata, fqn: str) -> Metadata:
    """``metadata`` with item ``fqn``'s tensor offset in its archive moved by 16 bytes:
    a record altered without the key, whose loads would read shifted values."""
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    record = fmt.stored_item(metadata.storage_data[index])
    metadata.storage_data[index] = fmt.new_storage_info(
        dataclasses.replace(record, data_offset=(record.data_offset or 0) + 16)
    )
    return metadata


def _partial_load(ckpt: Path, target: dict[str, torch.Tensor], **reader: Any) -> None:
    """``dcp.load`` into ``target`` with keys, allowing what the checkpoint lacks."""
    dcp.load(
        target,
        storage_reader=CheckpointReader(ckpt, keys=KEYS, **reader),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )


def test_a_partial_load_of_a_checkpoint_whose_entries_were_all_dropped_fails(
    tmp_path: Path,
) -> None:
    # A partial load leaves the targets the checkpoint does not hold as they were. With
    # every state-dict entry dropped, the plan read nothing, so the seal was never
    # checked: the load "succeeded" with none of the checkpoint's values, as if it
    # held none of them.
    ckpt = tmp_path / "ckpt"
    storage.save({"a": torch.full((64,), 1.0)}, ckpt, transforms=[_aes()])
    metadata = _metadata(ckpt)
    metadata.state_dict_metadata.clear()
    _write_back(ckpt, metadata)
    target = {"a": torch.zeros(64)}
    with pytest.raises(CheckpointException) as info:
        _partial_load(ckpt, target)
    real = unwrap_checkpoint_exception(info.value)
    assert isinstance(real, IntegrityError) and "seal does not verify" in str(real)
    assert str(ckpt) in str(real)


def test_a_rank_that_reads_nothing_itself_checks_the_seal_of_its_metadata(
    tmp_path: Path,
) -> None:
    # Under read-once, a rank whose items are all read by other ranks fetches nothing
    # and only applies what it receives, through its own plan, made from its own read
    # of .metadata: that metadata was never checked (one swapped in between the ranks'
    # reads mapped the received values onto other entries). Every rank of a load
    # holding keys checks the metadata it plans with.
    ckpt = tmp_path / "ckpt"
    storage.save(
        {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}, ckpt, transforms=[_aes()]
    )
    metadata = _metadata(ckpt)
    metadata.state_dict_metadata["a"], metadata.state_dict_metadata["b"] = (
        metadata.state_dict_metadata["b"],
        metadata.state_dict_metadata["a"],
    )
    metadata.planner_data = {"a": ("b",), "b": ("a",)}
    _write_back(ckpt, metadata)
    reader = CheckpointReader(ckpt, keys=KEYS)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    planner = DefaultLoadPlanner()
    with pytest.raises(IntegrityError, match="seal does not verify"):
        reader.read_data(LoadPlan([]), planner).wait()


def test_an_incremental_save_does_not_seal_records_altered_in_its_base(
    tmp_path: Path,
) -> None:
    # A save with a base copies the base's record of each unchanged item (its layout
    # facts included) into its own metadata, then seals it. The base's metadata was
    # not checked: a record altered there (the tensor's offset in its archive moved by
    # 16 bytes) was sealed into the new checkpoint under the key, whose loads then
    # accepted it and read shifted values.
    value = {"w": torch.arange(256.0)}
    storage.save(value, tmp_path / "step-1", transforms=[_aes()], fingerprint=True)
    _write_back(tmp_path / "step-1", _shifted(_metadata(tmp_path / "step-1"), "w"))
    with pytest.raises(IntegrityError, match="step-1") as raised:
        storage.save(value, tmp_path / "step-2", transforms=[_aes()], base=str(tmp_path / "step-1"))
    assert "does not verify" in str(raised.value) and "save in full" in str(raised.value)
    assert not (tmp_path / "step-2" / ".metadata").exists()


def test_an_incremental_save_over_a_base_whose_seal_was_removed_is_saved_in_full(
    tmp_path: Path,
) -> None:
    # With the seal removed as well, the base cannot be told from one never sealed:
    # nothing of it is referenced, so nothing altered in it is sealed again.
    value = {"w": torch.arange(256.0)}
    storage.save(value, tmp_path / "step-1", transforms=[_aes()], fingerprint=True)
    metadata = _shifted(_metadata(tmp_path / "step-1"), "w")
    (tmp_path / "step-1" / ".metadata").write_bytes(fmt.dump_metadata(metadata))
    storage.save(value, tmp_path / "step-2", transforms=[_aes()], base=str(tmp_path / "step-1"))
    records = _metadata(tmp_path / "step-2").storage_data.values()
    assert all(fmt.stored_item(i).ref is None for i in records)
    target = {"w": torch.zeros(256)}
    storage.load(target, tmp_path / "step-2", keys=KEYS)
    assert torch.equal(target["w"], value["w"])


class _ReadAfterTheSwap(CheckpointReader):
    """A reader whose read of .metadata comes after an attacker swapped it (one more
    state-dict entry), as a rank reading it later than another may: the race made
    deterministic."""

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        metadata = super().read_metadata(*args, **kwargs)
        metadata.state_dict_metadata["forged"] = metadata.state_dict_metadata["a"]
        return metadata


def _receiving_rank_worker(rank: int, store: str, path: str) -> None:
    with gloo_group(rank, 2, store, timeout=timedelta(seconds=120)):
        kind = CheckpointReader if rank == 0 else _ReadAfterTheSwap
        target = {"a": torch.zeros(64)}
        # One item both ranks need: rank 0 owns it, rank 1 only receives it.
        with pytest.raises(CheckpointException) as info:
            dcp.load(target, storage_reader=kind(path, keys=KEYS, read_once=True))
        # Rank 1 refuses its metadata; rank 0 hears it, naming rank 1.
        failures = info.value.failures
        assert set(failures) == {0, 1} and "IntegrityError" in repr(failures[1]), failures
        assert all("seal does not verify" in str(e) for e in failures.values()), failures


def test_a_read_once_rank_that_only_receives_checks_its_own_metadata(tmp_path: Path) -> None:
    # The 2-rank form of the test above: rank 1 planned with a metadata nobody checked
    # and loaded what rank 0 sent through it.
    ckpt = tmp_path / "ckpt"
    storage.save({"a": torch.full((64,), 1.0)}, ckpt, transforms=[_aes()])
    spawn(_receiving_rank_worker, (str(tmp_path / "store"), str(ckpt)))


@pytest.mark.parametrize("where", ["storage_meta", "origin"])
def test_a_checkpoint_relabelled_with_another_save_id_is_refused(
    tmp_path: Path, where: str
) -> None:
    # The save a checkpoint holds (a copy's origin, else its storage_meta.save_id) is
    # what the tiered restore compares to pick a node's local copy over the durable
    # one, and what a user may compare with the id they expect. Before it was sealed,
    # an older checkpoint relabelled with the expected id loaded as that save.
    ckpt = tmp_path / "ckpt"
    storage.save({"a": torch.full((64,), 1.0)}, ckpt, transforms=[_aes()])
    metadata = _metadata(ckpt)
    if where == "storage_meta":
        metadata.storage_meta.save_id = "0123456789ab"
    else:
        facts = fmt.checkpoint_facts(metadata)
        facts[fmt.ORIGIN] = "0123456789ab"
    _write_back(ckpt, metadata)
    assert fmt.save_of(_metadata(ckpt)) == "0123456789ab"
    with pytest.raises(IntegrityError, match="seal does not verify"):
        storage.load({"a": torch.zeros(64)}, ckpt, keys=KEYS)


def test_a_checkpoint_forged_to_hold_nothing_is_refused_where_encryption_is_required(
    tmp_path: Path,
) -> None:
    # A metadata with no item and no seal, put in place of an encrypted checkpoint:
    # a load that reads nothing of it (a planner that takes what the checkpoint holds,
    # as the torchft transport's does, or a partial load) got nothing and no error, and
    # the caller's state stayed as it was, as if healed.
    ckpt = tmp_path / "ckpt"
    storage.save({"a": torch.full((64,), 1.0)}, ckpt, transforms=[_aes()])
    metadata = _metadata(ckpt)
    metadata.state_dict_metadata.clear()
    metadata.storage_data.clear()
    (ckpt / ".metadata").write_bytes(fmt.dump_metadata(metadata))  # no seal either
    with pytest.raises(CheckpointException) as info:
        _partial_load(ckpt, {"a": torch.zeros(64)})
    real = unwrap_checkpoint_exception(info.value)
    assert "holds no encrypted item" in str(real) and "require_encryption=False" in str(real)
    # Asked for, an unencrypted (here empty) checkpoint loads as what it is.
    _partial_load(ckpt, {"a": torch.zeros(64)}, require_encryption=False)


def test_a_manager_saves_in_full_over_an_altered_base_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An incremental manager must neither seal records copied from an altered base nor
    # stop checkpointing because of it: the next step is saved in full, with a warning
    # naming the base.
    manager = storage.CheckpointManager(
        tmp_path, incremental=True, transforms=[_aes()], keys=KEYS, persist="thread"
    )
    state = {"a": torch.arange(64.0), "b": torch.ones(8)}
    manager.save(1, state)
    step1 = tmp_path / "step-1"
    _write_back(step1, _shifted(_metadata(step1), "a"))
    with caplog.at_level("WARNING", logger="storage.ops.manager"):
        manager.save(2, state)
    assert any("seal" in r.getMessage() and "step-1" in r.getMessage() for r in caplog.records)
    step2 = _metadata(tmp_path / "step-2")
    assert all(fmt.stored_item(i).ref is None for i in step2.storage_data.values())
    target = {"a": torch.zeros(64), "b": torch.zeros(8)}
    assert manager.load(target) == 2 and torch.equal(target["a"], state["a"])
