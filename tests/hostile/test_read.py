"""Reading what is not ours: links and special files in a checkpoint, encryption
downgrade, and errors reported as what they are.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem

import storage
from extensions.encryption import AES256GCM
from extensions.errors import (
    CheckpointStorageError,
    IntegrityError,
    MissingKeyError,
    UnsafeCheckpointError,
)
from storage.backends._local import LocalFileSystem
from storage.checkpoint import storage_format as fmt
from storage.cli import main
from storage.ops.copy import copy_checkpoint
from tests.support.planting import plant_item
from tests.support.sealing import resealed

SECRET = torch.full((256,), 1234.5)


def _stock_save(state: dict[str, torch.Tensor], path: Path) -> None:
    # Stock DCP records no checksums, so nothing ties a data file's bytes to the metadata.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A private checkpoint's data file: what a hostile checkpoint links to."""
    _stock_save({"w": SECRET}, tmp_path / "private")
    return tmp_path / "private" / "__0_0.distcp"


@pytest.fixture
def linked(tmp_path: Path, secret: Path) -> Path:
    """A checkpoint of the same shape whose data file is a symlink to ``secret``."""
    ckpt = tmp_path / "shared"
    _stock_save({"w": torch.zeros(256)}, ckpt)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(secret)
    return ckpt


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_STORAGE_KEYS", raising=False)


# --- links and special files -------------------------------------------------


def test_load_refuses_a_data_file_that_links_elsewhere(linked: Path) -> None:
    # Before: the load followed the link and handed the private checkpoint's values over.
    target = {"w": torch.zeros(256)}
    with pytest.raises(UnsafeCheckpointError, match="symbolic link") as info:
        storage.load(target, linked)
    assert "__0_0.distcp" in str(info.value) and str(linked) in str(info.value)
    assert "cp --remove-destination" in str(info.value)
    assert not torch.equal(target["w"], SECRET)


def test_load_refuses_linked_metadata(tmp_path: Path) -> None:
    # Before: a .metadata linked from anywhere on the machine was read as this checkpoint's.
    storage.save({"w": torch.ones(4)}, tmp_path / "other")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for data in (tmp_path / "other").glob("*.distcp"):
        (ckpt / data.name).write_bytes(data.read_bytes())
    (ckpt / ".metadata").symlink_to(tmp_path / "other" / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.load({"w": torch.zeros(4)}, ckpt)


def test_cp_never_copies_what_a_link_points_at(
    linked: Path, secret: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `dcp-storage cp` copied the private data file to the destination.
    dst = tmp_path / "dst"
    assert main(["cp", "-q", str(linked), str(dst)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert not (dst / ".metadata").exists()
    leaked = secret.read_bytes()
    for path in dst.rglob("*") if dst.exists() else ():
        assert not path.is_file() or leaked not in path.read_bytes()


def test_verify_reports_a_linked_data_file(
    linked: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: verify read the private file, found nothing wrong and said OK.
    assert main(["verify", "-q", str(linked)]) == 1
    assert "symbolic link" in capsys.readouterr().out


@pytest.mark.timeout(60)  # a safety net only: the assertion does not depend on time
def test_load_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    # Before: opening the FIFO blocked until a writer came along, i.e. forever.
    ckpt = tmp_path / "ckpt"
    storage.save({"w": torch.ones(4)}, ckpt)
    (data,) = ckpt.glob("*.distcp")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(UnsafeCheckpointError, match="FIFO"):
        storage.load({"w": torch.zeros(4)}, ckpt)


def test_a_linked_checkpoint_directory_still_loads(tmp_path: Path) -> None:
    # The policy's other half: `ckpt -> /mnt/...` is the user's own link and is followed.
    storage.save({"w": torch.arange(4.0)}, tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    target = {"w": torch.zeros(4)}
    storage.load(target, tmp_path / "link")
    assert torch.equal(target["w"], torch.arange(4.0))


# --- errors reported as what they are, early -------------------------------

KEY = bytes(range(32))


class _CountingFileSystem(LocalFileSystem):
    """Local disk that counts the data reads it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.slices = 0

    def open_slice(self, path: str, offset: int, length: int) -> Any:
        self.slices += 1
        return super().open_slice(path, offset, length)


@pytest.fixture
def encrypted(tmp_path: Path) -> Path:
    ckpt = tmp_path / "enc"
    state = {"w": torch.arange(64.0), "b": torch.ones(3), "meta": {"step": 3}}
    storage.save(state, ckpt, transforms=[AES256GCM(key=KEY, key_id="k1")])
    return ckpt


@pytest.mark.parametrize("raised", [RuntimeError("vault down"), ValueError("denied")])
def test_a_failing_key_provider_raises_its_own_error_before_any_read(
    encrypted: Path, raised: Exception
) -> None:
    # Before: RuntimeError came out as "IntegrityError: cannot decode" after the whole
    # item was downloaded; ValueError as "UnknownTransformError ... a newer dcp-storage
    # may be needed".
    def provider(key_id: str) -> bytes:
        raise raised

    fs = _CountingFileSystem()
    with pytest.raises(type(raised)) as info:
        storage.load({"w": torch.zeros(64)}, encrypted, keys=provider, filesystem=fs)
    assert info.value is raised
    assert not isinstance(info.value, CheckpointStorageError)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "key provider" in note and "'k1'" in note and "item 'w'" in note
    assert fs.slices == 0


def test_a_provider_without_the_key_is_a_missing_key(encrypted: Path) -> None:
    # Before: the provider's KeyError was swallowed; now it is the MissingKeyError's cause.
    def provider(key_id: str) -> bytes:
        raise KeyError(key_id)

    fs = _CountingFileSystem()
    with pytest.raises(MissingKeyError, match="key_id 'k1'") as info:
        storage.load({"w": torch.zeros(64)}, encrypted, keys=provider, filesystem=fs)
    assert isinstance(info.value.__cause__, KeyError)
    assert fs.slices == 0


def test_the_key_provider_is_asked_once_per_key_id(encrypted: Path) -> None:
    # Before: it was asked once per item (a metered secret manager paid for each).
    asked: list[str] = []

    def provider(key_id: str) -> bytes:
        asked.append(key_id)
        return KEY

    target = {"w": torch.zeros(64), "b": torch.zeros(3), "meta": {"step": 0}}
    storage.load(target, encrypted, keys=provider)
    assert asked == ["k1"] and torch.equal(target["w"], torch.arange(64.0))


def test_cp_transcoding_reports_the_provider_error(encrypted: Path, tmp_path: Path) -> None:
    # Before: copy_checkpoint reported it as "IntegrityError: cannot decode".
    def provider(key_id: str) -> bytes:
        raise RuntimeError("vault down")

    fs = LocalFileSystem()
    with pytest.raises(RuntimeError, match="vault down"):
        copy_checkpoint(
            fs, str(encrypted), fs, str(tmp_path / "plain"), transforms=[], keys=provider
        )


class _TargetsOfAnotherShape(DefaultLoadPlanner):
    """A planner whose targets do not have the shape of what it asks to read."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return torch.zeros(2, 2)


def test_a_target_of_another_shape_is_a_value_error_not_damage(tmp_path: Path) -> None:
    # Before: IntegrityError ("stored shape ... does not match"), as if the bytes were bad.
    storage.save({"w": torch.arange(16.0).reshape(4, 4)}, tmp_path / "ckpt")
    reader = storage.CheckpointReader(tmp_path / "ckpt")
    with pytest.raises(CheckpointException):  # DCP's wrapper; the reader keeps the real one
        dcp.load(
            {"w": torch.zeros(4, 4)},
            storage_reader=reader,
            planner=_TargetsOfAnotherShape(),
            no_dist=True,
        )
    error = reader.last_error
    assert isinstance(error, ValueError) and not isinstance(error, IntegrityError)
    assert "item 'w'" in str(error) and "(4, 4)" in str(error) and "(2, 2)" in str(error)


# --- encryption downgrade --------------------------------------------------

FORGED = torch.full((64,), 666.0)


def _swap_for_plain(ckpt: Path, fqn: str, tmp_path: Path, *, reseal: bool = False) -> None:
    """What an attacker with write access and no key can do: replace an encrypted
    item's record (and bytes) with a plain one holding values of their choosing (the
    seal left as it was, so it no longer verifies). ``reseal``: as only a key holder
    could, making a checkpoint that mixes plain and encrypted items on purpose."""
    plain = tmp_path / "forged"
    storage.save({fqn: FORGED}, plain)
    meta = fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))
    forged = fmt.load_metadata((plain / ".metadata").read_bytes(), str(plain))
    for index, info in forged.storage_data.items():
        meta.storage_data[index] = info
        (ckpt / info.relative_path).write_bytes((plain / info.relative_path).read_bytes())
    if reseal:
        (ckpt / ".metadata").write_bytes(resealed(meta, AES256GCM(key=KEY, key_id="k1")))
    else:
        facts = fmt.checkpoint_facts(meta)
        (ckpt / ".metadata").write_bytes(fmt.dump_metadata(meta, **{fmt.SEAL: facts[fmt.SEAL]}))


@pytest.fixture
def downgraded(encrypted: Path, tmp_path: Path) -> Path:
    _swap_for_plain(encrypted, "w", tmp_path)
    return encrypted


def test_an_item_swapped_for_a_plain_one_is_refused_with_keys(downgraded: Path) -> None:
    # Before: the load returned the forged values; having keys did not mean encrypted.
    fs = _CountingFileSystem()
    target = {"w": torch.zeros(64)}
    with pytest.raises(UnsafeCheckpointError, match="item 'w' is not encrypted") as info:
        storage.load(target, downgraded, keys={"k1": KEY}, filesystem=fs)
    assert "require_encryption=False" in str(info.value)
    assert fs.slices == 0 and not torch.equal(target["w"], FORGED)


def test_require_encryption_false_accepts_plain_items(encrypted: Path, tmp_path: Path) -> None:
    # The documented opt-out: the caller takes plain items of a checkpoint that mixes
    # plain and encrypted items on purpose (sealed by its writer) for what they say.
    _swap_for_plain(encrypted, "w", tmp_path, reseal=True)
    target = {"w": torch.zeros(64), "b": torch.zeros(3)}
    storage.load(target, encrypted, keys={"k1": KEY}, require_encryption=False)
    assert torch.equal(target["w"], FORGED) and torch.equal(target["b"], torch.ones(3))


@pytest.mark.parametrize("read", [["w", "b"], ["w"]], ids=["with-an-encrypted-item", "alone"])
def test_a_forged_plain_item_is_refused_by_the_seal_even_when_plain_is_allowed(
    downgraded: Path, read: list[str]
) -> None:
    # Before sealed metadata, require_encryption=False loaded the forged item: nothing
    # could tell a forged plain record from one its writer made. Now a reader holding
    # keys checks the seal before it trusts any record, the plain item's too, even when
    # it reads that item alone.
    target = {"w": torch.zeros(64), "b": torch.zeros(3)}
    target = {k: v for k, v in target.items() if k in read}
    with pytest.raises(IntegrityError, match="seal does not verify"):
        storage.load(target, downgraded, keys={"k1": KEY}, require_encryption=False)
    assert not torch.equal(target["w"], FORGED)


def test_no_keys_no_policy(tmp_path: Path) -> None:
    # An empty key mapping (the CLI's when no key source is set) asks for nothing.
    storage.save({"w": torch.ones(2)}, tmp_path / "plain")
    target = {"w": torch.zeros(2)}
    storage.load(target, tmp_path / "plain", keys={})
    assert torch.equal(target["w"], torch.ones(2))


def test_manager_load_refuses_a_downgraded_step(encrypted: Path, tmp_path: Path) -> None:
    # Before: CheckpointManager.load returned the forged values too.
    root = tmp_path / "run"
    root.mkdir()
    encrypted.rename(root / "step-1")
    _swap_for_plain(root / "step-1", "w", tmp_path)
    manager = storage.CheckpointManager(root, keys={"k1": KEY})
    with pytest.raises(UnsafeCheckpointError, match="item 'w'"):
        manager.load({"w": torch.zeros(64)})
    relaxed = storage.CheckpointManager(root, keys={"k1": KEY}, require_encryption=False)
    target = {"w": torch.zeros(64)}
    with pytest.raises(IntegrityError, match="seal does not verify"):
        relaxed.load(target)  # the metadata was altered: the seal tells


def test_cli_verify_reports_a_downgraded_item(
    downgraded: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: verify said OK for the forged item.
    monkeypatch.setenv("DCP_STORAGE_KEYS", f"k1={KEY.hex()}")
    assert main(["verify", "-q", str(downgraded)]) == 1
    assert "'w' is not encrypted" in capsys.readouterr().out
    # Plain items allowed, the altered metadata still fails its seal.
    assert main(["verify", "-q", "--no-require-encryption", str(downgraded)]) == 1
    assert "seal does not verify" in capsys.readouterr().out


def test_cli_cp_never_seals_a_forged_item(
    downgraded: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: re-encrypting with --transform sealed the forged values under a fresh,
    # valid encryption, so the copy passed every later check.
    monkeypatch.setenv("DCP_STORAGE_KEYS", f"k1={KEY.hex()}")
    dst = tmp_path / "dst"
    assert main(["cp", "-q", "--transform", "aes:k1", str(downgraded), str(dst)]) == 1
    assert "'w' is not encrypted" in capsys.readouterr().err
    assert not (dst / ".metadata").exists()
    # Plain items allowed, the altered metadata still fails its seal: nothing resealed.
    args = ["cp", "-q", "--no-require-encryption", "--transform", "aes:k1"]
    assert main([*args, str(downgraded), str(dst)]) == 1
    assert "seal does not verify" in capsys.readouterr().err
    assert not (dst / ".metadata").exists()


def test_a_swapped_key_id_fails_authentication(encrypted: Path) -> None:
    # Not a downgrade: an item that claims another key id the reader also holds is
    # decrypted with that key, whose key check fails (the claim in docs/transforms.md).
    meta_path = encrypted / ".metadata"
    meta = fmt.load_metadata(meta_path.read_bytes(), str(encrypted))
    for info in meta.storage_data.values():
        info.transform_descriptors = [
            d.replace("key_id=k1", "key_id=k2") for d in info.transform_descriptors
        ]
    meta_path.write_bytes(fmt.dump_metadata(meta))  # no seal under "k2": k2 fails its check
    with pytest.raises(IntegrityError, match="no seal for this key id"):
        storage.load({"w": torch.zeros(64)}, encrypted, keys={"k1": KEY, "k2": bytes(32)})
    # Resealed under k2 by its holder: the item's own key check still refuses it.
    meta_path.write_bytes(resealed(meta, AES256GCM(key=bytes(32), key_id="k2")))
    with pytest.raises(IntegrityError, match="not the key the item was encrypted with"):
        storage.load({"w": torch.zeros(64)}, encrypted, keys={"k1": KEY, "k2": bytes(32)})


# --- a pickle that would run code: refused, and torch's advice never repeated -------------


class _RunsCode:
    """Unpickled by a full unpickler, it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


#: torch's refusal advises "Re-running `torch.load` with `weights_only` set to `False`".
_ADVICE = re.compile(r"weights_only\W*(=|set to)\W*False")


def printed(exc: BaseException) -> str:
    """Every message a traceback of ``exc`` shows (its causes and unsuppressed contexts)."""
    messages = []
    seen: BaseException | None = exc
    while seen is not None:
        messages.append(str(seen))
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "\n".join(messages)


def assert_refused_quietly(exc: BaseException, *names: str) -> None:
    assert isinstance(exc, UnsafeCheckpointError), repr(exc)
    text = printed(exc)
    assert _ADVICE.search(text) is None and "weights_only=False" not in text, text
    assert "posix.system" in str(exc) and all(name in str(exc) for name in names), str(exc)


def test_a_value_that_would_run_code_is_refused_without_torchs_advice(tmp_path: Path) -> None:
    """A non-tensor value holding a payload: refused (nothing runs), but the error quoted
    the first line of torch's message, which advises loading with weights_only=False."""
    marker = tmp_path / "ran"
    storage.save({"x": _RunsCode(marker), "t": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(UnsafeCheckpointError) as info:
        storage.load({"x": None, "t": torch.zeros(2)}, tmp_path / "c")
    assert_refused_quietly(info.value, str(tmp_path / "c"), "'x'")
    assert not marker.exists()


def test_a_tensor_archive_that_would_run_code_is_refused_without_torchs_advice(
    tmp_path: Path,
) -> None:
    """A tensor item without layout facts (torch.load's path) holding a payload: a raw
    pickle.UnpicklingError was reported as damage, torch's advice to load with
    weights_only=False in its message and its cause."""

    marker = tmp_path / "ran"
    storage.save({"t": torch.ones(2)}, tmp_path)
    archive = io.BytesIO()
    torch.save(_RunsCode(marker), archive)
    plant_item(tmp_path, "t", archive.getvalue(), data_offset=None, nbytes=None)
    with pytest.raises(UnsafeCheckpointError) as info:
        storage.load({"t": torch.zeros(2)}, tmp_path)
    assert_refused_quietly(info.value, str(tmp_path), "'t'")
    assert not marker.exists()
