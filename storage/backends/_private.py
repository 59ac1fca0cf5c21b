"""Reaching a client library's private name, the way every compat module does
(``s3/_compat.py``, ``gcs/_compat.py``, ``storage/integrations/_torchtune_compat.py``;
torch's are in ``extensions/_compat.py``): a name gone in an installed release fails
with an error naming the library, its version, the name and the releases checked."""

from __future__ import annotations

import importlib.metadata
from typing import Any


class PrivateNameMissing(RuntimeError):
    """An installed client library lacks a private name dcp-storage relies on."""

    def __init__(self, library: str, name: str, purpose: str, checked: str) -> None:
        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        super().__init__(
            f"{library} {version} has no {name}, which dcp-storage uses for {purpose} "
            f"(checked on {library} {checked}); install a {library} release in that range, "
            "or report the release that dropped it"
        )
        self.library = library
        self.name = name


def private(owner: object, name: str, library: str, purpose: str, checked: str) -> Any:
    """``owner.<name>``, a private name of ``library`` used for ``purpose`` and checked
    on the releases ``checked``; :class:`PrivateNameMissing` if it is gone."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise PrivateNameMissing(library, name, purpose, checked) from None
