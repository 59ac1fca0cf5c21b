"""Staging from CUDA: pinned staging buffers and copies that do not block the caller.

When a storage to stage lives on a CUDA device, its staging buffer is registered with
the CUDA host allocator (``cudaHostRegister`` on the segment's mapping, once per
segment: :class:`Pins`), so the device-to-host copy is a DMA at the link's speed, and
the copy is issued with ``non_blocking=True`` on a side stream of that device
(:class:`SideCopies`) that first waits for the work already queued on the caller's
current stream (the copy sees the tensors as they are when the save is asked for).
:class:`InFlight` is one stage's copies: an event recorded on each side stream used and
the source state dict, kept referenced until the events complete so that the caching
allocator cannot hand its memory to other work while a copy still reads it. Readers of
the staged buffers wait for it first (:meth:`InFlight.wait`). CPU-only state dicts never
come here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from extensions.errors import CheckpointStorageError

log = logging.getLogger(__name__)

#: cudaHostRegisterPortable: pinned for every CUDA context, as torch registers.
_PORTABLE = 1


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


#: The device whose context registered each address (see :func:`cuda_register`).
_registered_on: dict[int, int] = {}


def cuda_register(address: int, nbytes: int) -> None:
    """Register ``nbytes`` at ``address`` with the CUDA host allocator (page-lock it),
    in the context of the current device: the caller makes that the device of the
    tensors copied, so no context is made on a device the process does not use (as
    torch's pinned allocator avoids). A failure leaves no pending CUDA error behind."""
    device = torch.cuda.current_device()
    code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))
    if code != 0:
        drain_pending_error()
        raise CheckpointStorageError(
            f"cannot pin {nbytes} bytes of checkpoint staging memory for CUDA copies "
            f"(cudaHostRegister: {_described(code)})"
        )
    _registered_on[address] = device


def _described(code: int) -> str:
    """CUDA's words for error ``code``, and the code."""
    try:
        return str(torch.cuda.CudaError(code))  # "<CUDA's message> (<code>)"
    except Exception:  # noqa: BLE001 - the code alone says enough
        return f"error {code}"


def cuda_unregister(address: int) -> None:
    """Unregister ``address`` in the context of the device that registered it."""
    device = _registered_on.pop(address, None)
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
    if code != 0:
        drain_pending_error()
        log.debug("cudaHostUnregister error %d for staging memory at %#x", code, address)


@functools.cache
def _runtimes() -> tuple[ctypes.CDLL, ...]:
    """The CUDA runtime libraries mapped into this process (torch's among them)."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if "libcudart" in os.path.basename(path) and not path.endswith("(deleted)"):
                    paths.add(path)
    except OSError:
        return ()
    found = []
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            found.append(ctypes.CDLL(path))  # the loaded library, not a second copy
    return tuple(found)


def drain_pending_error() -> None:
    """Consume the error a failed runtime call left pending on this thread: torch checks
    each kernel launch with ``cudaGetLastError``, so the training thread's next kernel
    would fail with this unrelated error (torch's binding does not expose the call)."""
    for runtime in _runtimes():
        with contextlib.suppress(AttributeError):
            runtime.cudaGetLastError()


class Pins:
    """Which mappings are registered with the CUDA host allocator: each once, each
    unregistered (:meth:`unpin`) before its segment goes. ``register`` and
    ``unregister`` are CUDA's unless given (tests give their own).

    Where CUDA refuses a registration (page-locked memory is limited), pinning is
    given up for good (:attr:`refused`), with one warning: the buffers stay pageable,
    and the save goes on, its copies from the device slower and each one blocking the
    stage until it is done (``cudaMemcpyAsync`` into pageable memory)."""

    def __init__(
        self,
        register: Callable[[int, int], None] = cuda_register,
        unregister: Callable[[int], None] = cuda_unregister,
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._pinned: dict[int, int] = {}  # address -> bytes
        self.refused: BaseException | None = None  # why pinning was given up

    def pin(self, address: int, nbytes: int) -> bool:
        """Register ``nbytes`` at ``address`` once; false where pinning is refused."""
        if address in self._pinned:
            return True
        if self.refused is not None:
            return False
        try:
            self._register(address, nbytes)
        except (CheckpointStorageError, RuntimeError) as exc:
            self.refuse(exc)
            return False
        self._pinned[address] = nbytes
        return True

    def refuse(self, error: BaseException) -> None:
        """Give pinning up: ``error`` is CUDA's refusal of a registration."""
        if self.refused is None:
            self.refused = error
            log.warning(
                "%s; staging from CUDA goes on in pageable memory: slower copies, each "
                "blocking the save until it is done",
                error,
            )

    def unpin(self, address: int) -> None:
        if self._pinned.pop(address, None) is None:
            return
        try:
            self._unregister(address)
        except Exception as exc:  # CUDA torn down at exit: the mapping goes anyway
            log.debug("cannot unregister staging memory at %#x: %s", address, exc)

    def pinned(self) -> dict[int, int]:
        return dict(self._pinned)


class InFlight:
    """The device-to-host copies of one stage, enqueued: :meth:`wait` returns once
    they completed (then the source state dict is let go); safe from any thread."""

    def __init__(self, events: list[Event], source: Any) -> None:
        self._events = events
        self._source: Any = source
        self._lock = threading.Lock()

    def done(self) -> bool:
        with self._lock:
            return all(event.query() for event in self._events)

    def wait(self) -> None:
        with self._lock:
            for event in self._events:
                event.synchronize()
            self._events, self._source = [], None


class SideCopies:
    """A side stream per CUDA device, made once; :meth:`start` begins one stage's
    copies and :meth:`finish` ends it with the :class:`InFlight` to wait for."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._used: dict[int, torch.cuda.Stream] | None = None

    def start(self) -> None:
        self._used = {}

    @contextlib.contextmanager
    def stream(self, device: torch.device) -> Iterator[None]:
        """Issue the copies in the block on ``device``'s side stream, which waits for
        the caller's current stream the first time in a stage."""
        assert self._used is not None, "a copy outside a stage"
        index = device.index if device.index is not None else torch.cuda.current_device()
        # On ``device`` for the block: leaving ``torch.cuda.stream`` for a stream of
        # another device sets the caller's device back with ``cudaSetDevice``, which
        # makes a context there if it had none; ``torch.cuda.device`` restores lazily.
        with torch.cuda.device(index):
            side = self._used.get(index)
            if side is None:
                side = self._streams.get(index)
                if side is None:
                    side = self._streams[index] = torch.cuda.Stream(index)
                side.wait_stream(torch.cuda.current_stream(index))
                self._used[index] = side
            with torch.cuda.stream(side):
                yield

    def finish(self, source: Any) -> InFlight | None:
        """The stage's copies (``None`` when it copied nothing from a device)."""
        used, self._used = self._used or {}, None
        if not used:
            return None
        events: list[Event] = []
        for side in used.values():
            # Blocking: a thread waiting for the copies sleeps (by default CUDA spins a
            # core for as long as they take, beside training, in async staging).
            event = torch.cuda.Event(blocking=True)
            event.record(side)
            events.append(event)
        return InFlight(events, source)
