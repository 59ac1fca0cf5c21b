"""Staging segments: anonymous shared memory, sealed against resizing, that stages a
checkpoint (the pool that stages into them is :mod:`._pool`).

A segment is a ``memfd`` (``memfd_create(2)``): memory with no name in any file system.
It is sized once, then sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), mapped
by the training process, and its descriptor handed to the persist worker over their
private Unix socket (``SCM_RIGHTS``, :func:`send_segments`), which maps it too; then
both close the descriptor and keep only their mappings. So:

- nothing else can find a segment: there is no name to list, open, take in advance,
  replace or remove, and no cleaner of ``/dev/shm`` (systemd-logind's ``RemoveIPC``)
  sees one. Only a process that may already read this one's memory (``ptrace``: this
  user, or root) can reach it, through ``/proc/PID/fd`` while a descriptor of it is
  open, or ``/proc/PID/map_files`` (root);
- nothing can resize one: ``ftruncate`` on it fails with ``EPERM``, so no copy into or
  out of a mapping ever reads past the end of its file (``SIGBUS``);
- the kernel frees a segment when the last mapping goes: a training process or a worker
  killed with ``kill -9`` leaves nothing behind, and a child made with ``fork`` shares
  its parent's mappings and removes nothing.

Each segment holds a descriptor until it is sent; before Python 3.13 (``mmap``'s
``trackfd``) each mapping holds one too, in both processes, for its whole life.

A segment's memory is reserved before a byte is copied into it (:meth:`Segment.reserve`:
``MADV_POPULATE_WRITE``, which allocates every page of the range or fails, never a
``SIGBUS`` while copying): a memfd is bounded by the host's memory and the memory
cgroup's limit, not by the size of ``/dev/shm``. A reservation that fails, or a
descriptor that cannot be made or sent (the open-file limit), raises
:class:`SharedMemoryFull`, naming the fix.

Where ``memfd_create`` and file seals are missing (not Linux), there is no persist
worker: saves persist in threads (:func:`storage.checkpoint.persist.available`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import logging
import mmap
import os
import resource
import socket
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

from extensions.errors import CheckpointStorageError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: What ``/proc/PID/maps`` (and ``map_files``) show for a segment.
MEMFD_NAME = "dcp-storage-staging"
#: The seals every segment carries before it is mapped or sent.
SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 0x2)
    | getattr(fcntl, "F_SEAL_GROW", 0x4)
    | getattr(fcntl, "F_SEAL_SEAL", 0x1)
)
#: Descriptors sent in one message (the kernel takes at most 253).
FDS_PER_MESSAGE = 250
#: What running out of descriptors looks like (making a segment, or sending one).
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ETOOMANYREFS)
#: madvise(2) advice that faults a mapping's pages in, writable (Linux >= 5.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def available() -> bool:
    """Whether segments can be made and handed to the worker here (Linux)."""
    return (
        hasattr(os, "memfd_create")
        and hasattr(fcntl, "F_ADD_SEALS")
        and hasattr(socket, "send_fds")
        and hasattr(os, "posix_fallocate")
    )


@functools.cache
def _populates() -> bool:
    """Whether ``MADV_POPULATE_WRITE`` works here (Linux >= 5.14)."""
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(_MADV_POPULATE_WRITE)
    except (AttributeError, OSError, ValueError):
        return False
    finally:
        probe.close()
    return True


def _map(fd: int, size: int) -> mmap.mmap:
    """``fd`` mapped read-write, shared. Python's ``mmap`` keeps a duplicate of the
    descriptor for the mapping's life unless told not to (Python >= 3.13): before
    that, every segment holds a descriptor in each process that maps it."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, trackfd=False)  # type: ignore[call-arg, unused-ignore]
    return mmap.mmap(fd, size)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, called without the GIL (ctypes releases it), or ``None``
    where it cannot be found."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.madvise
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


def _populate(mapping: mmap.mmap, address: int, offset: int, length: int) -> None:
    """Allocate (and map) every page of ``mapping[offset:offset + length]`` (mapped at
    ``address``); raises ``OSError`` where there is no memory for them. Populating runs
    at the speed the host hands out fresh pages (1-3 GB/s on some virtual machines):
    Python's ``mmap.madvise`` holds the GIL all that time, which would serialize the
    copy threads' reservations and stop the training thread's walk of the state dict,
    so libc's is called directly where it can be."""
    call = _madvise()
    if call is None:
        mapping.madvise(_MADV_POPULATE_WRITE, offset, length)
        return
    if call(address + offset, length, _MADV_POPULATE_WRITE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def more_descriptors() -> bool:
    """Raise this process's soft open-file limit to its hard limit (at most 2^20); true
    if it rose. Before Python 3.13 each mapping holds a descriptor of its own, so a
    state of more tensors than the soft limit (often 1024, where the hard one is far
    above) would stage only in part: the limit is raised the first time it is met,
    as a job's launcher raising ``ulimit -n`` would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = 1 << 20
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return False
    log.info("raised the open-file limit from %d to %d for staging segments", soft, target)
    return True


def _retry_for_descriptors(call: Callable[[], _T]) -> _T:
    """``call()``, once more after raising the open-file limit where it ran out."""
    try:
        return call()
    except OSError as exc:
        if exc.errno not in OUT_OF_DESCRIPTORS or not more_descriptors():
            raise
    return call()


class Segment:
    """One sealed memfd holding one staged storage (see the module docstring).

    ``name`` is what the worker knows it by (given by the pool, unique within it).
    :attr:`fd` is open until the segment is sent to the worker (:meth:`take_fd`). Its
    memory is reserved by :meth:`reserve` (all of it, or piece by piece) before
    anything is written to it; where the kernel cannot populate a range, all of it is
    reserved here (``posix_fallocate``) and :attr:`reserved` starts true."""

    def __init__(self, name: str, size: int) -> None:
        try:
            fd = _retry_for_descriptors(
                lambda: os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            )
        except OSError as exc:
            raise no_room(size, exc) from exc
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self.reserved = not _populates()  # every page's space: set once all is reserved
            if self.reserved:
                os.posix_fallocate(fd, 0, size)
            self.map = _retry_for_descriptors(lambda: _map(fd, size))
        except OSError as exc:
            os.close(fd)
            raise no_room(size, exc) from exc
        self.name = name
        self.fd = fd
        self.storage = torch.frombuffer(self.map, dtype=torch.uint8).untyped_storage()
        self.address = self.storage.data_ptr()

    def reserve(self, offset: int = 0, length: int | None = None) -> None:
        """Reserve the pages of bytes ``[offset, offset + length)`` (to the end when
        ``length`` is None); raises :class:`SharedMemoryFull` where there is no memory
        for them. ``offset`` is a multiple of the page size."""
        size = len(self.map)
        length = size - offset if length is None else length
        if self.reserved or length <= 0:
            return
        if offset < 0 or offset % mmap.PAGESIZE or offset + length > size:
            raise ValueError(f"bytes {offset}+{length} are not a page-aligned range of {size}")
        try:
            _populate(self.map, self.address, offset, length)
        except OSError as exc:
            raise no_room(size, exc) from exc

    def touch(self) -> None:
        """Fault every page into this process's mapping now, so that the first copy
        into the segment runs at the speed of a copy into warm memory."""
        if _populates():
            self.reserve()  # populating reserves the pages and maps them: once does both
        else:  # reserved when made: write the pages
            torch.frombuffer(self.map, dtype=torch.uint8).zero_()

    def take_fd(self) -> int:
        """The descriptor, handed over to the caller (who closes it); -1 once taken."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        """Close the descriptor if it was never sent (the mapping stays until its
        tensors are gone; the kernel frees the memory with the last mapping)."""
        fd = self.take_fd()
        if fd >= 0:
            os.close(fd)


def send_segments(sock: int, fds: list[int]) -> None:
    """Send ``fds`` (at most :data:`FDS_PER_MESSAGE`) over the stream socket ``sock``
    as one byte carrying them; the receiver reads it with :func:`receive_segments`.
    Where the descriptors cannot go (``ETOOMANYREFS``: too many in flight for the
    open-file limit), the byte goes alone, so the receiver's reading stays in step,
    and the error is raised."""
    with socket.socket(fileno=sock) as channel:
        try:
            try:
                socket.send_fds(channel, [b"\0"], fds)
            except OSError:
                channel.sendall(b"\0")
                raise
        finally:
            channel.detach()  # the socket stays open: it is the caller's


def receive_segments(sock: int, names: list[str]) -> dict[str, mmap.mmap]:
    """The segments ``names`` that :func:`send_segments` sent, mapped (the worker's
    side; their descriptors are closed). What did not arrive (the sender could not send
    them, or this process had no descriptor left for them), arrived unsealed, or cannot
    be mapped (before Python 3.13 a mapping holds a descriptor too), is left out,
    logged: a save that reads it fails, naming it, and the next one stages afresh
    (:class:`._mapped.SegmentLost`). Only the socket's own failure is raised."""
    with socket.socket(fileno=sock) as channel:
        try:
            _, fds, flags, _ = socket.recv_fds(channel, 1, len(names))
        finally:
            channel.detach()
    maps: dict[str, mmap.mmap] = {}
    try:
        if len(fds) != len(names) or flags & socket.MSG_CTRUNC:
            log.warning(
                "%d staging segments were sent to the persist worker, %d arrived (the "
                "open-file limit, ulimit -n?)",
                len(names),
                len(fds),
            )
            return maps
        for name, fd in zip(names, fds, strict=True):
            try:
                if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                    log.warning("staging segment %s arrived unsealed: not mapped", name)
                    continue
                maps[name] = _map(fd, os.fstat(fd).st_size)
            except OSError as exc:  # no descriptor for its mapping (ulimit -n), or no memory
                log.warning("staging segment %s arrived but cannot be mapped: %s", name, exc)
        return maps
    finally:
        for fd in fds:
            os.close(fd)


class SharedMemoryFull(CheckpointStorageError):
    """No memory for a staging segment (the host's, or the memory cgroup's limit), or no
    descriptor for one (the open-file limit)."""


def no_room(size: int, exc: OSError) -> SharedMemoryFull:
    if exc.errno in OUT_OF_DESCRIPTORS:
        fix = "raise the open-file limit (ulimit -n: a descriptor per staged tensor)"
    else:
        fix = "give the job more memory, or stage less at once"
    return SharedMemoryFull(
        f"cannot reserve {size} bytes of shared memory for staging a checkpoint "
        f"({exc}); {fix}, or save with persist='thread'"
    )
