"""The first error a DCP hook raised, kept for the one-call helpers (``api.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def records_error(method: F) -> F:
    """Keep the first error a DCP hook raised on ``self.last_error``: DCP hands callers
    only a ``CheckpointException`` quoting it, and the one-call helpers re-raise it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if getattr(self, "last_error", None) is None:
                self.last_error = exc
            raise

    return wrapper  # type: ignore[return-value]
