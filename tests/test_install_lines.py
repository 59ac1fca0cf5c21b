"""Every `pip install` line of docs/integrations.md resolves against the tested pins.

Each backticked line is resolved as written (`pip install --dry-run`: nothing is
installed), with `dcp-storage[...]` read as this checkout (`.[...]`) and
`-c constraints-test.txt` added where the line has no constraints, so an extra whose
requirements the pins cannot satisfy fails here rather than on a user's machine. Skipped
when the package registry cannot be reached."""

from __future__ import annotations

import concurrent.futures
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "integrations.md"
TIMEOUT = 300  # seconds per line


def _install_lines(text: str) -> list[list[str]]:
    found = []
    for line in re.findall(r"`(pip install [^`]+)`", text.replace("\n", " ")):
        for part in line.split("&&"):
            argv = shlex.split(part.strip())[2:]
            argv = [re.sub(r"^dcp-storage(\[.*\])$", r".\1", a) for a in argv]
            if "-c" not in argv:
                argv[:0] = ["-c", "constraints-test.txt"]
            found.append(argv)
    return found


LINES = _install_lines(DOC.read_text())


def test_the_doc_has_install_lines() -> None:
    assert len(LINES) >= 5, LINES


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> None:
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d"]
        + [str(tmp_path_factory.mktemp("probe")), "six"],
        capture_output=True,
        timeout=TIMEOUT,
    )
    if probe.returncode:
        pytest.skip("the package registry cannot be reached")


def test_every_install_line_resolves(registry: None) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # pip's resolver: a core each
        results = list(pool.map(_resolve, LINES))
    failed = [why for why in results if why]
    assert not failed, "\n\n".join(failed)


def _resolve(args: list[str]) -> str:
    """Nothing when ``pip install ARGS`` resolves; else the line and pip's complaint."""
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    return "" if done.returncode == 0 else f"pip install {shlex.join(args)}\n{done.stderr[-2000:]}"
