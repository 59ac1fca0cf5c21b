"""Plumbing of the ``dcp-storage`` command: locations, keys, transform specs, progress
bars and plain-text tables."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from extensions.errors import CheckpointNotFoundError, printable
from storage.backends.base import FileSystemBase, PendingUpload
from storage.backends.registry import filesystem_from_url, url_scheme

TRANSFORM_SPECS = "weights, weights:compact, zstd, zstd:LEVEL, shuffle, aes:KEY_ID, none"


def option_value(text: str) -> Any:
    try:
        return json.loads(text)  # numbers, true/false, JSON objects for nested options
    except ValueError:
        return text


def storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for number, pair in enumerate(pairs or (), start=1):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # Not echoed: a malformed pair may be a bare secret.
            raise ValueError(
                f"--storage-option takes KEY=VALUE; the {number}. one has no "
                f"{'=' if not sep else 'KEY'}"
            )
        options[key] = option_value(value)
    return options


def location(url: str, pairs: Sequence[str] | None) -> tuple[FileSystemBase, str]:
    # Local paths take no client options, so one --storage-option serves `cp local s3://`.
    options = storage_options(pairs)
    remote = url_scheme(url) not in ("", "file")
    return filesystem_from_url(url, options if options and remote else None)


def keys_from_args(args: argparse.Namespace) -> dict[str, bytes]:
    from extensions import keys_from_environment, keys_from_file

    keys = keys_from_environment()
    if args.key_file:
        keys.update(keys_from_file(args.key_file))
    return keys


def parse_transforms(specs: Sequence[str], keys: dict[str, bytes]) -> list[Any]:
    from extensions import AES256GCM, ByteShuffle, WeightCodec, ZStandard
    from extensions.errors import quote
    from extensions.keys import KEY_SIZE, shown_key_id

    chain: list[Any] = []
    for spec in specs:
        name, _, value = spec.partition(":")
        name = name.strip().lower()
        if name == "none" and len(specs) == 1:
            return []
        if name == "zstd":
            chain.append(ZStandard(level=int(value)) if value else ZStandard())
        elif name == "shuffle" and not value:
            chain.append(ByteShuffle())
        elif name == "weights" and value in ("", "compact"):
            chain.append(WeightCodec(compact=value == "compact"))
        elif name in ("aes", "aes256gcm") and value:
            if value not in keys:
                # The value is not echoed whole: a key typed in place of its id is one.
                raise ValueError(
                    f"--transform {name}:KEY_ID: no key for key id {shown_key_id(value)}; "
                    "provide it with --key-file or the DCP_STORAGE_KEYS environment variable"
                )
            chain.append(AES256GCM(key=keys[value], key_id=value))
        else:
            shown = quote(spec) if len(spec) < KEY_SIZE else f"of {len(spec)} characters"
            raise ValueError(f"unknown --transform {shown}; use one of: {TRANSFORM_SPECS}")
    return chain


@contextlib.contextmanager
def progress_bar(args: argparse.Namespace, total: int, desc: str) -> Iterator[Any]:
    from tqdm import tqdm

    enabled = not args.quiet and sys.stderr.isatty()
    bar = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not enabled,
        leave=False,
    )
    lock = threading.Lock()

    def update(n: int) -> None:
        with lock:
            bar.update(n)

    try:
        yield update
    finally:
        bar.close()


@contextlib.contextmanager
def progress_line(args: argparse.Namespace, desc: str) -> Iterator[Any]:
    """A ``progress(done, total)`` that redraws one carriage-return line on stderr
    (bytes done; of the total, and the percentage, when ``total > 0``) when stderr is
    a terminal and neither ``--json`` nor ``--quiet`` is given; a no-op otherwise. The
    line is cleared at the end."""
    enabled = not args.quiet and not args.json and sys.stderr.isatty()
    lock = threading.Lock()
    shown = [False]

    def update(done: int, total: int) -> None:
        if not enabled:
            return
        shown_total = f" / {human_size(total)} ({100 * done // total}%)" if total > 0 else ""
        with lock:
            sys.stderr.write(f"\r{desc}: {human_size(done)}{shown_total}")
            sys.stderr.flush()
            shown[0] = True

    try:
        yield update
    finally:
        if shown[0]:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_size(text: str, option: str) -> int:
    """``5GB`` (10**9, as the Hub counts), ``2GiB``, ``500MB`` or a byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"{option} takes a size such as 5GB, 500MB, 2GiB or bytes, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def human_age(modified: float | None) -> str:
    if modified is None:
        return "-"
    seconds = max(0.0, time.time() - modified)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


#: The most characters a table cell shows (``--json`` shows all): every row is padded
#: to its column's widest cell, so one name of 100,000 characters among 300 items would
#: print 30 MB.
CELL_LIMIT = 500


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    # Cells quote the checkpoint (item names, shapes, descriptors): escaped and cut to
    # CELL_LIMIT before widths are taken, so the table is linear in its rows.
    rows = [[printable(str(c), CELL_LIMIT) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            f"{c:>{w}}" if i in right else f"{c:<{w}}"
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(r) for r in rows)]


def bad_lines(bad: dict[str, str]) -> list[str]:
    """A verify report's failures, one line each: a name's line break (the checkpoint
    chooses its names) is escaped, never a line of its own, and a name longer than
    :data:`CELL_LIMIT` is cut (the ``--json`` report holds it whole)."""
    return [
        f"  {printable(name, CELL_LIMIT)}: {printable(why)}" for name, why in sorted(bad.items())
    ]


def emit(args: argparse.Namespace, data: Any, lines: Sequence[str]) -> None:
    """Print ``data`` as JSON with ``--json`` (``json.dumps`` escapes control and
    non-ASCII characters), else ``lines``, one line each. A line may quote names the
    store chooses (object keys, file and item names, upload keys): each is escaped
    whole, so a line break inside a name is printed as ``\\n``, never as a line of its
    own that could pass for one of ours, and no escape sequence reaches the terminal."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print("\n".join(printable(line) for line in lines))


def not_a_checkpoint_hint(fs: FileSystemBase, path: str, exc: Exception) -> Exception:
    """``exc`` with what ``path`` holds instead of a checkpoint, where that says what to
    run: step directories, a safetensors model (only ``verify`` reads those), or the
    files of one whose write did not finish."""
    from storage.checkpoint.safetensors.header import INDEX_NAME
    from storage.checkpoint.safetensors.verify import is_model
    from storage.ops.manager import CheckpointManager

    if is_model(fs, path):
        return CheckpointNotFoundError(
            f"{exc}; it holds a safetensors model, which `dcp-storage verify {fs.url(path)}` "
            "checks and storage.load_safetensors loads (this command reads DCP checkpoints)"
        )
    try:
        held = fs.ls(path)
    except FileNotFoundError:
        held = []
    if any(n.endswith(".safetensors") for n in held):
        return CheckpointNotFoundError(
            f"{exc}; it holds safetensors files but no {INDEX_NAME}: an export or save that "
            "did not finish, which no reader takes for a model: export or save it again"
        )
    steps = CheckpointManager(fs.url(path), filesystem=fs, persist="thread").entries()
    if steps:
        names = ", ".join(s.name for s in steps[-3:])
        return CheckpointNotFoundError(
            f"{exc}; it holds step directories ({names}): run `dcp-storage ls {fs.url(path)}`"
        )
    return exc


def upload_lines(
    fs: FileSystemBase, uploads: list[PendingUpload], aborted: bool, asked: bool
) -> list[str]:
    """One line per stale upload ``gc`` found: aborted, would be (a dry run), or left."""
    if aborted:
        fate = "aborted"
    elif asked:
        fate = "would abort"
    else:
        fate = "left open (--abort-uploads aborts it)"
    return [
        f"incomplete multipart upload of {fs.url(u.path)}, "
        f"begun {time.time() - (u.started or 0.0):.0f} s ago: {fate}"
        for u in uploads
    ]
