"""The subprocess servers start on ports of their own: a neighbour that took a port
picked for one (another xdist worker, another job on the machine) makes that try fail
and the start retry on fresh ports; it never stands in for the server."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.support import server_process
from tests.support.server_process import FakeGCS, SeaweedFS, ServerUnavailable, free_ports


def _first_pick(monkeypatch: pytest.MonkeyPatch, ports: dict[int, int]) -> None:
    """The first pick of ``count`` ports returns ``ports[count]`` in place of a free
    port: a neighbour took it between the pick and the server's bind."""
    picks: Iterator[int] = iter([0])

    def pick(count: int) -> list[int]:
        fresh = free_ports(count)
        if next(picks, None) is not None:
            fresh[0] = ports[count]
        return fresh

    monkeypatch.setattr(server_process, "free_ports", pick)


def _listens(server: server_process.ServerProcess) -> bool:
    """Every port of ``server`` is listened on by its process."""
    assert server.proc is not None
    return all(server_process.listens(server.proc.pid, p) for p in server.ports.values())


def _fake_gcs() -> FakeGCS:
    try:
        return FakeGCS()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))


def test_a_neighbour_fake_gcs_on_the_port_does_not_stand_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the start probed the URL and took any answer as its own server's, here
    # another fake-gcs-server's (that of another worker: its objects, not ours).
    with _fake_gcs() as neighbour:
        taken = neighbour._server.ports["port"]
        _first_pick(monkeypatch, {1: taken})
        with _fake_gcs() as ours:
            assert ours.url != neighbour.url
            assert _listens(ours._server)


def test_a_neighbour_that_never_answers_costs_one_try(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the probe waited on the neighbour (it accepts and never answers) until its
    # own deadline, then the start failed; now the held port fails the try at once.
    with socket.create_server(("127.0.0.1", 0)) as neighbour:
        _first_pick(monkeypatch, {1: neighbour.getsockname()[1]})
        with _fake_gcs() as ours:
            assert ours._server.ports["port"] != neighbour.getsockname()[1]
            assert _listens(ours._server)


def test_seaweedfs_retries_when_one_of_its_ports_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        weed = SeaweedFS()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    with socket.create_server(("127.0.0.1", 0)) as neighbour:
        _first_pick(monkeypatch, {len(weed._server.names): neighbour.getsockname()[1]})
        with weed:
            assert neighbour.getsockname()[1] not in weed.ports.values()
            assert _listens(weed._server)
            assert weed.url == f"http://127.0.0.1:{weed.ports['s3.port']}"


def test_a_server_that_never_comes_up_fails_after_bounded_tries(tmp_path: object) -> None:
    def command(ports: dict[str, int], workdir: str) -> list[str]:
        return ["sh", "-c", "echo refusing to start; exit 3"]

    def probe(ports: dict[str, int]) -> None:
        raise AssertionError("never reached: the process exits first")

    server = server_process.ServerProcess("broken", ("port",), command, probe)
    with pytest.raises(RuntimeError, match=r"broken did not start in 2 tries:(.|\n)*exited \(3\)"):
        server.start(timeout=60, attempts=2)
