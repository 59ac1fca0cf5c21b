"""The documented key sources (``DCP_STORAGE_KEYS``, JSON key files): formats, errors
that never echo key material, and the warning for a key file others can reach."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path

import pytest

from extensions import keys_from_environment, keys_from_file
from tests.extensions.test_encryption import KEY, OTHER_KEY


def test_keys_from_environment_formats() -> None:
    env = {
        "DCP_STORAGE_KEYS": (
            f" hexkey={KEY.hex().upper()} , b64={base64.b64encode(KEY).decode()},"
            f"url={base64.urlsafe_b64encode(OTHER_KEY).decode()},"
        )
    }
    assert keys_from_environment(env) == {"hexkey": KEY, "b64": KEY, "url": OTHER_KEY}
    assert keys_from_environment({}) == {}
    assert keys_from_environment({"DCP_STORAGE_KEYS": ""}) == {}


@pytest.mark.parametrize(
    "value", [f"k1={KEY.hex()[:-2]}", "k1", f"k1={base64.b64encode(KEY[:16]).decode()}", "k1=zz"]
)
def test_keys_from_environment_rejects_bad_entries(value: str) -> None:
    with pytest.raises(ValueError, match="DCP_STORAGE_KEYS") as info:
        keys_from_environment({"DCP_STORAGE_KEYS": value})
    assert value.partition("=")[2] not in str(info.value) or "=" not in value


@pytest.mark.parametrize("entry", [f"{KEY.hex()}=k1", KEY.hex(), f"{KEY.hex()}=", "k1=" + "A" * 44])
def test_key_source_errors_never_echo_key_material(tmp_path: Path, entry: str) -> None:
    with pytest.raises(ValueError) as info:
        keys_from_environment({"DCP_STORAGE_KEYS": f"ok={OTHER_KEY.hex()},{entry}"})
    assert KEY.hex() not in str(info.value) and "A" * 16 not in str(info.value)
    assert "entry 2" in str(info.value) or "'k1'" in str(info.value)
    key_id, _, value = entry.partition("=")
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({key_id: value}))
    with pytest.raises(ValueError) as info:
        keys_from_file(path)
    assert KEY.hex() not in str(info.value) and "A" * 16 not in str(info.value)


def test_keys_from_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": KEY.hex(), "k2": base64.b64encode(OTHER_KEY).decode()}))
    path.chmod(0o600)
    assert keys_from_file(path) == {"k1": KEY, "k2": OTHER_KEY}
    path.write_text(json.dumps({"k1": KEY.hex()[:40]}))
    with pytest.raises(ValueError, match=r"keys\.json.*'k1'") as info:
        keys_from_file(path)
    assert KEY.hex()[:40] not in str(info.value)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        keys_from_file(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON key file"):
        keys_from_file(path)


def test_a_binary_key_file_is_refused_without_quoting_its_bytes(tmp_path: Path) -> None:
    # Before: a raw 32-byte key (`openssl rand 32 > key`) passed as --key-file raised
    # UnicodeDecodeError "can't decode byte 0x9f in position 0": a byte of the key on
    # stderr, and in the job's log.
    key = bytes([0x9F]) + KEY[1:]
    path = tmp_path / "key.bin"
    path.write_bytes(key)
    path.chmod(0o600)
    with pytest.raises(ValueError, match=r"key\.bin: not a JSON key file \(not UTF-8") as info:
        keys_from_file(path)
    told = str(info.value)
    assert "0x9f" not in told and "9f" not in told.lower().replace("key.bin", "")
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o620, 0o604, 0o660], ids=oct)
def test_a_key_file_others_can_reach_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": KEY.hex()}))
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="extensions.keys"):
        assert keys_from_file(path) == {"k1": KEY}
    (record,) = caplog.records
    told = record.getMessage()
    assert f"mode {mode:04o}" in told and f"chmod 600 {path}" in told
    assert KEY.hex() not in told


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_private_key_file_is_read_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": KEY.hex()}))
    path.chmod(mode)
    with caplog.at_level(logging.DEBUG, logger="extensions.keys"):
        assert keys_from_file(path) == {"k1": KEY}
    assert not caplog.records


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0, reason="needs root to read another user's 0600 file"
)
def test_a_key_file_of_another_users_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: root (a job's launcher, a CLI run with sudo) read a user's private key file
    # quietly, though that user can swap in a key they know at any time.
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": KEY.hex()}))
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="extensions.keys"):
        assert keys_from_file(path) == {"k1": KEY}
    (record,) = caplog.records
    assert "belongs to user id 65534" in record.getMessage()
    assert KEY.hex() not in record.getMessage()
