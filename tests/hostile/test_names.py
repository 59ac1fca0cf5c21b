"""Names a checkpoint supplies (base references, data file names, descriptors) and the
base name a save is given: refused when they could not be a file or checkpoint name,
and never quoted raw, whole or with escape sequences, in a message."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import storage
from extensions.base import StreamTransformExtension
from extensions.errors import UnknownTransformError, UnsafeCheckpointError
from extensions.registry import ExtensionRegistry
from storage.checkpoint import storage_format as fmt

HUGE = "x" * 200_000
ESCAPE = "base\x1b[31mRED"


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(10.0), "b": torch.ones(3)}


def _target() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(10), "b": torch.zeros(3)}


def _rewrite(ckpt: Path, change: Callable[[Any], None]) -> None:
    """Apply ``change`` to every item's storage info in ``ckpt``'s .metadata."""
    path = ckpt / ".metadata"
    meta = fmt.load_metadata(path.read_bytes(), str(path))
    for info in meta.storage_data.values():
        change(info)
    path.write_bytes(fmt.dump_metadata(meta))


def _assert_quoted(message: str) -> None:
    assert len(message) < 2000, len(message)
    assert "\x1b" not in message
    assert HUGE[:1000] not in message


@pytest.fixture
def incremental(tmp_path: Path) -> Path:
    storage.save(_state(), tmp_path / "base", fingerprint=True)
    storage.save(_state(), tmp_path / "step", base=tmp_path / "base")
    return tmp_path / "step"


@pytest.mark.parametrize("ref", [HUGE, ESCAPE], ids=["huge", "escape"])
def test_a_reference_name_is_a_plain_bounded_name(incremental: Path, ref: str) -> None:
    """Before: a 200,000-character reference gave a raw ENAMETOOLONG OSError quoting the
    whole 200 KB path; one with an escape sequence reached the error through fs.url
    unquoted ("stored in base checkpoint /…/base\\x1b[31mRED")."""
    _rewrite(incremental, lambda info: getattr(info, fmt.EXTRA).update(ref=ref))
    with pytest.raises(UnsafeCheckpointError, match="references base checkpoint") as info:
        storage.load(_target(), incremental)
    _assert_quoted(str(info.value))


@pytest.mark.parametrize(
    "name", ["__0_0\x1b[2J.distcp", "d" * 300 + ".distcp"], ids=["escape", "long"]
)
def test_a_data_file_name_is_a_plain_bounded_name(tmp_path: Path, name: str) -> None:
    """Before: such a relative_path passed the checks; it reached messages and URLs raw
    (the per-rank error of a multi-rank load quotes the item's URL), or failed with
    the filesystem's own error."""
    storage.save(_state(), tmp_path / "c")
    _rewrite(tmp_path / "c", lambda info: setattr(info, "relative_path", name))
    with pytest.raises(UnsafeCheckpointError, match="not a file inside") as info:
        storage.load(_target(), tmp_path / "c")
    _assert_quoted(str(info.value))


def test_a_base_name_that_cannot_be_recorded_is_refused(tmp_path: Path) -> None:
    """Before: ``base=`` with a 200,000-character name failed with a raw ENAMETOOLONG
    OSError whose message quoted the whole path."""
    with pytest.raises(ValueError, match="plain name of at most 255") as info:
        storage.save(_state(), tmp_path / "step", base=tmp_path / HUGE)
    _assert_quoted(str(info.value))
    assert not (tmp_path / "step" / ".metadata").exists()


class _Strict(StreamTransformExtension):
    """A third-party transform whose errors quote its descriptor's version raw."""

    @staticmethod
    def registry_name() -> str:
        return "acme.strict"

    @staticmethod
    def from_descriptor(version: str) -> _Strict:
        raise ValueError(f"unsupported acme.strict version {version}")

    def get_descriptor(self) -> str:
        return "acme.strict/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return output

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def test_a_transforms_own_error_is_quoted_bounded(tmp_path: Path) -> None:
    """Before: the registry put the transform's error text in its message as it was:
    200 KB and an escape sequence from the checkpoint's descriptor."""
    storage.save(_state(), tmp_path / "c")
    bad = "acme.strict/" + ESCAPE + HUGE
    _rewrite(tmp_path / "c", lambda info: setattr(info, "transform_descriptors", [bad]))
    with pytest.raises(UnknownTransformError, match="cannot decode descriptor") as info:
        storage.load(_target(), tmp_path / "c", registry=ExtensionRegistry([_Strict]))
    _assert_quoted(str(info.value))


def test_an_item_name_a_safetensors_header_cannot_hold_is_refused_before_the_export(
    tmp_path: Path,
) -> None:
    # Before: a key holding a lone surrogate (pickle keeps one, so a checkpoint can) was
    # read, checksummed and loaded, then the export failed encoding the header with a
    # bare UnicodeEncodeError that named neither the checkpoint nor the item.
    from storage import LocalFileSystem
    from storage.ops.export import export_safetensors

    name = "bad\ud800" + ESCAPE
    storage.save({"ok": torch.ones(2), name: torch.ones(3)}, tmp_path / "ckpt")
    fs = LocalFileSystem()
    with pytest.raises(ValueError, match="not UTF-8 text .* --only") as info:
        export_safetensors(fs, str(tmp_path / "ckpt"), fs, str(tmp_path / "model"))
    assert str(tmp_path / "ckpt") in str(info.value) and "bad\\ud800" in str(info.value)
    _assert_quoted(str(info.value))
    assert not (tmp_path / "model").exists()
    writer = storage.SafetensorsWriter(tmp_path / "saved")
    with pytest.raises(BaseException, match="not UTF-8 text"):
        torch.distributed.checkpoint.save({name: torch.ones(3)}, storage_writer=writer)
