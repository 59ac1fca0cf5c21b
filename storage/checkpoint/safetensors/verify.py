"""``verify`` of a Hub-layout model (ours or anyone's): its index and every file's
header checked as the reader checks them (hostile headers refused), then each tensor's
bytes against the CRC-32C our writer records, one file's data region streamed at a
time through a bounded buffer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import crc32c

from extensions.streams import readinto_exact
from storage.backends.base import FileSystemBase
from storage.checkpoint.safetensors.header import INDEX_NAME, SINGLE_NAME, TensorEntry
from storage.checkpoint.safetensors.reading import read_model
from storage.checkpoint.safetensors.staging import is_area_name

_CHUNK = 8 << 20


@dataclass
class ModelReport:
    url: str
    files: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)  #: ``file: tensor`` whose CRC-32C matched
    bad: dict[str, str] = field(default_factory=dict)  #: ``file: tensor`` -> why
    unchecksummed: list[str] = field(default_factory=list)  #: no CRC-32C recorded
    staging: list[str] = field(default_factory=list)  #: staging areas beside the model
    bytes_read: int = 0


def is_model(fs: FileSystemBase, path: str) -> bool:
    """Whether ``path`` holds a committed Hub-layout model (an index or a single file)."""
    return any(fs.exists(fs.concat_path(path, name)) for name in (INDEX_NAME, SINGLE_NAME))


def verify_model(
    fs: FileSystemBase,
    path: str,
    *,
    threads: int = 4,
    progress: Callable[[int], object] | None = None,
) -> ModelReport:
    """Check the model at ``path``. A damaged structure (index, header, a file the index
    names that is missing or does not hold its tensor) raises the reader's error naming
    the file and tensor; a tensor whose bytes do not match their recorded CRC-32C is
    reported bad. Tensors without a recorded CRC-32C are listed, their bytes unread; so
    are the staging areas of consolidating saves found beside the model (in flight, or
    left by a killed save: ``gc`` removes those once stale)."""
    entries = read_model(fs, path, threads=threads)
    report = ModelReport(fs.url(path), files=sorted({e.file for e in entries.values()}))
    report.staging = [fs.url(fs.concat_path(path, n)) for n in fs.ls(path) if is_area_name(n)]
    by_file: dict[str, list[TensorEntry]] = {name: [] for name in report.files}
    for entry in entries.values():
        by_file[entry.file].append(entry)
    lock = threading.Lock()

    def check(file: str) -> None:
        tensors = sorted(by_file[file], key=lambda e: e.begin)
        unchecked = [f"{file}: {e.name}" for e in tensors if e.crc32c is None]
        with lock:
            report.unchecksummed += unchecked
        if len(unchecked) == len(tensors):
            return
        for label, problem, size in _stream(fs, path, file, tensors):
            with lock:
                report.bytes_read += size
                if problem is None:
                    report.ok.append(label)
                else:
                    report.bad[label] = problem
            if progress is not None:
                progress(size)

    with ThreadPoolExecutor(max(1, min(threads, len(report.files)))) as pool:
        list(pool.map(check, report.files))
    report.ok.sort()
    report.unchecksummed.sort()
    return report


def _stream(
    fs: FileSystemBase, root: str, file: str, tensors: list[TensorEntry]
) -> list[tuple[str, str | None, int]]:
    """``(label, problem or None, bytes)`` for each tensor of ``file`` with a CRC-32C:
    one ranged read of the data region, a bounded buffer at a time."""
    path = fs.concat_path(root, file)
    start, end = tensors[0].begin, tensors[-1].end
    buffer = memoryview(bytearray(min(_CHUNK, max(1, end - start))))
    out: list[tuple[str, str | None, int]] = []
    with fs.open_slice(path, start, end - start) as stream:
        for entry in tensors:
            crc, left = 0, entry.length
            while left:
                want = min(len(buffer), left)
                got = readinto_exact(stream, buffer[:want])
                if got < want:
                    out.append((f"{file}: {entry.name}", "the file ended early (truncated)", 0))
                    return out
                crc = crc32c.crc32c(buffer[:want], crc)
                left -= want
            if entry.crc32c is None:
                continue
            problem = None
            if crc != entry.crc32c:
                problem = (
                    f"checksum mismatch (crc32c {crc:08x}, expected {entry.crc32c:08x}): the "
                    "stored bytes are damaged: export or download the model again"
                )
            out.append((f"{file}: {entry.name}", problem, entry.length))
    return out
