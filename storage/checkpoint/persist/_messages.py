"""What crosses the socket to the persist worker, seen from the training process: a
call pickled for the worker (refusing what the worker could not load: a class or
function of the training script), and a reply turned back into the caller's result or
exception. The worker's side is :mod:`._child`; the messages are listed there."""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

from extensions.errors import CheckpointStorageError


class NotSendable(TypeError):
    """A call's function or arguments do not pickle, or do not unpickle in the worker,
    so the worker cannot run it."""


#: The names the training script's own module has (``__mp_main__`` under
#: multiprocessing's spawn): the worker does not run that script.
MAIN_MODULES = frozenset({"__main__", "__mp_main__"})


def dumps_call(message: object) -> bytes:
    """``message`` pickled, refusing a class or function of the training script's
    module: it pickles by reference here, and the worker would not find it. A message
    that names no such module (every pickled reference names its module) is pickled
    once, at full speed; only one that does is pickled again, checking each object."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if any(name.encode() in data for name in MAIN_MODULES):
        _Refusing(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return data


class _Refusing(pickle.Pickler):
    """Refuses a class or function of the training script's module (see :func:`dumps_call`)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ in MAIN_MODULES:
            raise pickle.PicklingError(
                f"{obj.__module__}.{obj.__qualname__} is defined in the training script, "
                "which the persist worker does not run"
            )
        return NotImplemented


def not_sendable(name: str, why: str) -> NotSendable:
    return NotSendable(
        f"cannot send {name} to the persist worker: {why}. "
        "Transforms and filesystems must pickle and be defined at module level in a "
        "module the worker can import (not the training script); or save with "
        "persist='thread'"
    )


def unreadable(name: str, exc: BaseException) -> CheckpointStorageError:
    error = CheckpointStorageError(
        f"the checkpoint persist worker ran {name}, but its reply could not be read in "
        f"the training process ({type(exc).__name__}: {exc}); the worker keeps serving. "
        "What a call returns or raises must unpickle here: a class at module level in a "
        "module both processes import"
    )
    error.__cause__ = exc
    return error


def remote_error(payload: tuple[bytes | None, str, str, str]) -> BaseException:
    raw, type_name, message, text = payload
    error: BaseException | None = None
    if raw is not None:
        try:
            error = pickle.loads(raw)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        error = CheckpointStorageError(
            f"{type_name}: {message} (raised in the checkpoint persist worker; the error "
            "itself could not be sent back)"
        )
    error.__cause__ = _RemoteTraceback(text)
    return error


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n(in the persist worker)\n" + str(self.args[0])
