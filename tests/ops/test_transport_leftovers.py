"""What a replica killed while it sent its state leaves in its directory of the recovery
transport, and who removes it: a sending process killed with SIGKILL at a point of its
own choosing (no timing window), then a transport of the same rank in a new process."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

import storage
from storage import LocalFileSystem
from storage.checkpoint import heartbeat
from tests.support.subprocess_jobs import kill_when_marked

_LONG_AGO = time.time() - 2 * 24 * 3600

# Sends step 3 and parks when its .metadata is about to be published: every data file
# and the heartbeat are written, nothing is committed.
_PARK_ON_COMMIT = """
import sys, time
from datetime import timedelta
import torch
from storage.backends._local import LocalFileSystem
import storage
write_atomic_in = LocalFileSystem.write_atomic_in
def parked(self, directory, name, data, *, exclusive=False):
    if name == ".metadata":
        open(sys.argv[2], "w").close()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # killed here; ends by itself if the test died
            time.sleep(0.05)
    write_atomic_in(self, directory, name, data, exclusive=exclusive)
LocalFileSystem.write_atomic_in = parked
sender = storage.StorageTransport(sys.argv[1], rank=0)
state = {"w": torch.randn(256, 256)}
sender.send_checkpoint([1], 3, state, timedelta(seconds=300))
"""


def _age(directory: Path) -> None:
    """Date what a killed send left two days back, its heartbeat's own clock included:
    how a replica restarted later finds it."""
    for path in directory.iterdir():
        if heartbeat.is_heartbeat_name(path.name):
            path.write_text(json.dumps({"time": _LONG_AGO}))
        os.utime(path, (_LONG_AGO, _LONG_AGO))
    os.utime(directory, (_LONG_AGO, _LONG_AGO))


def test_a_send_killed_before_its_commit_leaves_nothing_for_good(tmp_path: Path) -> None:
    """Before, the data files of a send killed before its commit (the state of a whole
    replica, once per kill) stayed in the replica's directory for good: retention keeps
    uncommitted steps, a restarted transport removed only committed ones, and nothing
    told the user to run ``gc`` there. The transport now removes, as it sends, what
    killed sends left there once older than an hour, as the local tier does."""
    mark = tmp_path / "parked"
    kill_when_marked(_PARK_ON_COMMIT, [str(tmp_path), str(mark)], mark, "the send's commit")
    killed = tmp_path / "replica-0" / "step-3"
    assert any(p.name.endswith(".distcp") for p in killed.iterdir())
    assert not (killed / ".metadata").exists()
    _age(killed)
    sender = storage.StorageTransport(str(tmp_path), rank=0)
    sender.send_checkpoint([1], 5, {"w": torch.ones(8)}, timedelta(seconds=60))
    sender.shutdown(wait=True)
    assert not killed.exists()
    assert sorted(p.name for p in (tmp_path / "replica-0").iterdir()) == [".dcp-latest", "step-5"]


def test_a_fresh_leftover_is_kept_it_may_be_a_send_still_running(tmp_path: Path) -> None:
    """The sweep's grace: a send that was killed a moment ago looks like one still
    running in another process (a worker not yet known dead): it stays."""
    mark = tmp_path / "parked"
    kill_when_marked(_PARK_ON_COMMIT, [str(tmp_path), str(mark)], mark, "the send's commit")
    sender = storage.StorageTransport(str(tmp_path), rank=0)
    sender.send_checkpoint([1], 5, {"w": torch.ones(8)}, timedelta(seconds=60))
    sender.shutdown(wait=True)
    assert (tmp_path / "replica-0" / "step-3").exists()


class _StalledSweep(LocalFileSystem):
    """Local disk whose file dates (what only a sweep asks for) wait on ``gate``: a store
    that answers a sweep's looks slowly, or not for a while."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def modified(self, path: str) -> float | None:
        self.gate.wait(300)  # bounds a failure only: the test opens it
        return super().modified(path)


def test_a_slow_sweep_never_fails_the_send_it_follows(tmp_path: Path) -> None:
    """Before, the sweep ran inside the send's own write, which ``send_checkpoint``
    waits on with the send's timeout: a sweep held by the store made a committed send
    raise ``TimeoutError`` saying it was not committed (and a heal failed for it). The
    send now returns once it is committed; the sweep follows on its own."""
    leftover = tmp_path / "replica-0" / "step-1"
    leftover.mkdir(parents=True)
    (leftover / "__0_0-0123456789ab.distcp").write_bytes(b"x" * 64)
    _age(leftover)
    gate = threading.Event()
    sender = storage.StorageTransport(str(tmp_path), rank=0, filesystem=_StalledSweep(gate))
    try:
        sender.send_checkpoint([1], 2, {"w": torch.ones(8)}, timedelta(seconds=30))
        assert (tmp_path / "replica-0" / "step-2" / ".metadata").exists()
    finally:
        gate.set()
        sender.shutdown(wait=True)
    assert not leftover.exists()  # the sweep still ran, once the store answered


def test_a_send_killed_mid_upload_leaves_no_upload_open_for_good() -> None:
    """A send killed mid-upload on S3 leaves its multipart upload open: its parts billed
    and invisible to every listing, so the sweep of its files never sees them. Before,
    nothing in the transport aborted it (only ``gc --abort-uploads`` on the replica's
    directory, which nothing told the user to run); a later send's sweep now aborts it
    by ``gc``'s rule (begun over an hour ago, no live heartbeat beside it)."""
    import uuid

    import pytest

    from tests.support.servers import (
        ServerUnavailable,
        boto3_client,
        create_bucket,
        open_uploads,
        s3_endpoint,
    )

    try:
        endpoint = s3_endpoint("moto")  # moto dates every upload 2010-11-10: long ago
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, "sends")
    prefix = f"{uuid.uuid4().hex}/job"
    s3 = boto3_client(endpoint)
    s3.create_multipart_upload(Bucket="sends", Key=f"{prefix}/replica-0/step-3/__0_0-dead.distcp")
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    sender = storage.StorageTransport(f"s3://sends/{prefix}", rank=0, storage_options=options)
    sender.send_checkpoint([1], 5, {"w": torch.ones(8)}, timedelta(seconds=120))
    sender.shutdown(wait=True)
    assert open_uploads(s3, "sends", prefix) == []
