"""Key material for AES256GCM: validation and the two documented key sources.

Readers take ``keys=`` as a mapping ``{key_id: 32-byte key}`` or a callable. For the CLI
and scripts, keys also come from the ``DCP_STORAGE_KEYS`` environment variable
(``"id1=KEY,id2=KEY"``) or a JSON key file (``{"id1": "KEY"}``), each KEY written as 64
hex digits or base64. :func:`lookup_key` is how a decoder (and a reader, before it
fetches an item) asks for a key by id. No function here ever puts key material in a
message.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING

from extensions.errors import MissingKeyError, printable, quote

if TYPE_CHECKING:
    from extensions.base import ItemInfo

log = logging.getLogger(__name__)

KEY_SIZE = 32
ENV_VAR = "DCP_STORAGE_KEYS"
_KEY_ID = re.compile(r"[A-Za-z0-9._:@+-]{1,128}")


def check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"an AES-256 key must be bytes, got {type(key).__name__}; decode hex or base64 "
            "first (bytes.fromhex(...)) or use extensions.keys_from_environment/keys_from_file"
        )
    key = bytes(key)
    if len(key) != KEY_SIZE:
        raise ValueError(f"an AES-256 key must be {KEY_SIZE} bytes long, got {len(key)} bytes")
    return key


def check_key_id(key_id: object) -> str:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise ValueError(
            "key_id must be 1-128 characters from A-Z a-z 0-9 . _ : @ + -, got "
            f"{shown_key_id(key_id)}"
        )
    return key_id


def shown_key_id(key_id: object) -> str:
    """A key_id that may be wrong, as a message may show it: one shorter than a key quoted; a
    longer one, or bytes, only by its length (a key passed as key_id by mistake, the
    44 characters of a base64 key, '=' and all, must not reach a log)."""
    if isinstance(key_id, str) and len(key_id) < KEY_SIZE:
        return quote(key_id)
    if isinstance(key_id, str):
        return f"{len(key_id)} characters (not shown: they could be a key)"
    if isinstance(key_id, (bytes, bytearray)):
        return f"{len(key_id)} bytes (not shown: they could be a key; key_id is a str)"
    return f"an object of type {type(key_id).__name__}"


def lookup_key(key_id: str, item: ItemInfo) -> bytes:
    """The key ``item.keys`` gives for ``key_id``. A key that is missing (``KeyError``,
    ``None``) or unusable raises :class:`MissingKeyError` naming the item and the ways to
    pass one; anything else the key provider raises (a vault down, a denied request) is
    the error to see, as itself, with a note naming the key id and the item."""
    where = (
        f"{item.checkpoint}: item {quote(item.item)}" if item.item else item.checkpoint or "item"
    )
    missing = (
        f"{where} is encrypted with key_id {quote(key_id)}, but no key was given for it; "
        f"pass keys={{{quote(key_id)}: <32-byte key>}} (or a callable) to the reader or "
        f"storage.load, or set {ENV_VAR}={printable(key_id, 64)}=<hex or base64 key>"
    )
    key: object = None
    if item.keys is not None:
        try:
            key = item.keys(key_id)
        except KeyError as exc:
            raise MissingKeyError(missing) from exc
        except Exception as exc:
            exc.add_note(f"dcp-storage: raised by the key provider for key_id {key_id!r} ({where})")
            raise
    if key is None:
        raise MissingKeyError(missing)
    try:
        return check_key(key)
    except (TypeError, ValueError) as exc:
        raise MissingKeyError(
            f"{where}: the key given for key_id {key_id!r} is unusable: {exc}"
        ) from None


def _named(key_id: str, number: int) -> str:
    """How a key source's entry is named in errors: never anything that could be a key
    (an entry written ``KEY=key_id`` by mistake would otherwise echo the key)."""
    if _KEY_ID.fullmatch(key_id) and len(key_id) <= 32:
        return f"key_id {key_id!r}"
    return f"entry {number}"


def _decode_key_text(text: str, key_id: str, number: int, where: str) -> bytes:
    if not _KEY_ID.fullmatch(key_id) or len(key_id) > 2 * KEY_SIZE - 1:
        raise ValueError(
            f"{where}: {_named(key_id, number)} does not start with a valid key_id (1-63 of "
            "A-Z a-z 0-9 . _ : @ + -); entries look like key_id=KEY"
        )
    text = text.strip()
    key: bytes | None = None
    if len(text) == 2 * KEY_SIZE:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = None
    if key is None:
        try:
            key = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            key = None
    if key is None or len(key) != KEY_SIZE:
        raise ValueError(
            f"{where}: the key of {_named(key_id, number)} is not a {KEY_SIZE}-byte key "
            f"written as {2 * KEY_SIZE} hex digits or base64"
        )
    return key


def keys_from_environment(environ: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Keys from ``DCP_STORAGE_KEYS="id1=KEY,id2=KEY"`` (each key 64 hex digits or base64).

    Returns ``{}`` when the variable is unset or empty. Pass the result as
    ``keys=`` to the reader or ``storage.load``.
    """
    env = os.environ if environ is None else environ
    keys: dict[str, bytes] = {}
    entries = [e.strip() for e in env.get(ENV_VAR, "").split(",")]
    for number, entry in enumerate((e for e in entries if e), start=1):
        key_id, sep, value = entry.partition("=")
        if not sep:
            raise ValueError(
                f"{ENV_VAR}: entry {number} is not key_id=KEY (entries are separated by commas)"
            )
        keys[key_id.strip()] = _decode_key_text(value, key_id.strip(), number, ENV_VAR)
    return keys


def keys_from_file(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Keys from a JSON file holding ``{"key_id": "64 hex digits or base64", ...}``.

    Keep the file readable by its owner only (``chmod 600``): a file that other users
    can read or write (any group or other permission bit), or that another user owns, is
    read with a logged warning.
    """
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            _warn_if_others_can_reach(f.fileno(), where)
            data = json.load(f)
    except json.JSONDecodeError as exc:
        # The decoder's message quotes no key material, only a position.
        raise ValueError(f"{where}: not a JSON key file (line {exc.lineno})") from None
    except UnicodeDecodeError:
        # Its message quotes the byte it choked on: one byte of a raw binary key.
        raise ValueError(
            f"{where}: not a JSON key file (not UTF-8 text: a raw binary key?); write "
            '{"key_id": "<64 hex digits or base64>"}, e.g. from `openssl rand -hex 32`'
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a key file must hold a JSON object {{key_id: key}}")
    keys: dict[str, bytes] = {}
    for number, (key_id, value) in enumerate(data.items(), start=1):
        if not isinstance(value, str):
            raise ValueError(f"{where}: the key of {_named(key_id, number)} must be a string")
        keys[key_id] = _decode_key_text(value, key_id, number, where)
    return keys


def _warn_if_others_can_reach(fd: int, where: str) -> None:
    """Warn (as ssh does of a private key) when users other than the owner may read the
    key file (and decrypt every checkpoint) or write it (and swap in a key they know),
    and when its owner is another user (who may do both: root reading a user's file)."""
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    if os.name != "posix":
        return
    if mode & 0o077:
        log.warning(
            "%s: the key file is open to other users (mode %04o): whoever can read it can "
            "decrypt your checkpoints, whoever can write it can swap in a key they know; "
            "make it private: chmod 600 %s",
            where,
            mode,
            where,
        )
    elif info.st_uid not in (os.geteuid(), 0):
        log.warning(
            "%s: the key file belongs to user id %d, not to you: they can swap in a key "
            "they know (and read every checkpoint saved with it); use a copy of your own, "
            "chmod 600",
            where,
            info.st_uid,
        )
