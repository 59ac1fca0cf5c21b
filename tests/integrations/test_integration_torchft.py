"""torchft 0.2 (real package): our transport under torchft's own transport harness, on
local disk, S3 (SeaweedFS) and GCS (fake-gcs-server), with zstd and checksums.

The healing test (tests/integrations/_torchft_replica.py) runs torchft's lighthouse and
two replica groups as processes, kills one with SIGKILL, restarts it, and checks that it
heals from the live group through storage and stays bit-exact with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import unittest
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft", reason="pip install 'dcp-storage[torchft]'")

from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torchft.checkpointing.transport_test import (  # noqa: E402
    assertStateDictEqual,
    make_state_dict,
    run_multi_recovery_test,
)

import storage  # noqa: E402
from extensions import ZStandard  # noqa: E402
from extensions._compat import mesh_without_groups  # noqa: E402
from extensions.errors import IntegrityError, UnsafeCheckpointError  # noqa: E402
from storage.integrations.torchft import StorageCheckpointTransport  # noqa: E402
from tests.support.servers import (  # noqa: E402
    endpoint_with_bucket,
    gcs_endpoint_with_bucket,
    gcs_options,
    s3_options,
)

BUCKET = "torchft"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3", "gcs"])
def location(request: Any, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    run = uuid.uuid4().hex[:8]
    if request.param == "local":
        yield str(tmp_path / "ft"), None
    elif request.param == "s3":
        request.param = "seaweedfs"
        endpoint = endpoint_with_bucket(request, BUCKET)
        yield f"s3://{BUCKET}/{run}", s3_options(endpoint)
    else:
        yield f"gs://{BUCKET}/{run}", gcs_options(gcs_endpoint_with_bucket(BUCKET))


def _transports(
    root: str, options: dict[str, Any] | None
) -> Callable[[int, int], StorageCheckpointTransport]:
    def init(rank: int, world_size: int) -> StorageCheckpointTransport:
        return StorageCheckpointTransport(
            root,
            replica_id=f"group{rank}",
            storage_options=options,
            transforms=[ZStandard(level=1)],
            poll_interval=0.01,
        )

    return init


def test_torchft_transport_harness(location: tuple[str, dict[str, Any] | None]) -> None:
    """torchft's own harness: 3-node and 2-node recovery, and its timeout case, which
    failed when our TimeoutError did not say "timed out" (torchft matches the message)."""
    root, options = location
    try:
        run_multi_recovery_test(
            unittest.TestCase(), _transports(root, options), torch.device("cpu")
        )
    finally:
        if dist.is_initialized():  # the harness leaves its group behind when it fails
            dist.destroy_process_group()


def test_dtensors_come_back_as_dtensors_holding_the_senders_shard(
    tmp_path: Path, one_rank_group: None
) -> None:
    """torchft's transports hand back a DTensor with the sender's spec around the sender's
    local shard (the healing worker has the sender's rank in an identical group). Ours
    gave back a plain tensor of the global shape, zero where other ranks' shards go; and
    the DTensor of torchft's own harness state (a mesh without dimensions) not at all,
    which that harness, comparing only the keys it got back, did not notice."""
    # This rank's half of a tensor sharded over 2 ranks (the mesh makes no groups).
    mesh = mesh_without_groups("cpu", [[0, 1]], ("replicate", "shard"))
    half = torch.arange(4, dtype=torch.bfloat16)
    sharded = DTensor.from_local(
        half, mesh, [Replicate(), Shard(0)], run_check=False, shape=(8,), stride=(1,)
    )
    state = {**make_state_dict(torch.device("cpu")), "sharded": sharded, "in": [{"x": sharded}]}
    sender = StorageCheckpointTransport(tmp_path, replica_id="a")
    receiver = StorageCheckpointTransport(tmp_path, replica_id="b")
    sender.send_checkpoint([1], 1, state, timedelta(seconds=60))
    got = receiver.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=60))
    assert got.keys() == state.keys()
    assertStateDictEqual(unittest.TestCase(), {**state, "in": None}, {**got, "in": None})
    for value in (got["sharded"], got["in"][0]["x"]):
        assert isinstance(value, DTensor) and value._spec == sharded._spec
        assert torch.equal(value.to_local().view(torch.int16), half.view(torch.int16))
    sender.shutdown()
    receiver.shutdown()


def test_a_dtensor_on_a_slice_of_a_mesh_heals_onto_the_receivers_own_mesh(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP2 with HSDP or tensor parallelism shards over a slice of a device mesh
    (mesh["dp"]), which a mesh rebuilt from the sender's ranks does not equal (checked
    with four gloo ranks and a (2, 2) mesh while this was written; here the rebuild is
    made to fail instead). Given its own state (state_dict=, as torchft's PGTransport
    takes it), the receiver rebuilds each DTensor on its own mesh; without it, the
    receive names the item and the fix; a mesh of other ranks is refused."""
    from storage.ops import transport_dtensor

    def slice_only(record: list[Any]) -> Any:
        raise RuntimeError("a slice: not rebuilt from its ranks")

    mine = mesh_without_groups("cpu", [0, 1], ("dp",))
    sent = DTensor.from_local(
        torch.ones(2), mine, [Shard(0)], run_check=False, shape=(4,), stride=(1,)
    )
    sender = StorageCheckpointTransport(tmp_path, replica_id="a")
    with monkeypatch.context() as patch:
        patch.setattr(transport_dtensor, "_rebuilt_mesh", slice_only)
        sender.send_checkpoint([1], 1, {"user": {"default": {"w": sent}}}, timedelta(seconds=60))
    without = StorageCheckpointTransport(tmp_path, replica_id="b")
    with pytest.raises(RuntimeError, match="'user.default.w' is a DTensor on a slice.*state_dict="):
        without.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=60))
    own = DTensor.from_local(
        torch.zeros(2), mine, [Shard(0)], run_check=False, shape=(4,), stride=(1,)
    )
    healing = StorageCheckpointTransport(
        tmp_path, replica_id="c", state_dict=lambda: {"user": {"default": {"w": own}}}
    )
    got = healing.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=60))["user"]
    assert got["default"]["w"].device_mesh is mine and got["default"]["w"]._spec == sent._spec
    other = mesh_without_groups("cpu", [0, 2], ("dp",))
    elsewhere = DTensor.from_local(
        torch.zeros(2), other, [Shard(0)], run_check=False, shape=(4,), stride=(1,)
    )
    wrong = StorageCheckpointTransport(
        tmp_path, replica_id="d", state_dict=lambda: {"user": {"default": {"w": elsewhere}}}
    )
    with pytest.raises(UnsafeCheckpointError, match="mesh of ranks \\[0, 1\\].*\\[0, 2\\]"):
        wrong.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=60))
    for transport in (sender, without, healing, wrong):
        transport.shutdown()


def test_metadata_is_the_workers_own_directory(tmp_path: Path) -> None:
    transport = StorageCheckpointTransport(tmp_path, replica_id="train_0", group_rank=3)
    directory = str(tmp_path / "train_0" / "replica-3")
    assert transport.metadata() == f"{directory}#sender={transport.transport.sender_id}"
    transport.shutdown()
    with pytest.raises(ValueError, match="replica_id must be .* got 'a/b'"):
        StorageCheckpointTransport(tmp_path, replica_id="a/b")


def test_a_sender_cannot_point_the_receiver_outside_the_root(tmp_path: Path) -> None:
    # Before: recv_checkpoint read whatever location the sender's metadata named, with
    # the receiver's credentials (another run's checkpoint, another bucket), and the
    # healed worker sent that state on into the shared root at its next heal; and
    # replica_id '..' wrote and pruned the steps of root/../replica-<n>.
    storage.save({"secret": torch.arange(4.0)}, str(tmp_path / "private" / "replica-0" / "step-5"))
    receiver = StorageCheckpointTransport(tmp_path / "ft", replica_id="g1")
    sender = StorageCheckpointTransport(tmp_path / "ft", replica_id="g0")
    sender.send_checkpoint([1], 5, {"w": torch.ones(3)}, timedelta(seconds=60))
    hostile = [
        str(tmp_path / "private" / "replica-0"),
        str(tmp_path / "ft" / ".." / "private" / "replica-0"),
        str(tmp_path / "ft" / "g0" / "replica-0" / ".." / ".." / ".." / "private"),
        "s3://another-bucket/g0/replica-0",
        str(tmp_path / "ft" / "g0"),
        str(tmp_path / "ft" / "g0" / "replica-0"),  # no sender's id
        sender.metadata().replace("replica-0#", "#"),
    ]
    for url in hostile:
        with pytest.raises(UnsafeCheckpointError, match="not a worker's directory under"):
            receiver.recv_checkpoint(0, url, 5, timedelta(seconds=1))
    got = receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=60))
    assert torch.equal(got["w"], torch.ones(3))
    for bad in ("..", ".", "a\\b", "a\nb"):
        with pytest.raises(ValueError, match="replica_id must be"):
            StorageCheckpointTransport(tmp_path / "ft", replica_id=bad)
    receiver.shutdown()
    sender.shutdown()


def test_a_restarted_worker_never_serves_the_step_its_previous_run_sent(tmp_path: Path) -> None:
    """A restarted group reuses its directory, where its earlier run's last send stays
    committed: after a rollback to an older checkpoint, a receiver told to heal from
    step 5 there found that run's step 5 and loaded it, before this run's send landed."""
    receiver = StorageCheckpointTransport(tmp_path, replica_id="g1", poll_interval=0.01)
    before = StorageCheckpointTransport(tmp_path, replica_id="g0")
    before.send_checkpoint([1], 5, {"w": torch.ones(3)}, timedelta(seconds=60))
    before.shutdown()
    after = StorageCheckpointTransport(tmp_path, replica_id="g0")  # the restart
    with pytest.raises(TimeoutError, match="timed out"):
        receiver.recv_checkpoint(0, after.metadata(), 5, timedelta(seconds=0.2))
    after.send_checkpoint([1], 5, {"w": torch.zeros(3)}, timedelta(seconds=60))
    got = receiver.recv_checkpoint(0, after.metadata(), 5, timedelta(seconds=60))
    assert torch.equal(got["w"], torch.zeros(3))
    after.shutdown()
    receiver.shutdown()


def test_a_step_another_job_sent_to_the_same_directory_is_refused(tmp_path: Path) -> None:
    # Before: two jobs given the same root and replica ids (torchft's examples name
    # groups "train_ddp_<n>") write the same step directories; a worker told to heal
    # from step 5 of its group loaded the other job's step 5 there, weights and all,
    # and trained on as if healed.
    ours = StorageCheckpointTransport(tmp_path, replica_id="g0")
    other_job = StorageCheckpointTransport(tmp_path, replica_id="g0")
    receiver = StorageCheckpointTransport(tmp_path, replica_id="g1")
    other_job.send_checkpoint([1], 5, {"w": torch.zeros(3)}, timedelta(seconds=60))
    with pytest.raises(IntegrityError, match="another sender .* replica 0 .* own root") as info:
        receiver.recv_checkpoint(0, ours.metadata(), 5, timedelta(seconds=60))
    assert "step-5" in str(info.value)
    ours.send_checkpoint([1], 5, {"w": torch.ones(3)}, timedelta(seconds=60))
    got = receiver.recv_checkpoint(0, ours.metadata(), 5, timedelta(seconds=60))
    assert torch.equal(got["w"], torch.ones(3)) and list(got) == ["w"]
    for transport in (ours, other_job, receiver):
        transport.shutdown()


def test_a_step_sent_again_while_it_is_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchft sends the same step again after a commit that failed (say, a heal that
    timed out): the healing worker's next receive started on the committed save, whose
    files went when the new one committed, and failed with a missing data file; each
    retry met the same race, and no group could commit again."""
    from storage.ops import transport as module

    sender = StorageCheckpointTransport(tmp_path, replica_id="a")
    receiver = StorageCheckpointTransport(tmp_path, replica_id="b")
    sender.send_checkpoint([1], 5, {"w": torch.ones(3)}, timedelta(seconds=60))
    sent_again: list[int] = []

    class SendAgainOnce(module.PlainDataPlanner):
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)  # the metadata is read, the data not
            if not sent_again:
                sent_again.append(5)
                sender.send_checkpoint([1], 5, {"w": torch.ones(3)}, timedelta(seconds=60))

    monkeypatch.setattr(module, "PlainDataPlanner", SendAgainOnce)
    got = receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=60))
    assert sent_again and torch.equal(got["w"], torch.ones(3))
    sender.shutdown()
    receiver.shutdown()


def test_shutdown_ends_a_receive_waiting_for_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchft's Manager.shutdown shuts the transport down, then waits for its quorum
    thread: a receive polling for a step that never comes kept it (and the process's
    exit) waiting out the whole heal timeout."""
    import threading

    from storage.ops import transport as module

    polling = threading.Event()

    def is_committed(fs: Any, path: str) -> bool:
        polling.set()
        return False

    monkeypatch.setattr(module, "is_committed", is_committed)
    receiver = StorageCheckpointTransport(tmp_path, replica_id="b")
    outcome: list[BaseException] = []

    def receive() -> None:
        try:
            sender = f"{tmp_path}/a/replica-0#sender={'0' * 32}"
            receiver.recv_checkpoint(0, sender, 5, timedelta(hours=1))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    assert polling.wait(60)
    receiver.shutdown(wait=False)
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], RuntimeError) and "shut down while it waited" in str(outcome[0])


# --- healing: lighthouse, two replica groups, one killed and restarted ------------------

REPLICA = Path(__file__).with_name("_torchft_replica.py")
DEADLINE = 240.0  # every process stops by itself after this


def _start(job: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    log = open(job["out"] + ".log", "wb")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(
        [sys.executable, str(REPLICA), json.dumps({"deadline": DEADLINE, **job})],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _wait_for(path: Path, procs: list[subprocess.Popen[bytes]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None and not path.exists():
                log = Path(str(path).rsplit(".", 1)[0] + ".log")
                raise AssertionError(f"{what}: a replica exited ({proc.returncode}): {_logs(log)}")
        assert time.monotonic() < deadline, f"{what}: nothing after {DEADLINE:g} s"
        time.sleep(0.05)  # polling a file, not a synchronization window


def _logs(*paths: Path) -> str:
    return "\n".join(
        f"--- {p}\n{p.read_text(errors='replace')[-4000:]}" for p in paths if p.exists()
    )


def _bits(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _bits(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _bits(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_killed_group_heals_through_storage_and_stays_bit_exact(
    tmp_path: Path, where: str, request: Any
) -> None:
    """Groups a and b train in lockstep (min_replica_size=2); b is killed with SIGKILL
    after committing step 3 and restarted from a different initialisation; it heals from
    a's step-3 checkpoint written through our transport (on local disk, or in a bucket on
    SeaweedFS), and both end at step 6 with the same weights, optimizer state and step,
    bit for bit."""
    from torchft._torchft import LighthouseServer

    if where == "bucket":
        request.param = "seaweedfs"
        options: dict[str, Any] | None = s3_options(endpoint_with_bucket(request, BUCKET))
        root = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/ft"
    else:
        options, root = None, str(tmp_path / "ft")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=2000)
    common = {
        "lighthouse": lighthouse.address(),
        "root": root,
        "storage_options": options,
        "steps": 6,
    }
    a = {**common, "replica_id": "a", "batch": 0, "seed": 1, "out": str(tmp_path / "a.pt")}
    b1 = {**common, "replica_id": "b", "batch": 1, "seed": 2, "out": str(tmp_path / "b1.pt")}
    b2 = {**b1, "seed": 3, "out": str(tmp_path / "b2.pt")}
    procs = [_start(a), _start({**b1, "park_at": 3})]
    try:
        _wait_for(tmp_path / "b1.pt.parked", procs, "b reaching step 3")
        procs[1].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=60) == -signal.SIGKILL
        procs.append(_start(b2))
        live = [procs[0], procs[2]]
        _wait_for(tmp_path / "a.pt", live, "a finishing")
        _wait_for(tmp_path / "b2.pt", live, "b finishing after its restart")
    except BaseException:
        print(_logs(*(tmp_path / f"{n}.pt.log" for n in ("a", "b1", "b2"))))
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
        lighthouse.shutdown()
    first, healed = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b2.pt")
    assert first["step"] == healed["step"] == 6
    assert healed["healed_at"] == 3  # b's first quorum after the restart took a's step 3
    _bits(first, {**healed, "healed_at": first["healed_at"]})
    read = f"{root}/a/replica-0/step-3"  # what b read
    assert storage.filesystem_from_url(read, options)[0].exists(f"{read}/.metadata")
