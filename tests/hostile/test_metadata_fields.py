"""A metadata's checkpoint-level fields (``storage_meta`` and its save id, a copy's
``origin``), not only its items, are checked when it is read.

Save ids are compared across checkpoints (copies, drains, restores, the seal) and quoted
in their messages: a metadata whose ``storage_meta`` is not one, or whose save id is not
a save id (terminal escapes, 10,000 characters), is refused naming the metadata before
anything uses it, as a malformed item is.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions import AES256GCM
from extensions.errors import IntegrityError, UnsafeCheckpointError
from storage.backends import LocalFileSystem
from storage.ops.copy import copy_checkpoint

ESCAPE = "\x1b]0;pwned\x07\x1b[2J"
HUGE = "y" * 10_000


def _rewrite(ckpt: Path, change: Callable[[Any], None]) -> None:
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _refused(ckpt: Path, what: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=rf"\.metadata: .*{what}") as info:
        storage.load({"t": torch.zeros(4)}, ckpt)
    text = str(info.value)
    assert "\x1b" not in text and "\x07" not in text and len(text) < 2000, text


@pytest.mark.parametrize("value", [5, "step-3", [1, 2]])
def test_a_storage_meta_that_is_not_one_is_refused_naming_the_metadata(
    tmp_path: Path, value: object
) -> None:
    # Before: the reader set this load's id on it and failed with a raw AttributeError
    # ("'int' object has no attribute 'load_id'"), naming neither the checkpoint nor
    # what was wrong.
    storage.save({"t": torch.ones(4)}, tmp_path)
    _rewrite(tmp_path, lambda metadata: setattr(metadata, "storage_meta", value))
    _refused(tmp_path, "storage_meta")


@pytest.mark.parametrize("where", ["save_id", "origin"])
def test_a_save_id_that_is_no_save_id_is_refused_quoted_bounded(tmp_path: Path, where: str) -> None:
    # Before: the checkpoint loaded, and a copy of it carried the id on as its origin
    # (and a drain comparing it quoted it whole in its message: escape sequences that
    # retitle the terminal or clear it, 10,000 characters).
    storage.save({"t": torch.ones(4)}, tmp_path / "c")
    evil = ESCAPE + HUGE

    def change(metadata: Any) -> None:
        if where == "save_id":
            metadata.storage_meta.save_id = evil
        else:
            metadata.dcp_storage["origin"] = evil

    _rewrite(tmp_path / "c", change)
    _refused(tmp_path / "c", "save_id" if where == "save_id" else "origin")
    fs = LocalFileSystem()
    with pytest.raises(UnsafeCheckpointError):
        copy_checkpoint(fs, str(tmp_path / "c"), fs, str(tmp_path / "copy"))
    assert not (tmp_path / "copy" / ".metadata").exists()


def test_stock_and_our_save_ids_still_load(tmp_path: Path) -> None:
    # torch's writer names a save with a uuid4 (36 characters with dashes), ours with
    # 12 hex digits, another writer perhaps with a timestamp; a metadata with no
    # storage_meta (older torch) has none.
    storage.save({"t": torch.ones(4)}, tmp_path)
    for value in ("0b5a2c9e-1f4d-4c3b-9a77-2f1e5d6c7b8a", "2026-12-07T17:00:00.123+00:00", None):
        _rewrite(tmp_path, lambda metadata, v=value: setattr(metadata.storage_meta, "save_id", v))
        target = torch.zeros(4)
        storage.load({"t": target}, tmp_path)
        assert torch.equal(target, torch.ones(4))
    _rewrite(tmp_path, lambda metadata: setattr(metadata, "storage_meta", None))
    storage.load({"t": torch.zeros(4)}, tmp_path)


@pytest.mark.parametrize("field", ["check", "mac"])
def test_a_seal_that_is_not_hex_is_a_missing_seal(tmp_path: Path, field: str) -> None:
    # Before: the seal's strings went to hmac.compare_digest as they were, which raises a
    # raw TypeError ("comparing strings with non-ASCII characters is not supported") on
    # any other character: every load with the key, and every incremental save on it,
    # failed naming neither the checkpoint nor the seal. Now such a seal verifies
    # nothing, as a missing one: the sealed items are refused naming the seal.
    key = bytes(range(32))
    chain = [AES256GCM(key=key, key_id="k")]
    storage.save({"t": torch.ones(4)}, tmp_path / "c", transforms=chain)
    _rewrite(
        tmp_path / "c",
        lambda metadata: metadata.dcp_storage["seal"]["k"].update({field: "\u00e9" * 16}),
    )
    with pytest.raises(IntegrityError, match="'t' among them.*needs sealed metadata"):
        storage.load({"t": torch.zeros(4)}, tmp_path / "c", keys={"k": key})
    storage.save({"t": torch.ones(4)}, tmp_path / "d", transforms=chain, base=tmp_path / "c")
    target = torch.zeros(4)
    storage.load({"t": target}, tmp_path / "d", keys={"k": key})  # saved in full
    assert torch.equal(target, torch.ones(4))
