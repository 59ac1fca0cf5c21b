"""Importing a framework that may not be installed."""

from __future__ import annotations

import importlib
from types import ModuleType

from extensions.errors import MissingDependencyError


def require(module: str, extra: str, then: str = "") -> ModuleType:
    """Import ``module``, or raise :class:`MissingDependencyError` naming the extra
    that installs the tested version of its framework (and ``then``, a command that
    installs what the extra cannot)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        more = f" && {then}" if then else ""
        raise MissingDependencyError(
            f"storage.integrations.{extra.replace('-', '_')} needs {module} "
            f"({exc.name or exc}); install it with: pip install 'dcp-storage[{extra}]'{more}"
        ) from exc
