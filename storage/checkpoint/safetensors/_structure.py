"""The shape of a safetensors header's (or index's) JSON, checked from its bytes before
``json`` builds a single Python object.

Python's JSON objects cost many times the text they come from (a dict per ``{}``, some
50 bytes per short string), so a crafted header of the allowed length could cost ~25x
it in memory. Each check here blanks the strings first (nothing in a name counts), then
bounds what the structure may hold: only what a real header or index holds, each entry
at least as long as the shortest real one. Each returns the problem in words, or None;
:mod:`.parse` names the file and the fix.
"""

from __future__ import annotations

import re

#: The shortest entry a tensor can have, its name empty:
#: ``"":{"dtype":"U8","shape":[],"data_offsets":[0,0]}``.
MIN_ENTRY = 49
#: Most members of the one map of strings a header may hold (``__metadata__``) and of an
#: index's ``metadata``: real ones hold a few.
MAX_METADATA = 4096
#: Bytes per JSON value an index has at least: a weight_map entry, ``"":"x.safetensors",``,
#: is two values (its name and its file) in 19 bytes.
INDEX_VALUE = 9

# JSON strings (escapes included), an array holding anything but numbers, an object
# holding none, and one with more than three members (its first four colons).
_STRING = re.compile(rb'"[^"]*"')
_WINDOW = 1 << 20
_NOT_NUMBERS = re.compile(rb'\[[^\[\]{}"]*[\[{"]')
_FLAT_OBJECT = re.compile(rb"\{[^{}]*\}")
_FOUR_MEMBERS = re.compile(rb"\{[^{}:]*:[^{}:]*:[^{}:]*:[^{}:]*:")


def header_problem(text: bytes) -> str | None:
    """What makes ``text`` no header: not an object of objects (each tensor's entry, and
    ``__metadata__``) whose arrays hold numbers, more of them than its length can hold
    as entries of :data:`MIN_ENTRY` bytes, or more than one object of over three
    members (``__metadata__``; at most :data:`MAX_METADATA`): what makes ``json`` build
    far more Python objects than a real header of that length."""
    shape = skeleton(text)
    if not (shape.startswith(b"{") and shape.endswith(b"}")):
        return "its header is not a JSON object (not valid JSON, or another value)"
    body = shape[1:-1]
    del shape
    if _NOT_NUMBERS.search(body):
        return "an array in its header holds something other than numbers"
    flat = _FLAT_OBJECT.sub(b"o", body)
    if flat.replace(b'"":o,', b"") not in (b"", b'"":o'):
        return (
            "its header is not one object per tensor (and one for __metadata__) under the "
            "tensors' names: it holds other values or deeper objects"
        )
    objects = flat.count(b"o")
    del flat
    if (objects - 1) * MIN_ENTRY > len(text):
        return (
            f"its header of {len(text)} bytes holds {objects} objects, more than it can hold "
            f"as tensors' entries (each at least {MIN_ENTRY} bytes)"
        )
    many = _FOUR_MEMBERS.search(body)
    if many is None:
        return None
    if _FOUR_MEMBERS.search(body, many.end()):
        return "more than one object in its header has over three members"
    if body.count(b":", many.start(), body.index(b"}", many.start())) > MAX_METADATA:
        return f"its __metadata__ has over {MAX_METADATA} members"
    return None


def map_problem(text: bytes, what: str, most: int) -> str | None:
    """What makes ``text`` no flat map of at most ``most`` names to strings: more
    members, or an object or array inside."""
    shape = skeleton(text)
    if shape.count(b"{") > 1 or b"[" in shape or shape.count(b":") > most:
        return f"its {what} is not a flat map of at most {most} names (one per tensor) to strings"
    return None


def index_problem(text: bytes) -> str | None:
    """What makes ``text`` no index: more JSON values (past :data:`MAX_METADATA`) than
    one per :data:`INDEX_VALUE` bytes, what makes ``json`` build far more Python objects
    than a real index of that length."""
    shape = skeleton(text)
    values = sum(shape.count(c) for c in (b":", b",", b"{", b"["))
    if (values - MAX_METADATA) * INDEX_VALUE > len(text):
        return (
            f"{values} JSON values in {len(text)} bytes, more than a weight_map of tensor "
            "names to files has, each entry at least 19 bytes"
        )
    return None


def skeleton(text: bytes) -> bytes:
    """``text`` with every JSON string emptied (``""``) and no whitespace: its structure.
    Escapes go first (``\\\\``, then ``\\"``), so every quote left delimits a string;
    strings are emptied :data:`_WINDOW` bytes at a time (each window ends outside a
    string), as ``re.sub`` keeps two objects per match until it joins them."""
    plain = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    out = bytearray()
    start = 0
    while start < len(plain):
        end = min(len(plain), start + _WINDOW)
        if plain.count(b'"', start, end) % 2:  # inside a string: end after it
            close = plain.find(b'"', end)
            end = len(plain) if close < 0 else close + 1
        out += _STRING.sub(b'""', plain[start:end]).translate(None, b" \t\n\r")
        start = end
    return bytes(out)
