"""Export a committed DCP checkpoint (ours or stock) as a Hugging Face Hub-layout model
in a bucket or directory, streamed: each file's header (with every tensor's CRC-32C)
first, then the tensors' bytes as they are read, a few chunks ahead on a thread pool,
so memory holds a few read buffers and the upload's part buffers, not a file. A few
files are written at once, so one file's last parts upload while the next streams."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from extensions.base import Keys
from extensions.errors import IntegrityError, quote
from extensions.streams import readinto_exact
from storage.backends.base import FileSystemBase
from storage.backends.cancel import Cancel, current, installed
from storage.checkpoint.api import load
from storage.checkpoint.items import encryption_required
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.safetensors.files import (
    commit_model,
    new_names,
    publish_file,
    refuse_existing,
    split,
)
from storage.checkpoint.safetensors.header import (
    check_name,
    dtype_name,
    encode_header,
    layout,
    new_write_id,
)
from storage.checkpoint.safetensors.staging import STALE_AFTER, sweep
from storage.checkpoint.tensors import empty_stored, tensor_bytes
from storage.ops.export_source import Run, Tensor, checksum, damaged, missing, plan_tensor

#: The Hub's customary largest file.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
#: Bytes per ranged read of the source, and how many are read ahead of the upload
#: per file being written.
CHUNK = 8 << 20
AHEAD = 4
#: Output files written at once: one file's last parts upload while the next streams.
FILES = 2

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    source: str
    destination: str
    files: list[str]  #: the model's files, the commit (index or single file) last
    tensors: int
    size: int  #: bytes of tensor data written
    skipped: list[str] = field(default_factory=list)  #: items that are not tensors


def export_safetensors(
    src_fs: FileSystemBase,
    src: str,
    dst_fs: FileSystemBase,
    dst: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
    only: Sequence[str] = (),
    strip: str = "",
    overwrite: bool = False,
    keys: Keys | None = None,
    require_encryption: bool | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> ExportResult:
    """Write the tensors of the checkpoint at ``src`` as a safetensors model at ``dst``.

    ``only``: keep the items whose names start with one of these prefixes (all when
    empty); ``strip``: remove this prefix, as given, from the names that have it
    (``model.``; an item it would leave nameless is refused before anything is written);
    ``dtype``: convert floating-point tensors (integer and bool ones keep theirs);
    ``max_shard_size``: bytes per file (``None``: one file). Items that are not
    tensors are skipped and listed. ``keys`` decrypt encrypted items.

    Each file is written header first, then its tensors' bytes as they are read: a
    tensor's CRC-32C is known before its bytes are read where its items' records
    imply it (see ``storage.ops.export_source``), and is checked against the bytes
    as they stream (a damaged item fails the export naming it, and the file being
    written is never published); other tensors are loaded once for their CRC-32C and
    again to be written, a batch or one tensor at a time. The index is written last,
    then the model committed (see ``storage.checkpoint.safetensors.files``), and a model already
    at ``dst`` is refused unless ``overwrite``; a model replaced stays whole until
    then (new files take other names), and its files are removed after. Up to
    :data:`FILES` files are written at once; when one fails, the others are
    interrupted and none of them is published. Each file is published only once the
    source's metadata, read again, still names the data files the export was planned
    from: a save over the source meanwhile could make the model mix both saves.
    ``progress(done, total)`` is called with the bytes of tensor data written so far
    and in all after each tensor (from the threads writing the files, one call at a
    time)."""
    reader_options: dict[str, Any] = {"keys": keys, "require_encryption": require_encryption}
    metadata = CheckpointReader(src, filesystem=src_fs, **reader_options).read_metadata()
    checkpoint = src_fs.url(src)
    chosen: dict[str, tuple[str, torch.dtype]] = {}  # name -> (fqn, dtype)
    skipped: list[str] = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if only and not any(fqn.startswith(prefix) for prefix in only):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        name = fqn[len(strip) :] if strip and fqn.startswith(strip) else fqn
        if not name:
            under = f"{quote(strip + '.')}: the names under it"
            narrower = "less" if strip.endswith(".") else under
            raise ValueError(
                f"{checkpoint}: item {quote(fqn)} would be named '' once {quote(strip)} is "
                f"stripped (no model loader can look it up); strip {narrower}, or leave the "
                "item out with --only"
            )
        if name in chosen:
            raise ValueError(
                f"{checkpoint}: items {quote(chosen[name][0])} and {quote(fqn)} are both "
                f"named {quote(name)} once {quote(strip)} is stripped; narrow them with --only "
                "or strip less"
            )
        stored = meta.properties.dtype
        out = dtype if dtype is not None and stored.is_floating_point else stored
        check_name(name, f"{checkpoint}: item {quote(fqn)}")
        dtype_name(out, f"{checkpoint}: item {quote(fqn)}")
        chosen[name] = (fqn, out)
    if not chosen:
        raise ValueError(
            f"{checkpoint}: no tensors to export"
            + (f" under {', '.join(quote(p) for p in only)}" if only else "")
            + "; check the item names with `dcp-storage inspect`"
        )
    # With keys every item must be encrypted: plain items go through the loader,
    # which refuses them as itself.
    direct = not encryption_required(require_encryption, keys)
    tensors = [
        plan_tensor(src_fs, src, metadata, name, fqn, out, direct=direct)
        for name, (fqn, out) in chosen.items()
    ]
    by_name = {t.name: t for t in tensors}
    everything = sum(t.nbytes for t in tensors)
    groups = split([(t.name, t.nbytes) for t in tensors], max_shard_size)
    refuse_existing(dst_fs, dst, overwrite=overwrite)

    def unchanged() -> None:  # before each file is published: after every read of it
        now = CheckpointReader(src, filesystem=src_fs, **reader_options).read_metadata()
        if now.storage_data != metadata.storage_data:
            raise IntegrityError(
                f"{checkpoint} was saved again while it was exported (its metadata names "
                "other data files now), so the model could mix tensors of both saves; no "
                "model was committed: export it again once nothing writes to it"
            )

    def load_batch(batch: list[Tensor]) -> dict[str, torch.Tensor]:
        state = {t.fqn: empty_stored(metadata, t.fqn, checkpoint) for t in batch}
        load(state, checkpoint, filesystem=src_fs, **reader_options)
        return {t.name: state.pop(t.fqn).to(t.dtype).contiguous() for t in batch}

    with ThreadPoolExecutor(AHEAD * FILES) as pool:
        checksum(src_fs, src, metadata, tensors, load_batch, pool)
        try:  # what a killed export or save left here, as a SafetensorsWriter save does
            sweep(dst_fs, dst, STALE_AFTER)
        except Exception as exc:  # the export does not depend on it; gc sweeps too
            log.warning("%s: leftovers of interrupted saves not swept: %s", dst_fs.url(dst), exc)
        write_id = new_write_id()  # in every file and the index: a mix with another is refused
        # Names the model being replaced does not use: it stays whole until the commit.
        names, replaced = new_names(dst_fs, dst, len(groups), write_id)
        files = [
            (dst_fs.concat_path(dst, n), [by_name[t] for t in g]) for g, n in zip(groups, names)
        ]
        stream = _Stream(src_fs, checkpoint, pool, load_batch, Cancel(current()), write_id)
        stream.home, stream.unchanged = replaced.home, unchanged
        total = stream.write_all(dst_fs, files, everything, progress)
    weight_map = {t.name: name for (_, group), name in zip(files, names) for t in group}
    written = commit_model(dst_fs, dst, weight_map, total, write_id, replaced)
    return ExportResult(checkpoint, dst_fs.url(dst), written, len(chosen), total, skipped)


@dataclass
class _Stream:
    """Writes the files: each its header, then each tensor's bytes, direct ones read
    :data:`CHUNK` bytes at a time, :data:`AHEAD` reads per file in flight on ``pool``.
    Every upload and read runs under ``stop``, which the first failure cancels."""

    fs: FileSystemBase
    checkpoint: str
    pool: ThreadPoolExecutor
    load_batch: Callable[[list[Tensor]], dict[str, torch.Tensor]]
    stop: Cancel
    write_id: str
    #: The destination as resolved when the export began (``files.Replaced.home``): the
    #: files are written inside it, never through a link swapped in since.
    home: str | None = None
    #: Raises where the source changed since it was planned: called before each file
    #: is published, once its bytes are all read.
    unchanged: Callable[[], None] = lambda: None

    def write_all(
        self,
        fs: FileSystemBase,
        files: Sequence[tuple[str, Sequence[Tensor]]],
        everything: int,
        progress: Callable[[int, int], Any] | None,
    ) -> int:
        """Write ``files`` (path, tensors), :data:`FILES` at a time; returns the bytes
        of tensor data. The first failure interrupts the others and is raised."""
        lock = threading.Lock()
        written = [0] * len(files)

        def wrote(index: int, done: int) -> None:
            with lock:
                written[index] = done
                if progress is not None:
                    progress(sum(written), everything)

        def one(index: int, path: str, tensors: Sequence[Tensor]) -> int:
            with installed(self.stop):
                return self.write(fs, path, tensors, functools.partial(wrote, index))

        writers = ThreadPoolExecutor(FILES, thread_name_prefix="dcp-storage-export")
        futures = [writers.submit(one, i, *file) for i, file in enumerate(files)]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception()), None)
            if failed is not None:
                raise failed
        except BaseException:
            self.stop.cancel()  # the files still being written stop, unpublished
            raise
        finally:
            writers.shutdown(cancel_futures=True)
        return sum(f.result() for f in futures)

    def write(
        self,
        fs: FileSystemBase,
        path: str,
        tensors: Sequence[Tensor],
        progress: Callable[[int], object],
    ) -> int:
        """Write ``tensors`` as the file ``path``; returns the bytes of tensor data."""
        by_name = {t.name: t for t in tensors}
        shapes = {t.name: (t.dtype, t.shape) for t in tensors}
        order = [by_name[n] for n in layout(shapes)]
        crcs = {t.name: t.crc32c for t in order}
        header = encode_header(shapes, [t.name for t in order], crcs, self.write_id)
        done = 0
        runs = [run for t in order for run in t.runs or ()]
        with (
            publish_file(fs, path, home=self.home) as out,
            contextlib.closing(self._chunks(runs)) as chunks,
        ):
            out.write(header)
            for tensor in order:
                self.stop.check()
                if tensor.runs is None:
                    self._write_loaded(out, tensor)
                for run in tensor.runs or ():
                    crc = 0
                    for _ in range(-(-run.length // CHUNK)):
                        view = next(chunks)
                        crc = crc32c.crc32c(view, crc)
                        out.write(view)
                    if crc != run.crc32c:
                        raise damaged(
                            self.checkpoint,
                            run,
                            f"checksum mismatch (crc32c {crc:08x} of its tensor bytes, its "
                            f"record implies {run.crc32c:08x})",
                        )
                done += tensor.nbytes
                progress(done)
            self.unchanged()  # a file published is the model where it is the only one
        return done

    def _write_loaded(self, out: Any, tensor: Tensor) -> None:
        data = self.load_batch([tensor])[tensor.name]
        view = tensor_bytes(data)
        crc = crc32c.crc32c(view)
        if crc != tensor.crc32c:
            raise IntegrityError(
                f"{self.checkpoint}: item {quote(tensor.fqn)} loaded with other bytes than a "
                f"moment before (crc32c {crc:08x}, then {tensor.crc32c:08x}); the checkpoint "
                "changed during the export: export it again once nothing writes to it"
            )
        out.write(view)

    def _chunks(self, runs: Sequence[Run]) -> Generator[memoryview, None, None]:
        """The bytes of ``runs`` in order, a chunk at a time, read ahead; each view is
        valid until the next is asked for."""
        tasks = (
            (run, at, min(CHUNK, run.start + run.length - at))
            for run in runs
            for at in range(run.start, run.start + run.length, CHUNK)
        )
        free: list[bytearray] = []
        pending: deque[tuple[bytearray, Future[memoryview]]] = deque()
        try:
            for run, at, length in tasks:
                buffer = free.pop() if free else bytearray(CHUNK)
                future = self.pool.submit(self._read, run, at, length, buffer)
                pending.append((buffer, future))
                if len(pending) == AHEAD:
                    buffer, future = pending.popleft()
                    yield future.result()
                    free.append(buffer)
            while pending:
                buffer, future = pending.popleft()
                yield future.result()
                free.append(buffer)
        finally:
            for _, future in pending:
                future.cancel()
            for _, future in pending:  # no read may outlive its buffer's owner
                with contextlib.suppress(BaseException):
                    future.result()

    def _read(self, run: Run, at: int, length: int, buffer: bytearray) -> memoryview:
        view = memoryview(buffer)[:length]
        try:
            with installed(self.stop), self.fs.open_slice(run.path, at, length) as stream:
                got = readinto_exact(stream, view)
        except FileNotFoundError as exc:  # removed since its archive's ends were read
            raise missing(self.checkpoint, run, exc) from exc
        if got < length:
            raise damaged(self.checkpoint, run, "the data file ends inside the item (truncated)")
        return view
