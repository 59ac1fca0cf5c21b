"""Staging buffers in named shared memory, reused from one save to the next.

The training process copies its state into these buffers (the only work an
asynchronous save does on the training thread) and the persist worker maps the same
pages by name, so the bytes cross processes without another copy.

Segments are files in ``/dev/shm`` (the temporary directory where there is none), mode
0600, created with ``O_EXCL``. Their space is reserved (``posix_fallocate``) before a
byte is copied into it, so a full ``/dev/shm`` is an error naming the fix, never a
``SIGBUS`` while copying.

A stage's copies from CPU, reservations of new segments included, run on the pool's
``copy_threads`` where torch runs on one thread (:mod:`._copies`).

Names and ownership. A pool (one per training process) is named
``dcp-storage-{uid}-{pid}-{token}``, ``token`` 96 random bits, so no other user can
take its names in advance (a name that is taken anyway is skipped), and its segments
``{pool}-{token}`` with 64 random bits each (anyone may list the directory, so a pool's
name is no secret). The pool holds an ``flock`` on its lock file ``{pool}.lock`` for its
whole life. The lock, not the pid, says whether the owner lives: a pid means nothing to
a process in another PID namespace that shares ``/dev/shm`` (containers with
``--ipc=host``), and the kernel drops the lock when the last holder dies, whatever
killed it. A child made with ``fork`` shares the lock (its parent's segments stay while
it lives) and never removes them: only the process that made a pool removes its
segments, when the pool is closed or the process exits.

Files removed from under a live pool (systemd-logind's ``RemoveIPC`` at logout, a
cleaner of old files) are made again at the next stage: a segment (the worker maps it
by name) and the lock file (without it, another pool's sweep would take the pool for a
dead one).

:func:`sweep` removes the segments of pools whose lock nobody holds: the persist worker
runs it when it sees its training process die (so a ``kill -9`` leaves nothing behind
for long), and every new pool runs it first. It judges only files the calling user owns
and can lock, and it never fails: a file it cannot open, lock or remove (another user's,
a link, one that vanished) is left alone.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
import time
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from extensions._compat import StateDictStager
from extensions.errors import CheckpointStorageError
from storage.checkpoint.persist._copies import Copies
from storage.checkpoint.persist._cuda import InFlight, Pins, SideCopies

log = logging.getLogger(__name__)

#: Storages smaller than this are staged in private memory and sent by value.
SMALL = 64 << 10
#: A lock file younger than this with no lock held may be a pool being born.
_BIRTH_GRACE = 60.0
#: Tries at an unused pool name before giving up (each collision is 2^-96 by chance).
_NAME_TRIES = 16
#: madvise(2) advice that faults a mapping's pages in, writable (Linux >= 5.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _prefix() -> str:
    return f"dcp-storage-{os.getuid()}-"


#: ``{pid}-{token}`` then ``.lock`` (the pool's lock file) or ``-{token}`` (a segment).
_NAME = re.compile(r"(?P<pool>\d+-[0-9a-f]{24})(?:\.lock|-[0-9a-f]{16})")


def sweep() -> list[str]:
    """Remove the segments (and lock files) of this user's pools whose owner is gone;
    returns the names removed. Never raises for what it finds in the directory."""
    directory = shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    pools: dict[str, list[str]] = {}
    prefix = _prefix()
    for name in names:
        match = _NAME.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is not None:
            pools.setdefault(match["pool"], []).append(name)
    removed: list[str] = []
    for pool, members in pools.items():
        removed += _sweep_pool(directory, f"{prefix}{pool}", members)
    return removed


def _sweep_pool(directory: str, pool: str, members: list[str]) -> list[str]:
    """Remove ``members`` of ``pool`` if no live process holds its lock."""
    lock_name = f"{pool}.lock"
    segments = [m for m in members if m != lock_name]
    try:
        fd = os.open(
            os.path.join(directory, lock_name),
            os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        )
    except FileNotFoundError:
        fd = None  # segments outlive their lock file only when their owner is gone
    except OSError:
        return []  # another user's, or not a file: not ours to judge
    try:
        if fd is not None:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                return []
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return []  # held: its owner (or a child it forked) lives
            if not segments and time.time() - info.st_mtime < _BIRTH_GRACE:
                return []  # a pool being made takes its lock right after creating it
            segments.append(lock_name)  # last: a segment never outlives its lock file
        return [name for name in segments if _unlink_own(directory, name)]
    except OSError as exc:
        log.debug("not sweeping staging pool %s: %s", pool, exc)
        return []
    finally:
        if fd is not None:
            os.close(fd)


def _unlink_own(directory: str, name: str) -> bool:
    """Remove ``directory/name`` if it is a regular file this user owns."""
    path = os.path.join(directory, name)
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def map_segment(name: str) -> mmap.mmap:
    """Map the segment ``name`` read-write (the persist worker's side)."""
    fd = os.open(os.path.join(shm_dir(), name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _create_unique(stem: str, random_bytes: int, suffix: str = "") -> tuple[str, int]:
    """Create ``{stem}{random hex}{suffix}`` (0600, never an existing file or link);
    returns the name without ``suffix`` and the open descriptor. A name that is taken
    (by chance, or by someone who listed the directory) is skipped for another."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_NAME_TRIES):
        name = f"{stem}{secrets.token_hex(random_bytes)}"
        try:
            return name, os.open(os.path.join(shm_dir(), name + suffix), flags, 0o600)
        except FileExistsError:
            continue
    raise CheckpointStorageError(
        f"cannot create a staging file in {shm_dir()}: {_NAME_TRIES} random names were "
        "all taken; check who writes there, or save with persist='thread'"
    )


class _Owner:
    """A pool's name and the lock that says its owner lives (see the module docstring)."""

    def __init__(self) -> None:
        name, fd = _create_unique(f"{_prefix()}{os.getpid()}-", 12, ".lock")
        fcntl.flock(fd, fcntl.LOCK_SH)  # held until the last process holding fd is gone
        self.fd = fd
        self.name = name
        self.pid = os.getpid()

    def relock(self) -> None:
        """Make the lock file again, held, after something else removed it (the owning
        process only): without it another pool's sweep takes this pool for a dead one.
        Made under a name no sweep reads, locked, then linked into place, so no sweep
        ever sees it unlocked."""
        if os.getpid() != self.pid or self.fd < 0:
            return
        path = os.path.join(shm_dir(), f"{self.name}.lock")
        new = f"{path}.new"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(new, flags, 0o600)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.link(new, path)
        except OSError:
            os.close(fd)
            return
        finally:
            with contextlib.suppress(OSError):
                os.unlink(new)
        old, self.fd = self.fd, fd
        os.close(old)

    def close(self) -> None:
        """Remove the lock file (the owning process only) and close this process's hold
        on the lock; once for each process."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir(), f"{self.name}.lock"))
        with contextlib.suppress(OSError):
            os.close(fd)


class _Segment:
    """One named segment holding one staged storage; its space is reserved by
    :meth:`reserve` (all of it, or piece by piece) before anything is written to it."""

    def __init__(self, owner: _Owner, size: int) -> None:
        name, fd = _create_unique(f"{owner.name}-", 8)
        path = os.path.join(shm_dir(), name)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except OSError as exc:
            os.unlink(path)
            raise _no_room(size, exc) from exc
        finally:
            os.close(fd)
        self.name = name
        self.path = path
        self.reserved = False  # every page's space: set once all of it is reserved
        self.storage = torch.frombuffer(self.map, dtype=torch.uint8).untyped_storage()
        self.address = self.storage.data_ptr()

    def reserve(self, offset: int = 0, length: int | None = None) -> None:
        """Reserve the pages of bytes ``[offset, offset + length)`` (to the end when
        ``length`` is None); raises naming the fix when ``/dev/shm`` is full. The file
        is opened for the call: a stage of thousands of new segments holds no
        descriptor per segment."""
        size = len(self.map)
        length = size - offset if length is None else length
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, offset, length)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _no_room(size, exc) from exc

    def touch(self) -> None:
        """Fault every page into this process's mapping now, so that the first copy
        into the segment runs at the speed of a copy into warm memory."""
        try:
            self.map.madvise(_MADV_POPULATE_WRITE)
        except (AttributeError, OSError, ValueError):  # before Linux 5.14: write them
            torch.frombuffer(self.map, dtype=torch.uint8).zero_()

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _no_room(size: int, exc: OSError) -> CheckpointStorageError:
    return CheckpointStorageError(
        f"cannot reserve {size} bytes of shared memory in {shm_dir()} for staging "
        f"a checkpoint ({exc}); give it more room (docker: --shm-size) or save with "
        "persist='thread'"
    )


class StagingPool:
    """The shared-memory staging buffers of this process, one segment per large storage.

    :meth:`stage` copies a state dict into buffers cached by source storage (the next
    stage of the same tensors copies into the same buffers); :meth:`locate` tells where
    a staged tensor's bytes are. Not thread-safe: the persist client serializes stages.
    A buffer staging a CUDA storage is pinned (``pins``, :mod:`._cuda`) and copied into
    without blocking, on a side stream; copies from CPU run on ``copy_threads`` threads
    (:class:`._copies.Copies`).
    """

    def __init__(self, pins: Pins | None = None, copy_threads: int = 1) -> None:
        sweep()
        self.pins = pins if pins is not None else Pins()
        self.side = SideCopies()
        self._copies = Copies(copy_threads)
        self._owner = _Owner()
        self._segments: dict[int, _Segment] = {}  # by address
        self._addresses: list[int] = []  # sorted
        self._stager = _Stager(self)
        self._lock = threading.Lock()
        _POOLS.add(self)

    def stage(self, state_dict: Any) -> tuple[Any, InFlight | None]:
        """A copy of ``state_dict`` whose large tensors live in shared memory, and its
        copies from CUDA devices, still in flight (``None`` when there were none: the
        copy is complete). Its buffers must not be read before :meth:`InFlight.wait`."""
        with self._lock:
            self._collect()
            self.side.start()
            failed = True
            try:
                staged = self._stager.stage(state_dict)
                self._copies.finish()
                failed = False
            finally:
                if failed:  # no copy may outlive a failed stage: the next one reuses
                    self._copies.finish(raising=False)  # the buffers (and its error
                copies = self.side.finish(state_dict)  # is the one raised)
                if failed and copies is not None:
                    copies.wait()
            return staged, copies

    def reserve(self, state_dict: Any) -> None:
        """Make the buffers a later :meth:`stage` of ``state_dict``'s tensors copies
        into, their pages touched, copying nothing; buffers that exist are kept. Safe
        while a save holds the buffers: nothing it reads changes."""
        with self._lock:
            self._stager.copying = False
            try:
                self._stager.stage(state_dict)
            finally:
                self._stager.copying = True

    def live(self) -> list[str]:
        """The names of the segments in use (what the worker keeps mapped)."""
        with self._lock:
            return [s.name for s in self._segments.values()]

    def locate(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """``(segment, byte offset)`` of a contiguous staged tensor's bytes, or ``None``
        when they are not in a segment."""
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes == 0:
            return None
        start = tensor.data_ptr()
        with self._lock:
            i = bisect.bisect_right(self._addresses, start) - 1
            if i < 0:
                return None
            segment = self._segments[self._addresses[i]]
        offset = start - segment.address
        return (segment.name, offset) if offset + nbytes <= len(segment.map) else None

    def new_storage(
        self, nbytes: int, *, touch: bool = False, pin: bool = False
    ) -> torch.UntypedStorage:
        """A staging buffer of ``nbytes``; ``pin``: page-locked for CUDA copies."""
        if nbytes < SMALL:
            if pin:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            return torch.UntypedStorage(nbytes)
        segment = _Segment(self._owner, nbytes)
        self._segments[segment.address] = segment
        bisect.insort(self._addresses, segment.address)
        if touch or pin:  # pages that are mapped (or locked) now: reserved first
            try:
                segment.reserve()
            except BaseException:
                self._drop(segment.address)
                raise
            segment.reserved = True
        if touch:
            segment.touch()
        if pin:
            try:
                self.pins.pin(segment.address, nbytes)
            except BaseException:
                self._drop(segment.address)
                raise
        return segment.storage

    def copy_into(self, staged: torch.UntypedStorage, source: torch.UntypedStorage) -> None:
        """Copy ``source`` into its staging buffer ``staged`` (done when the stage is)."""
        segment = self._segments.get(staged.data_ptr())
        if segment is None:  # a small storage, in private memory
            staged.copy_(source)
        else:
            self._copies.add(segment, source)

    def _drop(self, address: int) -> None:
        """Forget a segment: unregistered from CUDA first, then unlinked."""
        self.pins.unpin(address)
        self._segments.pop(address).unlink()
        self._addresses.remove(address)

    def _collect(self) -> None:
        # Segments whose source storage is gone (the cache dropped them) are removed
        # before the next stage; no save reads them then (the client waits for that).
        live = {s.data_ptr() for s in self._stager.cached()}
        for address in [a for a in self._addresses if a not in live]:
            self._drop(address)
        # Segments whose file something else removed (systemd-logind's RemoveIPC, a
        # cleaner of /dev/shm): the worker maps segments by name, so it could never
        # read them again; forgotten here, they are made afresh by this stage.
        try:
            present = set(os.listdir(shm_dir()))
        except OSError:
            return
        if f"{self.name}.lock" not in present:
            self._owner.relock()
        gone = {a for a in self._addresses if self._segments[a].name not in present}
        if gone:
            log.warning(
                "%d staging buffers of %s were removed from %s by something else; "
                "making them again",
                len(gone),
                self.name,
                shm_dir(),
            )
            self._stager.forget(gone)
            for address in gone:
                self._drop(address)

    @property
    def name(self) -> str:
        """The pool's name: every segment's name starts with it."""
        return self._owner.name

    def close(self) -> None:
        """Remove every segment (mappings stay valid until their tensors are gone); in a
        child made with ``fork``, only forget them: they are its parent's."""
        with self._lock:
            self._copies.close()
            if os.getpid() == self._owner.pid:
                for address, segment in self._segments.items():
                    self.pins.unpin(address)
                    segment.unlink()
            self._owner.close()
            self._segments.clear()
            self._addresses.clear()
            self._stager.reset()
        _POOLS.discard(self)


class _Stager(StateDictStager or object):  # type: ignore[misc]
    """torch's deep-copying stager (it keeps the structure of DTensors and other
    objects), allocating each copied storage from the pool and reusing it next time."""

    def __init__(self, pool: StagingPool) -> None:
        super().__init__(pin_memory=False, share_memory=False)
        self._pool = pool
        self._cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.copying = True  # False: make and touch the buffers only (StagingPool.reserve)

    def cached(self) -> list[torch.UntypedStorage]:
        return list(self._cache.values())

    def reset(self) -> None:
        self._cache = WeakIdKeyDictionary()

    def forget(self, addresses: set[int]) -> None:
        """Drop the cached buffers at ``addresses``: the next stage makes new ones."""
        for source, staged in list(self._cache.items()):
            if staged.data_ptr() in addresses:
                del self._cache[source]

    def _stage_untyped_storage(
        self, storage: torch.UntypedStorage, non_blocking: bool = False
    ) -> torch.UntypedStorage:
        cuda = storage.device.type == "cuda"
        staged = self._cache.get(storage)
        if staged is None or staged.nbytes() != storage.nbytes():
            staged = self._pool.new_storage(storage.nbytes(), touch=not self.copying, pin=cuda)
            self._cache[storage] = staged
        if self.copying and cuda:
            with self._pool.side.stream(storage.device):
                staged.copy_(storage, non_blocking=True)
        elif self.copying:
            self._pool.copy_into(staged, storage)
        return staged


_POOLS: weakref.WeakSet[StagingPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()
