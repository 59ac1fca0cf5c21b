"""Every error a user may catch is importable from the package they import: each error
class the docs name, and every public exception class of ``extensions.errors``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import extensions
import storage
from extensions import errors

ROOT = Path(__file__).parents[1]


def _defined_here() -> set[str]:
    """Names of the exception classes defined in ``storage`` or ``extensions``."""
    names = set()
    for package in ("storage", "extensions"):
        for source in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"^class (\w+Error)\b", source.read_text(), re.MULTILINE))
    return names


def test_every_error_the_docs_name_is_exported_from_storage() -> None:
    """The docs told users to catch ``WorkerDiedError`` and ``RangeMismatchError``, which
    ``storage`` did not export (they lived in ``extensions.errors`` and a private backend
    module only)."""
    ours = _defined_here()
    named = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in set(re.findall(r"\b\w+Error\b", doc.read_text())) & ours:
            named.setdefault(name, doc.name)
    assert named, "the docs name no error of ours: the scan is broken"
    missing = {name: doc for name, doc in named.items() if name not in storage.__all__}
    assert not missing, f"named in the docs, not exported from storage: {missing}"
    for name in named:
        assert issubclass(getattr(storage, name), BaseException)


def test_every_public_error_class_is_exported() -> None:
    """``WorkerDiedError`` and ``CheckpointInUseError`` were missing from ``extensions``,
    ``WorkerDiedError`` from ``storage`` too."""
    public = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
        and not name.startswith("_")
    }
    assert "CheckpointStorageError" in public
    for package in (storage, extensions):
        missing = sorted(public - set(package.__all__))
        assert not missing, f"not exported from {package.__name__}: {missing}"
        for name in public:
            assert getattr(package, name) is getattr(errors, name)
