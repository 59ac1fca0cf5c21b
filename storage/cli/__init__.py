"""The ``dcp-storage`` command line (``main``); the top layer, imported by nothing."""

from storage.cli.main import main

__all__ = ["main"]
