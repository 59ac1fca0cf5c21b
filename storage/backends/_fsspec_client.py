"""``FsspecClientBackend``: the fsspec client under a backend built on one (fsspec's
own filesystems, S3, GCS). One client per process, made on first use by one thread,
rebuilt after unpickling and in a child made with ``fork``; its creation errors carry
no credential (:attr:`~FsspecClientBackend.redactor`); a request made from a task with
a :class:`~storage.backends.cancel.Cancel` installed is interrupted past its deadline.
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

import fsspec

from storage.backends._secrets import Redactor, secret_values
from storage.backends.base import FileSystemBase
from storage.backends.cancel import current


class FsspecClientBackend(FileSystemBase):
    """A backend on an fsspec client (see the module docstring); the contract is its
    subclasses' (:class:`storage.backends._fsspec.FsspecFileSystem`). ``protocol`` is
    the client's: the class's, the one given, or (``None``) the first URL's."""

    #: Protocol a subclass is bound to (``"s3"``, ``"gs"``); ``None``: from the URL.
    protocol: ClassVar[str | None] = None

    def __init__(
        self, *, storage_options: dict[str, Any] | None = None, protocol: str | None = None
    ) -> None:
        super().__init__(storage_options=storage_options)
        self._protocol = protocol or type(self).protocol
        self._fs: fsspec.AbstractFileSystem | None = None
        # The first callers may come from many reader/writer threads at once: one client.
        self._fs_lock = threading.Lock()
        self._pid = os.getpid()  # the process whose clients these are

    # --- the fsspec client ---------------------------------------------------------

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The underlying fsspec filesystem, created on first use (and after unpickling,
        and in a child made with ``fork``)."""
        self._in_this_process()
        client = self._fs
        if client is None:
            with self._fs_lock:
                client = self._fs = self._fs or self._new_client()
        return client

    def _in_this_process(self) -> None:
        """A child made with ``fork`` drops the clients it inherited (their event loop,
        sockets, threads and locks are the parent's: fsspec refuses its loop there, "not
        fork-safe") and builds its own on first use, as the client caches do per process."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._fs_lock = threading.Lock()
            self._fs = None
            self._forget_clients()

    def _forget_clients(self) -> None:
        """Drop what a backend built on :attr:`fs` (a child made with ``fork`` rebuilds it)."""

    def _new_client(self) -> fsspec.AbstractFileSystem:
        if self._protocol is None:
            raise ValueError(
                f"{type(self).__name__} has no protocol yet: pass a URL such as "
                "'memory://bucket/ckpt' or protocol='memory'"
            )
        try:
            return self._make_client(self._protocol, self._client_options())
        except Exception as exc:
            if self.redactor.scrub(exc) is not None:
                raise
            text = self.redactor.redact(f"{type(exc).__name__}: {exc}")
            raise OSError(f"{self._protocol}:// client: {text}") from None

    @property
    def redactor(self) -> Redactor:
        """Removes this backend's credentials from messages (``_secrets``); every client
        error passes through it on its way out (:meth:`_errors`)."""
        redactor = self.__dict__.get("_redactor")
        if redactor is None:
            redactor = self.__dict__["_redactor"] = Redactor(self._secrets())
        return redactor

    def _secrets(self) -> list[str]:
        """The credentials this backend knows (those named in ``storage_options``)."""
        return list(secret_values(self.storage_options))

    def _client_options(self) -> dict[str, Any]:
        return dict(self.storage_options)

    def _make_client(self, protocol: str, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        return fsspec.filesystem(protocol, **options)

    def __getstate__(self) -> dict[str, Any]:
        # Clients hold sessions, event loops and locks: rebuild them on the other side.
        state = dict(self.__dict__)
        state["_fs"] = None
        state.pop("_redactor", None)
        del state["_fs_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs_lock = threading.Lock()
        self._pid = os.getpid()

    def _request(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<name>(*args, **kwargs)``. On an async client (s3fs, gcsfs) called
        from a thread with a :class:`~storage.backends.cancel.Cancel` installed (a save's
        or load's task), the coroutine runs through it: past the deadline the request is
        interrupted instead of left running in a thread nobody can join."""
        fs = self.fs
        cancel = current()
        coroutine = getattr(fs, f"_{name}", None) if getattr(fs, "async_impl", False) else None
        if cancel is not None and coroutine is not None:
            return cancel.run(fs.loop, coroutine, *args, **kwargs)
        return getattr(fs, name)(*args, **kwargs)
