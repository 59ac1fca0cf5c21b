"""Run :mod:`tests.support.preempt_job` as real processes (one per rank) that tests can signal,
kill and restart, and read what they printed."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_runs = itertools.count()


class Job:
    """``world`` ranks of ``python -m tests.support.preempt_job ARGS``, started at once; each
    rank's stdout lines are collected as they come, its stderr kept in a file."""

    def __init__(self, tmp_path: Path, world: int, args: list[str]) -> None:
        run = next(_runs)
        env = dict(os.environ, WORLD_SIZE=str(world), STORE=str(tmp_path / f"store-{run}"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.errors = [tmp_path / f"run{run}-rank{r}.err" for r in range(world)]
        self.procs: list[subprocess.Popen[str]] = []
        self._lines: list[list[str]] = [[] for _ in range(world)]
        self._readers: list[threading.Thread] = []
        for rank in range(world):
            with open(self.errors[rank], "w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.support.preempt_job", *args],
                    env=dict(env, RANK=str(rank)),
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(rank,), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, rank: int) -> None:
        stdout = self.procs[rank].stdout
        assert stdout is not None
        for line in stdout:
            self._lines[rank].append(line.strip())

    def lines(self, rank: int, prefix: str) -> list[str]:
        return [x for x in list(self._lines[rank]) if x == prefix or x.startswith(prefix + " ")]

    def each(self, rank: int, prefix: str, words: int) -> list[list[str]]:
        """The words of every line rank ``rank`` printed that starts with ``prefix``,
        each line checked to hold ``words`` words (the prefix counts): a line that does
        not fails with what every rank printed."""
        found = [line.split() for line in self.lines(rank, prefix)]
        for line in found:
            if len(line) != words:
                raise AssertionError(
                    f"rank {rank} printed {' '.join(line)!r}, not {words} words:\n{self.report()}"
                )
        return found

    def one(self, rank: int, prefix: str, words: int) -> list[str]:
        """The words of the one line rank ``rank`` printed that starts with ``prefix``
        (see :meth:`each`); none, or several, fail with what every rank printed."""
        found = self.each(rank, prefix, words)
        if len(found) != 1:
            raise AssertionError(
                f"rank {rank} printed {len(found)} {prefix!r} lines, not one:\n{self.report()}"
            )
        return found[0]

    def hashes(self, rank: int) -> dict[int, str]:
        """Rank ``rank``'s state hash after each step it trained."""
        return {int(step): digest for _, step, digest in self.each(rank, "@step", 3)}

    def stderr(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in self.errors)

    def report(self) -> str:
        """What each rank printed (the last lines of its stdout), its exit status so far,
        and its stderr: the message of every failure that reads the job's output."""
        parts = []
        for rank, proc in enumerate(self.procs):
            out = list(self._lines[rank])
            shown = "\n".join(out[-40:]) or "(nothing)"
            parts.append(
                f"--- rank {rank} (exit status {proc.poll()}), stdout, last 40 of "
                f"{len(out)} lines:\n{shown}"
            )
        return "\n".join(parts) + "\n" + self.stderr()

    def wait_for(self, rank: int, line: str, timeout: float = 300.0) -> None:
        """Until rank ``rank`` prints ``line`` (its first words); generous by default, as
        the machine may be shared (a rank that exits first fails at once)."""
        deadline = time.monotonic() + timeout
        while not self.lines(rank, line):
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                self._readers[rank].join(10)  # what it printed last, before judging
                if self.lines(rank, line):
                    return
                self.kill(range(len(self.procs)))
                raise AssertionError(f"rank {rank} never printed {line!r}:\n{self.report()}")
            time.sleep(0.02)

    def kill(self, ranks: object) -> None:
        """SIGKILL the ranks named (an iterable of ranks) and reap them."""
        for rank in ranks:  # type: ignore[attr-defined]
            if self.procs[rank].poll() is None:
                self.procs[rank].send_signal(signal.SIGKILL)
            self.procs[rank].wait()
            self._readers[rank].join(10)

    def terminate_then_kill(
        self, ranks: list[int], *, once: str, apart: float = 0.0, timeout: float = 300.0
    ) -> None:
        """SIGTERM ``ranks`` in order, ``apart`` seconds apart, then SIGKILL every rank
        once each of ``ranks`` has printed ``once`` (torchrun's way, the grace being
        what the job reports it needed rather than a fixed delay that a loaded machine
        outlasts); fails, with what each rank printed, if one never does."""
        for i, rank in enumerate(ranks):
            if i:
                time.sleep(apart)
            self.procs[rank].send_signal(signal.SIGTERM)
        for rank in ranks:
            self.wait_for(rank, once, timeout)
        self.kill(range(len(self.procs)))

    def finish(self, timeout: float = 600.0) -> None:
        """Wait for every rank to exit; raise with their stderr unless all exited 0."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill(range(len(self.procs)))
        if any(code != 0 for code in codes):
            raise AssertionError(f"the job ended with exit codes {codes}:\n{self.report()}")


def committed_steps(tier: Path) -> list[int]:
    """The steps committed (``.metadata`` present) in a local tier directory."""
    if not tier.is_dir():
        return []
    return sorted(
        int(p.name[5:])
        for p in tier.iterdir()
        if p.name.startswith("step-") and (p / ".metadata").exists()
    )


def start_script(code: str, args: list[str]) -> subprocess.Popen[bytes]:
    """``python -c code ARGS`` started with this checkout first on its path; its stderr
    kept for :func:`wait_for_mark`'s failure message."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def wait_for_mark(proc: subprocess.Popen[bytes], mark: Path, waiting_for: str) -> None:
    """Return once ``proc`` created ``mark``; fails naming ``waiting_for`` when it exits
    first (with its stderr) or takes 300 s (generous: a new interpreter imports torch
    first, which a loaded machine can stretch past half a minute)."""
    deadline = time.monotonic() + 300
    while not mark.exists():
        if proc.poll() is not None:
            error = proc.communicate()[1].decode()[-2000:]
            raise AssertionError(f"exited before {waiting_for}: {error}")
        assert time.monotonic() < deadline, f"never reached {waiting_for}"
        time.sleep(0.02)


def kill_when_marked(code: str, args: list[str], mark: Path, waiting_for: str) -> None:
    """Run ``python -c code ARGS`` until it creates ``mark``, then kill it with SIGKILL:
    a process killed at a point of its own choosing, no timing window."""
    proc = start_script(code, args)
    try:
        wait_for_mark(proc, mark, waiting_for)
    finally:
        proc.kill()
        proc.wait(10)


def park_on_rm_file(fragment: str, mark: str) -> None:
    """In a script run by :func:`kill_when_marked`: the first ``LocalFileSystem``
    removal (``rm_file_in``, what every deletion uses) of a path containing ``fragment``
    creates ``mark``, then waits to be killed (for 300 s at most, so a script whose test
    died ends by itself)."""
    from storage.backends._local import LocalFileSystem

    rm_file_in = LocalFileSystem.rm_file_in

    def parked(self: LocalFileSystem, directory: str, name: str) -> None:
        if fragment in os.path.join(directory, name):
            open(mark, "w").close()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                time.sleep(0.05)
        rm_file_in(self, directory, name)

    LocalFileSystem.rm_file_in = parked  # type: ignore[method-assign]
