"""The one cache of client-library objects shared within a process.

Building a client costs: s3fs's ~0.1 s of CPU, gcsfs's TLS handshakes and access token,
a direct path's probe request. So filesystem objects of one process with equal options
share one client, and each client one direct path. A forked child builds its own (event
loops, sockets and locks do not survive a fork): every key carries the process id."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import fsspec.utils

V = TypeVar("V")


def options_key(options: dict[str, Any]) -> str:
    """A key for a client's keyword options (equal options, equal keys)."""
    return str(fsspec.utils.tokenize(sorted(options.items(), key=lambda kv: kv[0])))


class Shared(Generic[V]):
    """Values built once per key and process, under a lock (two first users racing
    get one value)."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, Hashable], tuple[Any, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], V]) -> V:
        """The value for ``key``, built with ``build()`` the first time."""
        return self._get((os.getpid(), key), None, build)

    def of(self, owner: object, build: Callable[[], V]) -> V:
        """The value for the object ``owner`` (by identity; the cache holds ``owner``,
        so its id is never reused for another while the entry lives)."""
        return self._get((os.getpid(), id(owner)), owner, build)

    def _get(self, key: tuple[int, Hashable], owner: object, build: Callable[[], V]) -> V:
        with self._lock:
            found = self._values.get(key)
            if found is None or found[0] is not owner:
                found = self._values[key] = (owner, build())
            return found[1]
