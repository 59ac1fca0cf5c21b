"""Two committers publishing into one root at once (two managers, a manager and a
``dcp.save`` of a numbered step, two jobs): the latest-step pointer ``.dcp-latest``
never ends up naming a lower step than a committed one it named or was given, and the
deletion of the step it names never removes the pointer to a newer step published
meanwhile. On local disk, on real S3 servers (moto, SeaweedFS) and, for publishes, on
fake-gcs-server.

Each race is played out with gates, no timing: one publisher is held right after it
read the pointer (through a backend of ours that waits on an event there) while the
other publishes in full; then it goes on. Every test names, in a comment, what happened
before the fix.
"""

from __future__ import annotations

import threading
import urllib.error
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from storage import CheckpointManager, LocalFileSystem
from storage.backends.base import FileSystemBase
from storage.checkpoint import latest, siblings

BUCKET = "dcp-pointer-race"
WAIT = 60.0  # generous: the CI machine is loaded; nothing waits this long when it works


class Gate:
    """Holds ``thread`` after (``before``: before) its ``at``-th read of a latest-step
    pointer until ``go`` (a read inside another counts once: local disk's
    ``read_versioned`` reads through ``read_bytes``)."""

    def __init__(self, at: int = 1, *, before: bool = False) -> None:
        self.thread: threading.Thread | None = None
        self.at, self.before, self.reads = at, before, 0
        self.held = threading.Event()
        self.go = threading.Event()

    def hold(self, path: str, depth: int, before: bool) -> None:
        mine = threading.current_thread() is self.thread
        if not path.endswith(latest.NAME) or not mine or depth or before != self.before:
            return
        self.reads += 1
        if self.reads == self.at:
            self.held.set()
            assert self.go.wait(WAIT), "the gate was never opened"


def gated(base: type[FileSystemBase], *gates: Gate) -> type[FileSystemBase]:
    """``base`` whose reads of a pointer (``read_bytes``, and ``read_versioned`` where
    the backend swaps) pass through ``gates``."""
    depth = threading.local()

    class Gated(base):  # type: ignore[valid-type,misc]
        def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
            return self._gated(path, super().read_bytes, path, limit=limit)  # type: ignore[no-any-return]

        def read_versioned(self, path: str, *, limit: int) -> tuple[bytes, str]:
            return self._gated(path, super().read_versioned, path, limit=limit)  # type: ignore[no-any-return]

        def _gated(self, path: str, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, "level", 0)
            for gate in gates:
                gate.hold(path, level, True)
            depth.level = level + 1
            try:
                result = read(*args, **kwargs)
            finally:
                depth.level = level
            for gate in gates:
                gate.hold(path, level, False)
            return result

    return Gated


@dataclass
class Place:
    """A root on one store: ``make(gate)`` builds a backend (gated where a gate is
    given); ``pointer()`` reads the pointer's bytes (``None``: none)."""

    root: str
    make: Callable[[Gate | None], FileSystemBase]
    pointer: Callable[[], bytes | None]
    set_pointer: Callable[[bytes], None]


def _local_place(tmp_path: Path) -> Place:
    root = tmp_path / "root"
    root.mkdir()
    path = root / latest.NAME

    def make(gate: Gate | None) -> FileSystemBase:
        return LocalFileSystem() if gate is None else gated(LocalFileSystem, gate)()

    return Place(
        str(root),
        make,
        lambda: path.read_bytes() if path.exists() else None,
        path.write_bytes,
    )


def _s3_place(kind: str) -> Place:
    from storage import S3FileSystem
    from tests.support.servers import ServerUnavailable, boto3_client, create_bucket, s3_options
    from tests.support.servers import s3_endpoint as endpoint_of

    try:
        endpoint = endpoint_of(kind)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, BUCKET)
    client = boto3_client(endpoint)
    prefix = uuid.uuid4().hex
    key = f"{prefix}/{latest.NAME}"

    def make(gate: Gate | None) -> FileSystemBase:
        cls = S3FileSystem if gate is None else gated(S3FileSystem, gate)
        return cls(storage_options=s3_options(endpoint))

    def pointer() -> bytes | None:
        try:
            return bytes(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        except client.exceptions.NoSuchKey:
            return None

    def set_pointer(data: bytes) -> None:
        client.put_object(Bucket=BUCKET, Key=key, Body=data)

    return Place(f"s3://{BUCKET}/{prefix}", make, pointer, set_pointer)


def _gcs_place() -> Place:
    from storage import GCSFileSystem
    from tests.support.servers import gcs_endpoint_with_bucket, gcs_get, gcs_options, gcs_put

    endpoint = gcs_endpoint_with_bucket(BUCKET)
    prefix = uuid.uuid4().hex
    key = f"{prefix}/{latest.NAME}"

    def make(gate: Gate | None) -> FileSystemBase:
        cls = GCSFileSystem if gate is None else gated(GCSFileSystem, gate)
        return cls(storage_options=gcs_options(endpoint))

    def pointer() -> bytes | None:
        try:
            return gcs_get(endpoint, BUCKET, key)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    return Place(
        f"gs://{BUCKET}/{prefix}", make, pointer, lambda data: gcs_put(endpoint, BUCKET, key, data)
    )


def _place(kind: str, tmp_path: Path) -> Place:
    if kind == "local":
        return _local_place(tmp_path)
    if kind == "gcs":
        return _gcs_place()
    return _s3_place(kind)


@pytest.fixture(params=["local", "moto", "seaweedfs", "gcs"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """A root on a backend that replaces the pointer only while it is what was read."""
    return _place(request.param, tmp_path)


@pytest.fixture(params=["local", "moto", "seaweedfs"])
def removing_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """A root on a backend that removes the pointer only while it is what was read too
    (not GCS: fake-gcs-server ignores preconditions on deletes, so its removal is not
    conditional; see ``storage.backends.swap``)."""
    return _place(request.param, tmp_path)


def _commit(place: Place, *steps: int) -> None:
    """Commit ``step-<N>`` for each of ``steps`` under the root (each publishes)."""
    fs = place.make(None)
    for step in steps:
        storage.save({"w": torch.full((4,), float(step)), "step": step},
                     f"{place.root}/step-{step}", filesystem=fs)  # fmt: skip


def _step(fs: FileSystemBase, place: Place, step: int) -> str:
    """The directory of ``step-<step>`` in ``fs``'s own form, as a commit names it."""
    return fs.own_path(f"{place.root}/step-{step}")


def _race(held: Callable[[FileSystemBase], None], other: Callable[[], None], gate: Gate,
          fs: FileSystemBase) -> None:  # fmt: skip
    """Run ``held(fs)`` in a thread held by ``gate`` after its first pointer read, run
    ``other()`` in full meanwhile, then let the held one finish."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            held(fs)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    gate.thread = threading.Thread(target=run, name="held-publisher")
    gate.thread.start()
    try:
        assert gate.held.wait(WAIT), "the held publisher never read the pointer"
        other()
    finally:
        gate.go.set()
        gate.thread.join(WAIT)
    assert not gate.thread.is_alive() and not errors, errors


def _publish_5_and_6_at_once(place: Place) -> None:
    """The commit of step-5 paused right after it read the pointer (naming step-4)
    while the commit of step-6 publishes whole, then step-5's goes on."""
    _commit(place, 4, 5, 6)
    place.set_pointer(b"step-4\n")
    gate = Gate()
    other = place.make(None)
    _race(
        lambda fs: latest.publish(fs, _step(fs, place, 5)),
        lambda: latest.publish(other, _step(other, place, 6)),
        gate,
        place.make(gate),
    )


def test_a_lower_step_published_concurrently_never_replaces_a_higher_one(place: Place) -> None:
    # Before: the commits of step-5 and step-6 both read the pointer naming step-4;
    # step-6 wrote `step-6`, then step-5 wrote `step-5` over it, although step-6 was
    # committed: a restarted job whose listing missed step-6 resumed from step-5.
    _publish_5_and_6_at_once(place)
    assert place.pointer() == b"step-6\n"


def test_a_lower_step_published_concurrently_leaves_the_pointer_resumable(
    tmp_path: Path,
) -> None:
    # The same race seen by a restarted job whose root listing misses step-6: before,
    # latest() said 5 though step-6 was committed.
    place = _local_place(tmp_path)
    _publish_5_and_6_at_once(place)

    class Lagging(LocalFileSystem):
        def ls(self, path: str) -> list[str]:
            return [n for n in super().ls(path) if n != "step-6"]

    fresh = CheckpointManager(place.root, filesystem=Lagging())
    for step in (4, 5, 6):
        siblings.forget(fresh.fs, fresh.step_path(step))
    assert fresh.latest() == 6


def test_withdrawing_a_deleted_step_keeps_a_newer_step_published_meanwhile(
    removing_place: Place,
) -> None:
    # Before: the deletion of step-6 read the pointer naming step-6; the commit of
    # step-7 then wrote `step-7`; the deletion removed the pointer anyway, so a job
    # whose listing missed step-7 no longer found it.
    place = removing_place
    _commit(place, 6, 7)
    place.set_pointer(b"step-6\n")
    gate = Gate()
    other = place.make(None)
    _race(
        lambda fs: latest.withdraw(fs, _step(fs, place, 6)),
        lambda: latest.publish(other, _step(other, place, 7)),
        gate,
        place.make(gate),
    )
    assert place.pointer() == b"step-7\n"


@pytest.fixture
def unswapping() -> tuple[str, Callable[..., FileSystemBase]]:
    """A root on a backend that cannot compare and swap (the in-process memory store),
    and a maker of its backend (given gates)."""
    from storage import MemoryFileSystem

    name = uuid.uuid4().hex
    return f"dcpmem://{name}/root", lambda *g: gated(MemoryFileSystem, *g)(name)


def test_without_swaps_a_publish_reads_back_and_restores_a_higher_step(
    unswapping: tuple[str, Callable[..., FileSystemBase]],
) -> None:
    # Where the backend cannot swap, the pointer is read back after the write. Before:
    # step-5 (held after reading `step-4`) wrote `step-5` after step-6 had written
    # `step-6`, and nothing noticed: the pointer named step-5 though step-6 was committed.
    root, make = unswapping
    first, back = Gate(), Gate(at=2, before=True)  # step-5 after its read, step-6 after its write
    fs = make(first, back)
    place = Place(root, lambda gate: fs, lambda: None, lambda data: None)
    _commit(place, 4, 5, 6)
    fs.write_atomic(fs.own_path(f"{root}/{latest.NAME}"), b"step-4\n")
    lower = threading.Thread(target=latest.publish, args=(fs, _step(fs, place, 5)))
    higher = threading.Thread(target=latest.publish, args=(fs, _step(fs, place, 6)))
    first.thread, back.thread = lower, higher
    lower.start()
    try:
        assert first.held.wait(WAIT), "step-5 never read the pointer"
        higher.start()
        _held_or_done(back, higher)  # old code: no read-back, step-6 is done
        first.go.set()
        lower.join(WAIT)
    finally:
        first.go.set()
        back.go.set()
        lower.join(WAIT)
        if higher.is_alive() or higher.ident is not None:
            higher.join(WAIT)
    assert fs.read_bytes(fs.own_path(f"{root}/{latest.NAME}")) == b"step-6\n"


def _held_or_done(gate: Gate, thread: threading.Thread) -> None:
    """Wait until ``thread`` is held by ``gate`` or has finished."""
    for _ in range(int(WAIT * 100)):
        if gate.held.wait(0.01) or not thread.is_alive():
            return
    raise AssertionError(f"{thread.name} was neither held nor done")


def test_on_local_disk_a_publish_waits_for_one_that_decided_and_is_writing(
    tmp_path: Path,
) -> None:
    # The comparison and the write are one step under the root's flock: step-5, held
    # after it found the pointer still `step-4` and before it writes, keeps step-6 from
    # comparing until it has written; step-6 then finds `step-5` and replaces it. Before:
    # step-6 wrote `step-6` meanwhile and step-5 wrote `step-5` over it. (step-6 is given
    # a bounded while to finish unheld before step-5 goes on: with the lock it cannot,
    # and the outcome is the same however long that while is.)
    place = _local_place(tmp_path)
    _commit(place, 4, 5, 6)
    place.set_pointer(b"step-4\n")
    go, writing = threading.Event(), threading.Event()

    class HeldWriter(LocalFileSystem):
        def write_atomic_in(self, directory: str, name: str, data: bytes, **kw: Any) -> None:
            if name == latest.NAME and threading.current_thread() is lower:
                writing.set()
                assert go.wait(WAIT), "the held writer was never let go"
            super().write_atomic_in(directory, name, data, **kw)

    fs = HeldWriter()
    lower = threading.Thread(target=latest.publish, args=(fs, _step(fs, place, 5)))
    higher = threading.Thread(target=latest.publish, args=(fs, _step(fs, place, 6)))
    lower.start()
    try:
        assert writing.wait(WAIT), "step-5 never wrote"
        higher.start()
        higher.join(2.0)  # blocked on the lock (fixed) or done (before)
    finally:
        go.set()
        lower.join(WAIT)
        if higher.ident is not None:
            higher.join(WAIT)
    assert not lower.is_alive() and not higher.is_alive()
    assert place.pointer() == b"step-6\n"
