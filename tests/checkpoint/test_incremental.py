"""Incremental checkpoints: unchanged items are referenced, not written again; readers,
the CLI, retention and deletion follow the references, and hostile ones are refused."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import storage
from extensions.encryption import AES256GCM
from extensions.errors import (
    CheckpointInUseError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from extensions.zstd import ZStandard
from storage.checkpoint import storage_format as fmt
from storage.cli.main import main
from storage.ops.describe import describe
from storage.ops.verify import verify
from tests.support.servers import boto3_client, create_bucket, list_keys, moto_endpoint, s3_options
from tests.support.trees import assert_tree_equal

KEY = bytes(range(32))
FROZEN = ("base.w", "base.emb")


def _state(step: int) -> dict[str, Any]:
    """LoRA-like: a frozen base (same every step) and adapters that change each step."""
    frozen = torch.Generator().manual_seed(0)
    moving = torch.Generator().manual_seed(1000 + step)
    return {
        "base.w": torch.randn(256, 128, generator=frozen).to(torch.bfloat16),
        "base.emb": torch.randn(512, 64, generator=frozen),
        "lora.A": torch.randn(8, 128, generator=moving),
        "opt": {"step": step, "lr": 1e-3 * step},
    }


def _blank() -> dict[str, Any]:
    return {
        "base.w": torch.zeros(256, 128, dtype=torch.bfloat16),
        "base.emb": torch.zeros(512, 64),
        "lora.A": torch.zeros(8, 128),
        "opt": {"step": -1, "lr": 0.0},
    }


def _data_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.suffix == ".distcp")


def _refs(path: Path | str) -> dict[str, str | None]:
    return {r.item: r.ref for r in describe(storage.LocalFileSystem(), str(path)).items}


def _load(url: str, **kw: Any) -> dict[str, Any]:
    out = _blank()
    storage.load(out, url, **kw)
    return out


def test_unchanged_items_are_referenced_and_write_nothing(tmp_path: Path) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(1), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    assert _data_bytes(tmp_path / "step-2") == 0  # every item equal: no data file at all
    assert set(_refs(tmp_path / "step-2").values()) == {"step-1"}
    assert_tree_equal(_load(str(tmp_path / "step-2")), _state(1))


def test_a_drains_paced_bytes_are_the_items_stored_in_the_step_itself(tmp_path: Path) -> None:
    # A tiered manager paces each step's drain over the bytes it uploads; counting the
    # referenced items too made an incremental step's drain run ahead of its pace.
    from storage.ops.copy_data import stored_bytes
    from storage.ops.parts import read_metadata

    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    [part] = read_metadata(storage.LocalFileSystem(), str(tmp_path / "step-2"))
    written = stored_bytes(part, references=False)
    assert written == _data_bytes(tmp_path / "step-2")
    frozen = 256 * 128 * 2 + 512 * 64 * 4  # referenced: stored in step-1
    assert frozen <= stored_bytes(part) - written < frozen + 4096


def test_changed_items_are_rewritten(tmp_path: Path) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    refs = _refs(tmp_path / "step-2")
    assert {k for k, v in refs.items() if v == "step-1"} == set(FROZEN)
    assert refs["lora.A"] is None and refs["opt.step"] is None
    changed = 8 * 128 * 4
    frozen = 256 * 128 * 2 + 512 * 64 * 4
    assert changed <= _data_bytes(tmp_path / "step-2") < changed + 8192 < frozen // 10
    assert_tree_equal(_load(str(tmp_path / "step-2")), _state(2))
    assert_tree_equal(_load(str(tmp_path / "step-1")), _state(1))


def test_base_must_be_a_committed_sibling(tmp_path: Path) -> None:
    storage.save(_state(1), tmp_path / "a" / "step-1", fingerprint=True)
    with pytest.raises(ValueError, match="beside"):
        storage.save(_state(1), tmp_path / "b" / "step-2", base=str(tmp_path / "a" / "step-1"))
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        storage.save(_state(1), tmp_path / "a" / "step-2", base=str(tmp_path / "a" / "step-9"))


def test_manager_round_trip_chain_and_full_every(tmp_path: Path) -> None:
    mgr = storage.CheckpointManager(tmp_path, incremental=True, full_every=3)
    for step in range(1, 6):
        mgr.save(step, _state(step))
    # References are flattened: step-3 points at step-1, where the bytes are (one hop).
    assert _refs(tmp_path / "step-3")["base.w"] == "step-1"
    assert set(_refs(tmp_path / "step-4").values()) == {None}  # every third save is full
    assert _refs(tmp_path / "step-5")["base.w"] == "step-4"
    for step in range(1, 6):
        out = _blank()
        assert mgr.load(out, step) == step
        assert_tree_equal(out, _state(step))


def test_manager_never_bases_on_a_rank_local_step(tmp_path: Path, caplog: Any) -> None:
    # Before: the newest step, committed only by __0.metadata, was
    # picked as the base and every later save failed ("not a committed checkpoint (no
    # .metadata)"), though the docs say rank-local steps are never bases.
    caplog.set_level(logging.INFO, logger="storage.ops.manager")
    mgr = storage.CheckpointManager(tmp_path, incremental=True)
    mgr.save(1, _state(1))
    writer = storage.CheckpointWriter(tmp_path / "step-2", fingerprint=True)
    dcp.save(_state(2), storage_writer=writer, no_dist=True, use_collectives=False)
    assert mgr.steps() == [1, 2]
    mgr.save(3, _state(3))  # a full save: step-2 is no base
    mgr.save(4, _state(4))
    assert set(_refs(tmp_path / "step-3").values()) == {None}
    assert "step 2 is no base (it is committed only by rank-local metadata)" in caplog.text
    assert _refs(tmp_path / "step-4")["base.w"] == "step-3"
    for step in (3, 4):
        out = _blank()
        assert mgr.load(out, step) == step
        assert_tree_equal(out, _state(step))


def test_manager_saves_in_full_over_a_base_that_lost_a_data_file(
    tmp_path: Path, caplog: Any
) -> None:
    """The newest step's metadata is there but one of its data files is not: it is no
    base, so the next save is a full one and says why. Before, the save referenced the
    missing file and failed just before its commit ("lost ... during the save")."""
    caplog.set_level(logging.INFO, logger="storage.ops.manager")
    mgr = storage.CheckpointManager(tmp_path, incremental=True)
    mgr.save(1, _state(1))
    lost = next((tmp_path / "step-1").glob("*.distcp"))
    lost.unlink()
    mgr.save(2, _state(2))
    assert set(_refs(tmp_path / "step-2").values()) == {None}
    assert f"step 1 is no base ({tmp_path / 'step-1'} lacks its file {lost.name})" in caplog.text
    out = _blank()
    assert mgr.load(out, 2) == 2
    assert_tree_equal(out, _state(2))


def test_retention_keeps_referenced_bases(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="storage.ops.manager")
    mgr = storage.CheckpointManager(tmp_path, keep_last=1, incremental=True)
    for step in range(1, 4):
        mgr.save(step, _state(step))
    assert mgr.steps() == [1, 3]  # step-1 holds step-3's frozen bytes; step-2 went
    assert "step-3 references its bytes" in caplog.text
    assert mgr.referenced_by() == {1: [3]}
    out = _blank()
    mgr.load(out)
    assert_tree_equal(out, _state(3))


def test_delete_and_rm_refuse_a_referenced_base(tmp_path: Path, capsys: Any) -> None:
    mgr = storage.CheckpointManager(tmp_path, incremental=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    with pytest.raises(CheckpointInUseError, match="step-2"):
        mgr.delete(1)
    assert main(["rm", str(tmp_path / "step-1")]) == 1
    assert "step-2 beside it reference its bytes" in capsys.readouterr().err
    assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    assert "kept step-1: referenced by step-2" in capsys.readouterr().out
    assert_tree_equal(_load(str(tmp_path / "step-2")), _state(2))
    mgr.delete(2)
    mgr.delete(1)  # no longer referenced
    assert mgr.steps() == []


def test_overwriting_a_referenced_base_is_refused(tmp_path: Path) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    with pytest.raises(CheckpointInUseError, match="overwrite"):
        storage.save(_state(3), tmp_path / "step-1")
    assert_tree_equal(_load(str(tmp_path / "step-1")), _state(1))
    assert_tree_equal(_load(str(tmp_path / "step-2")), _state(2))


def _set_ref(step_dir: Path, ref: object) -> None:
    meta_path = step_dir / fmt.METADATA_NAME
    metadata = pickle.loads(meta_path.read_bytes())  # our own file, trusted in this test
    for info in metadata.storage_data.values():
        extra = getattr(info, fmt.EXTRA)  # forged as stored
        if fmt.REF in extra:
            extra[fmt.REF] = ref
    meta_path.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize(
    "ref", ["..", "../step-1", "/etc", "s3://other-bucket/step-1", "other/step-1", "", 7]
)
def test_hostile_references_are_refused(tmp_path: Path, ref: object) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    _set_ref(tmp_path / "step-2", ref)
    with pytest.raises(UnsafeCheckpointError, match="references base checkpoint"):
        storage.load(_blank(), tmp_path / "step-2")
    assert main(["inspect", str(tmp_path / "step-2")]) == 1


def test_missing_or_uncommitted_base_is_a_named_error(tmp_path: Path) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    (tmp_path / "step-1" / fmt.METADATA_NAME).unlink()  # as an interrupted delete leaves it
    with pytest.raises(CheckpointNotFoundError) as err:
        storage.load(_blank(), tmp_path / "step-2")
    message = str(err.value)
    assert "base.emb" in message or "base.w" in message
    assert "step-1" in message and "not committed" in message and "restore the base" in message
    shutil.rmtree(tmp_path / "step-1")
    with pytest.raises(CheckpointNotFoundError, match="which is missing"):
        storage.load(_blank(), tmp_path / "step-2")
    report = verify(storage.LocalFileSystem(), str(tmp_path / "step-2"))
    assert set(report.bad) == set(FROZEN) and "lora.A" in report.ok


def test_a_data_file_its_committed_base_lost_is_named_in_the_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A base still committed but missing the data file a referenced item is stored in
    (removed by hand): the error names the base as the place the file is missing.
    Before, it named only the loaded checkpoint, whose directory never held that file,
    so a user looking there found nothing wrong."""
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    for data in (tmp_path / "step-1").glob("*.distcp"):
        data.unlink()
    base = f"of its base '{tmp_path / 'step-1'}'"
    with pytest.raises(CheckpointNotFoundError, match=f"data file '__0_0-.*' {base}"):
        storage.load(_blank(), tmp_path / "step-2")
    for command in (["cp"], ["export", "--format", "safetensors"]):
        assert main([*command, str(tmp_path / "step-2"), str(tmp_path / "out")]) == 1
        assert re.search(f"data file '__0_0-.*' {base}", capsys.readouterr().err)


class _DeletesBase(DefaultSavePlanner):
    """Removes the base after the writer read it: as a concurrent `rm` would."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def create_global_plan(self, all_plans: Any) -> Any:
        shutil.rmtree(self.base)
        return super().create_global_plan(all_plans)


def test_base_deleted_during_the_save_commits_nothing(tmp_path: Path) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    writer = storage.CheckpointWriter(tmp_path / "step-2", base=str(tmp_path / "step-1"))
    with pytest.raises(CheckpointException, match="during the save"):
        dcp.save(_state(2), storage_writer=writer, planner=_DeletesBase(tmp_path / "step-1"))
    assert not (tmp_path / "step-2" / fmt.METADATA_NAME).exists()
    assert _data_bytes(tmp_path / "step-2") == 0  # its own files were removed


def test_encrypted_incremental_uses_keyed_fingerprints(tmp_path: Path) -> None:
    chain = [ZStandard(), AES256GCM(key=KEY, key_id="k")]
    mgr = storage.CheckpointManager(tmp_path, transforms=chain, keys={"k": KEY}, incremental=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert {k for k, v in _refs(tmp_path / "step-2").items() if v} == set(FROZEN)
    records = [
        fmt.stored_item(i).content
        for i in fmt.load_metadata(
            (tmp_path / "step-1" / ".metadata").read_bytes(), "x"
        ).storage_data.values()
    ]
    assert all(r.startswith("keyed-") for r in records)
    # Salted: the same content saved again gets an unrelated record.
    storage.save(_state(1), tmp_path / "again", transforms=chain, fingerprint=True)
    again = describe(storage.LocalFileSystem(), str(tmp_path / "again"))
    assert again.items and set(records).isdisjoint(
        fmt.stored_item(i).content
        for i in fmt.load_metadata(
            (tmp_path / "again" / ".metadata").read_bytes(), "x"
        ).storage_data.values()
    )
    out = _blank()
    mgr.load(out, 2)
    assert_tree_equal(out, _state(2))
    # Another key cannot match the keyed records: everything is written again.
    other = [ZStandard(), AES256GCM(key=bytes(32), key_id="k")]
    storage.save(_state(2), tmp_path / "step-3", transforms=other, base=str(tmp_path / "step-2"))
    assert set(_refs(tmp_path / "step-3").values()) == {None}


def test_cli_inspect_verify_cp_and_stock_reader(tmp_path: Path, capsys: Any) -> None:
    storage.save(_state(1), tmp_path / "step-1", fingerprint=True)
    storage.save(_state(2), tmp_path / "step-2", base=str(tmp_path / "step-1"))
    assert main(["inspect", str(tmp_path / "step-2"), "--json"]) == 0
    items = {i["item"]: i["ref"] for i in json.loads(capsys.readouterr().out)["items"]}
    assert items["base.w"] == "step-1" and items["lora.A"] is None
    assert main(["inspect", str(tmp_path / "step-2")]) == 0
    assert "in bases" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "step-2")]) == 0
    # Stock DCP cannot follow a reference: it looks for the base's file in step-2.
    with pytest.raises(CheckpointException, match="distcp"):
        dcp.load(_blank(), storage_reader=FileSystemReader(tmp_path / "step-2"))
    assert main(["cp", str(tmp_path / "step-2"), str(tmp_path / "copy")]) == 0
    assert set(_refs(tmp_path / "copy").values()) == {None}
    out = _blank()
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "copy"))  # stock reads the copy
    assert_tree_equal(out, _state(2))
    # verify reads the referenced bytes too: damage one in the base.
    data = next(p for p in (tmp_path / "step-1").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "step-2")]) == 1
    assert main(["verify", str(tmp_path / "copy")]) == 0


def test_s3_round_trip_writes_only_changed_items() -> None:
    endpoint = moto_endpoint()
    bucket = f"incr-{uuid.uuid4().hex[:8]}"
    create_bucket(endpoint, bucket)
    root = f"s3://{bucket}/run"
    mgr = storage.CheckpointManager(
        root, storage_options=s3_options(endpoint), keep_last=1, incremental=True
    )
    for step in range(1, 4):
        mgr.save(step, _state(step))
    assert mgr.steps() == [1, 3]
    client = boto3_client(endpoint)
    sizes = {
        k: client.head_object(Bucket=bucket, Key=k)["ContentLength"]
        for k in list_keys(client, bucket, "run/step-3/")
        if k.endswith(".distcp")
    }
    assert 0 < sum(sizes.values()) < 8 * 128 * 4 + 8192  # the adapter and opt values only
    out = _blank()
    mgr.load(out, 3)
    assert_tree_equal(out, _state(3))
    assert {r.ref for r in describe(mgr.fs, mgr.step_path(3)).items} == {None, "step-1"}


def test_bytes_items_are_referenced_too(tmp_path: Path) -> None:
    state = {"w": torch.ones(4), "cfg": {"name": "net", "dims": [1, 2, 3]}}
    storage.save(state, tmp_path / "step-1", fingerprint=True)
    storage.save(state, tmp_path / "step-2", base=os.fspath(tmp_path / "step-1"))
    assert set(_refs(tmp_path / "step-2").values()) == {"step-1"}
    out = {"w": torch.zeros(4), "cfg": {"name": "", "dims": [0, 0, 0]}}
    storage.load(out, tmp_path / "step-2")
    assert_tree_equal(out, state)


def test_async_incremental_save(tmp_path: Path) -> None:
    mgr = storage.CheckpointManager(tmp_path, keep_last=1, incremental=True)
    mgr.save(1, _state(1))
    future = mgr.save(2, _state(2), blocking=False)
    assert future is not None
    future.result()
    assert {k for k, v in _refs(tmp_path / "step-2").items() if v} == set(FROZEN)
    assert mgr.steps() == [1, 2]
    out = _blank()
    mgr.load(out)
    assert_tree_equal(out, _state(2))
