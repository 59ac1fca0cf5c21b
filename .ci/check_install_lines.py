"""Dry-run every `pip install` line of docs/integrations.md against the tested pins.

Each backticked line is run as written, with `dcp-storage[...]` read as this checkout
(`.[...]`), plus `--dry-run --quiet` and `-c constraints-test.txt` where the line has
no constraints: it resolves, without installing. Exit 0 when every line resolves, 1
naming the lines that do not, and 0 with a note when the registry cannot be reached.
Usage: python .ci/check_install_lines.py [python]   (default: this interpreter)
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "integrations.md"
TIMEOUT = 600  # seconds per command


def commands(text: str) -> list[list[str]]:
    found = []
    for line in re.findall(r"`(pip install [^`]+)`", text.replace("\n", " ")):
        for part in line.split("&&"):
            argv = shlex.split(part.strip())
            argv = [re.sub(r"^dcp-storage(\[.*\])$", r".\1", a) for a in argv]
            if "-c" not in argv:
                argv[2:2] = ["-c", "constraints-test.txt"]
            found.append(argv[2:])
    return found


def main() -> int:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    probe = subprocess.run(
        [python, "-m", "pip", "download", "--no-deps", "--quiet", "-d", "/tmp/pip-probe", "six"],
        capture_output=True,
        timeout=TIMEOUT,
    )
    if probe.returncode:
        print("skipped: the package registry cannot be reached")
        return 0
    failed = []
    for args in commands(DOC.read_text()):
        argv = [python, "-m", "pip", "install", "--dry-run", "--quiet", *args]
        try:
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
            ok, why = done.returncode == 0, done.stderr[-2000:]
        except subprocess.TimeoutExpired:
            ok, why = False, f"no answer in {TIMEOUT} s"
        print(("ok    " if ok else "FAILED ") + "pip install " + shlex.join(args))
        if not ok:
            failed.append(f"pip install {shlex.join(args)}\n{why}")
    print("\n\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
