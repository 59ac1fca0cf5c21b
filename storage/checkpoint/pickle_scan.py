"""The scan of an untrusted pickle's opcodes before it is unpickled (a checkpoint's
metadata: :func:`storage.checkpoint.storage_format.load_metadata`).

CPython's C unpickler sizes (and zeroes) its memo table by the largest memo index a
pickle states, and reserves the length an argument claims before it reads it: a few
bytes of hostile pickle could cost tens of GiB before anything refused them. The scan
walks opcode boundaries only and refuses both, in compiled code where
``extensions/_native.c`` was built (``memo_scan``), in Python otherwise; both refuse
the same pickles with the same message.
"""

from __future__ import annotations

import pickle
import pickletools
from types import ModuleType


def check(data: bytes) -> None:
    """Raise ``ValueError`` at an invalid opcode, a memo index beyond the opcodes seen
    so far (``LONG_BINPUT 0x7fffffff`` in a 12-byte file would cost 32 GiB; well-formed
    pickles number memo entries densely, protocol 4+ never even states them) or an
    argument that runs past the end of ``data``. The compiled scan
    (``extensions/_native.c``, where it was built) walks the opcodes ~50x faster than
    :func:`scan_in_python`, which does the same where it was not, and for the text PUTs of
    protocol 0 (never in metadata DCP writes)."""
    if _native is not None and not _native.memo_scan(data, _KINDS):
        return
    scan_in_python(data)


def scan_in_python(data: bytes) -> None:
    """:func:`check` in Python: a scan of opcode boundaries only, several times
    faster than ``pickletools.genops``."""
    pos, end, count = 0, len(data), 0
    while pos < end:
        op = data[pos]
        kind = _ARG_KIND[op]
        pos += 1
        if kind is None:
            raise ValueError(f"invalid pickle opcode {op:#x} at byte {pos - 1}")
        if op == _STOP:
            return
        if kind >= 0:
            if op == _LONG_BINPUT and int.from_bytes(data[pos : pos + 4], "little") > count:
                raise ValueError(f"memo index out of range at byte {pos - 1}")
            pos += kind
            if pos > end:
                raise ValueError(f"the pickle ends inside the argument at byte {pos - kind - 1}")
        elif kind in (_LINE, _TWO_LINES):
            line_end = data.find(b"\n", pos)
            if op == _PUT and line_end != -1 and int(data[pos:line_end]) > count:
                raise ValueError(f"memo index out of range at byte {pos - 1}")
            if kind == _TWO_LINES and line_end != -1:
                line_end = data.find(b"\n", line_end + 1)
            if line_end == -1:
                raise ValueError(f"unterminated line at byte {pos - 1}")
            pos = line_end + 1
        else:
            width = -kind
            at = pos - 1
            pos += width + int.from_bytes(data[pos : pos + width], "little")
            if pos > end:  # a length past the end: the unpickler would reserve it first
                raise ValueError(f"the pickle ends inside the argument at byte {at}")
        count += 1


def _arg_kinds() -> list[int | None]:
    # Per opcode byte: a fixed argument width (>= 0), a length prefix of -k bytes
    # (k = 1, 4, 8), _LINE / _TWO_LINES for text arguments, None for no opcode.
    kinds: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        if op.arg is not None and op.arg.name == "stringnl_noescape_pair":
            n = _TWO_LINES
        elif n == pickletools.UP_TO_NEWLINE:
            n = _LINE
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            n = -1
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            n = -4
        elif n == pickletools.TAKEN_FROM_ARGUMENT8U:
            n = -8
        kinds[ord(op.code)] = n
    return kinds


_LINE, _TWO_LINES = -100, -101
_ARG_KIND = _arg_kinds()
#: _ARG_KIND as the compiled scan takes it: signed bytes, -128 for no opcode.
_KINDS = bytes((-128 if kind is None else kind) & 0xFF for kind in _ARG_KIND)
_native: ModuleType | None
try:  # the compiled scan (extensions/_native.c), built at install where a compiler is
    from extensions import _native
except ImportError:  # pragma: no cover - exercised where no compiler was at install
    _native = None
_STOP, _PUT, _LONG_BINPUT = ord(pickle.STOP), ord(pickle.PUT), ord(pickle.LONG_BINPUT)
