"""The package's layering (docs/architecture.md) is a rule, not a habit: import-linter
checks the contracts declared in pyproject.toml on every test run."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    # import-linter configures logging with dictConfig, which disables every logger that
    # exists by then (storage's included): later tests asserting on logs saw nothing.
    loggers = [g for g in logging.root.manager.loggerDict.values() if isinstance(g, logging.Logger)]
    disabled = [g.disabled for g in loggers]
    try:
        code = lint_imports(config_filename=os.fspath(ROOT / "pyproject.toml"), no_cache=True)
    finally:
        for logger, was in zip(loggers, disabled):
            logger.disabled = was
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 broken" in out, out
