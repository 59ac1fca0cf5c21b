"""StorageTransport: a replica sends its state through storage, another receives it
bit for bit (two spawned processes); timeouts, disallow and shutdown."""

from __future__ import annotations

import os
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.zstd import ZStandard
from storage.ops.transport import SHAPE_KEY
from tests.checkpoint.test_thread_staging import wait_exit
from tests.support.distributed import process, queue

STEP = 7


def _replica_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -3.5])
    return {
        "model": {
            "w": torch.randn(64, 48, generator=gen),
            "w_bf16": torch.randn(33, 7, generator=gen).to(torch.bfloat16),
            "half": torch.cat([special, torch.randn(11, generator=gen)]).to(torch.float16),
            "special": special,
            "mask": torch.rand(100, generator=gen) > 0.5,
            "ids": torch.randint(-(2**62), 2**62, (50,), generator=gen),
            "int8": torch.randint(-128, 127, (9, 9), dtype=torch.int8, generator=gen),
        },
        "optim": {"lr": 0.25, "betas": [0.9, 0.95], "name": "adamw", "step": seed},
    }


def _bits_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_bits_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bits_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


# --- two processes --------------------------------------------------------------------


def _sender(root: str, meta_q: Any, result_q: Any) -> None:
    try:
        transport = storage.StorageTransport(root, rank=0, transforms=[ZStandard(level=1)])
        meta_q.put(transport.metadata())
        state = _replica_state(STEP)
        transport.send_checkpoint([1], STEP, state, timedelta(seconds=120))
        transport.disallow_checkpoint()
        state["model"]["w"].zero_()  # allowed now: the receiver must not see this
        transport.shutdown()
        result_q.put(("sender", "ok"))
    except BaseException:
        result_q.put(("sender", traceback.format_exc()))


def _receiver(meta_q: Any, result_q: Any) -> None:
    try:
        transport = storage.StorageTransport(meta_q.get(timeout=120), rank=1)
        metadata = meta_q.get(timeout=120)
        got = transport.recv_checkpoint(0, metadata, STEP, timedelta(seconds=120))
        ok = _bits_equal(_replica_state(STEP), got)
        result_q.put(("receiver", "ok" if ok else f"state differs: {got!r}"))
        transport.shutdown()
    except BaseException:
        result_q.put(("receiver", traceback.format_exc()))


def test_two_processes_bit_exact(tmp_path: Path) -> None:
    root = str(tmp_path / "ft")
    to_receiver, from_sender, results = queue(), queue(), queue()
    to_receiver.put(root)
    receiver = process(_receiver, (to_receiver, results))
    receiver.start()  # polls before anything is written
    sender = process(_sender, (root, from_sender, results))
    sender.start()
    to_receiver.put(from_sender.get(timeout=120))
    outcome = dict(results.get(timeout=240) for _ in range(2))
    for proc in (sender, receiver):
        proc.join(timeout=60)
    assert outcome == {"sender": "ok", "receiver": "ok"}, outcome
    assert (tmp_path / "ft" / "replica-0" / f"step-{STEP}" / ".metadata").exists()


# --- in one process -------------------------------------------------------------------


class _GatedMemory(storage.MemoryFileSystem):
    """Data-file writes wait until ``gate`` is set: a save that cannot finish yet."""

    gate = threading.Event()

    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Any:
        if mode == "wb":
            assert self.gate.wait(timeout=60), "gate never opened"
        return super().create_stream(path, mode, sync=sync)


def test_send_timeout_then_disallow_waits(tmp_path: Path) -> None:
    fs = _GatedMemory()
    fs.gate.clear()
    sender = storage.StorageTransport("dcpmem://b/ft", rank=0, filesystem=fs)
    receiver = storage.StorageTransport("dcpmem://b/ft", rank=1, filesystem=fs)
    state = _replica_state(3)
    expected = _replica_state(3)
    with pytest.raises(TimeoutError, match=r"timed out after .*replica-0/step-3 is not committed"):
        sender.send_checkpoint([1], 3, state, timedelta(seconds=0.2))
    threading.Timer(0.3, fs.gate.set).start()
    sender.disallow_checkpoint()  # returns only once the write is done
    assert fs.exists("b/ft/replica-0/step-3/.metadata")
    state["model"]["w"].fill_(1.0)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=5))
    assert _bits_equal(expected, got)


def test_recv_times_out_naming_the_location(tmp_path: Path) -> None:
    transport = storage.StorageTransport(str(tmp_path), rank=1, poll_interval=0.01)
    with pytest.raises(TimeoutError, match=r"step 4 from replica 0 timed out .*replica-0/step-4"):
        transport.recv_checkpoint(0, transport.metadata(), 4, timedelta(seconds=0.2))
    # An interrupted save (no metadata) is not a checkpoint either.
    (tmp_path / "replica-0" / "step-4").mkdir(parents=True)
    (tmp_path / "replica-0" / "step-4" / "__0_0-x.distcp").write_bytes(b"partial")
    with pytest.raises(TimeoutError):
        transport.recv_checkpoint(0, transport.metadata(), 4, timedelta(seconds=0.1))


def test_timeouts_say_they_timed_out(tmp_path: Path) -> None:
    """torchft tells a transport's timeout from other failures by its message (it matches
    "timed out"/"timeout"); ours used to say "was not committed within" and "no
    checkpoint ... after", so torchft took a slow peer for a broken one."""
    fs = _GatedMemory()
    fs.gate.clear()
    sender = storage.StorageTransport("dcpmem://b/ft", rank=0, filesystem=fs)
    try:
        with pytest.raises(TimeoutError, match="timed out"):
            sender.send_checkpoint([1], 5, _replica_state(5), timedelta(seconds=0.1))
    finally:
        fs.gate.set()
        sender.shutdown()
    receiver = storage.StorageTransport(str(tmp_path), rank=1, poll_interval=0.01)
    with pytest.raises(TimeoutError, match="timed out"):
        receiver.recv_checkpoint(0, receiver.metadata(), 5, timedelta(seconds=0.01))
    with pytest.raises(TimeoutError, match="timed out"):
        receiver.recv_replica(receiver.metadata(), 5, timedelta(seconds=0.01))


def test_recv_replica_reads_the_senders_own_directory(tmp_path: Path) -> None:
    """A sender's ``replica_url`` names its step directories without the receiver
    knowing its rank (torchft's replica ranks change from one quorum to the next)."""
    sender = storage.StorageTransport(str(tmp_path / "a"), rank=4)
    receiver = storage.StorageTransport(str(tmp_path / "b"), rank=0)
    sender.send_checkpoint([0], 2, _replica_state(2), timedelta(seconds=60))
    got = receiver.recv_replica(sender.replica_url(), 2, timedelta(seconds=60), src_rank=1)
    assert _bits_equal(_replica_state(2), got)
    assert sender.replica_url().endswith("replica-4")


def test_a_forked_child_sends_with_a_transport_made_in_the_parent(tmp_path: Path) -> None:
    """The parent's send thread is not in a child made with ``fork``: a send there went
    to the parent's pool, never ran and timed out (and ``disallow_checkpoint`` waited on
    it for ever)."""
    transport = storage.StorageTransport(str(tmp_path), rank=0)
    transport.send_checkpoint([1], 1, _replica_state(1), timedelta(seconds=60))
    pid = os.fork()
    if pid == 0:  # the child: sends and receives its own step
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            transport.send_checkpoint([1], 2, _replica_state(2), timedelta(seconds=60))
            transport.disallow_checkpoint()
            got = transport.recv_checkpoint(0, transport.metadata(), 2, timedelta(seconds=60))
            code = 0 if _bits_equal(_replica_state(2), got) else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert wait_exit(pid, timeout=120) == 0
    transport.send_checkpoint([1], 3, _replica_state(3), timedelta(seconds=60))  # still sends


def test_an_optimizer_state_dict_comes_back_as_it_was_sent(tmp_path: Path) -> None:
    """DCP's flattening turns keys into strings and drops empty containers: an
    optimizer's state used to come back keyed "0", "1", ... (load_state_dict then kept
    none of it) and, before the first step, without its "state" entry at all (KeyError)."""
    model = torch.nn.Linear(3, 2)
    fresh = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    stepped = torch.optim.AdamW(model.parameters())
    stepped.step()
    sent = {
        "fresh": fresh.state_dict(),
        "stepped": stepped.state_dict(),
        "nested": {"empty": {}, "none": [], "mixed": [{"a": torch.ones(2)}, {}], "t": (1, 2)},
    }
    transport = storage.StorageTransport(str(tmp_path), rank=0)
    transport.send_checkpoint([1], 1, sent, timedelta(seconds=60))
    got = transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=60))
    assert _bits_equal(sent, got)
    assert list(got["stepped"]["state"]) == [0, 1] and got["fresh"]["state"] == {}
    restored = torch.optim.AdamW(model.parameters())
    restored.load_state_dict(got["stepped"])
    assert _bits_equal(restored.state_dict(), stepped.state_dict())
    with pytest.raises(ValueError, match="reserves; rename that key"):
        transport.send_checkpoint([1], 2, {SHAPE_KEY: 1}, timedelta(seconds=60))


def test_keeps_last_steps_and_shutdown(tmp_path: Path) -> None:
    sender = storage.StorageTransport(str(tmp_path), rank=2, keep_last=2)
    for step in (1, 2, 3):
        sender.send_checkpoint([0], step, _replica_state(step), timedelta(seconds=60))
    replica = sorted(p.name for p in (tmp_path / "replica-2").iterdir())
    assert replica == [".dcp-latest", "step-2", "step-3"]  # and the pointer at the newest
    got = sender.recv_checkpoint(2, sender.metadata(), 3, timedelta(seconds=5))
    assert got["optim"] == {"lr": 0.25, "betas": [0.9, 0.95], "name": "adamw", "step": 3}
    sender.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        sender.send_checkpoint([0], 4, _replica_state(4), timedelta(seconds=1))


def test_refuses_objects_that_are_not_plain_data(tmp_path: Path) -> None:
    transport = storage.StorageTransport(str(tmp_path), rank=0)
    state = {"w": torch.ones(3), "when": timedelta(seconds=5)}  # pickles, but is not plain data
    transport.send_checkpoint([1], 1, state, timedelta(seconds=60))
    with pytest.raises(Exception, match="not plain data"):
        transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))


def _sent_metadata(tmp_path: Path) -> tuple[storage.StorageTransport, Path, Any]:
    import pickle

    transport = storage.StorageTransport(str(tmp_path), rank=0)
    state = {"model": {"w": torch.ones(4), "layers": [torch.ones(2)]}}
    transport.send_checkpoint([1], 1, state, timedelta(seconds=60))
    path = tmp_path / "replica-0" / "step-1" / ".metadata"
    return transport, path, pickle.loads(path.read_bytes())  # the test's own file


def test_a_planner_data_index_claiming_a_huge_list_is_refused(tmp_path: Path) -> None:
    """torch's set_element grows a list to a path's index one None at a time: an index
    of 10**9 in the sender's metadata made the receiver append for minutes and hold
    8 GB (here 2**25: a quarter GiB) before anything was read."""
    import pickle

    from extensions.errors import UnsafeCheckpointError

    transport, path, metadata = _sent_metadata(tmp_path)
    metadata.planner_data["model.layers.0"] = ("model", "layers", 1 << 25)
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="'model.layers.0'.*planner_data path"):
        transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))


def test_a_tensor_claiming_more_than_it_stores_is_refused_naming_it(tmp_path: Path) -> None:
    """The receiver allocates every tensor the metadata lists: a 16-byte item claiming
    2**42 elements failed with torch's unnamed "can't allocate memory" (or, smaller, was
    lazily mapped and touched)."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    from extensions.errors import IntegrityError

    transport, path, metadata = _sent_metadata(tmp_path)
    big = torch.Size([1 << 42])
    props = metadata.state_dict_metadata["model.w"].properties
    chunk = ChunkStorageMetadata(torch.Size([0]), big)
    metadata.state_dict_metadata["model.w"] = TensorStorageMetadata(props, big, [chunk])
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(IntegrityError, match="'model.w' claims 4398046511104 elements"):
        transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))


@pytest.mark.parametrize(
    "shape",
    [("x", []), ("d", [1]), ("d", "ab"), ("l", 5), "d", "nested", "shared"],
    ids=["kind", "entry", "children", "list", "text", "deep", "shared"],
)
def test_a_malformed_shape_record_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: Any
) -> None:
    """The record of the state's containers is the sender's: a hostile or damaged one
    failed with an unnamed ValueError or TypeError, and one nested a few hundred levels
    deep recursed until Python's limit. A shared one ("shared": 40 levels of
    ("l", [x, x]), 4 KiB stored) unfolded into 2**40 containers: the receiver hung,
    its memory growing, until it was killed."""
    from extensions.errors import UnsafeCheckpointError
    from storage.ops import transport as module

    if shape == "nested":
        shape = None
        for _ in range(200):  # within the sender's pickler's own recursion limit
            shape = ("l", [shape])
    if shape == "shared":
        shape = None
        for _ in range(40):
            shape = ("l", [shape, shape])
    monkeypatch.setattr(module, "record", lambda value, path: shape)  # a sender that lies
    transport = storage.StorageTransport(str(tmp_path), rank=0)
    transport.send_checkpoint([1], 1, {"w": torch.ones(2)}, timedelta(seconds=60))
    monkeypatch.undo()
    with pytest.raises(UnsafeCheckpointError, match=f"{SHAPE_KEY}.*malformed, nests deeper"):
        transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))


@pytest.mark.parametrize(
    "layout",
    [
        ["cpu", [0], None, [["S", 0]], [4], [1], "extra"],
        ["cpu", [0, [1]], None, [["S", 0]], [4], [1]],
        ["cpu", [[0, 1]], None, [["S", 0]], [4], [1]],
        ["cpu", [0], None, [["X", 0]], [4], [1]],
        ["../x", [0], None, [["S", 0]], [4], [1]],
        ["cpu", [0], None, [["S", 5]], [4], [1]],
    ],
    ids=["arity", "ragged", "placements", "placement", "device", "dim"],
)
def test_a_malformed_dtensor_layout_is_refused_naming_the_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: list[Any]
) -> None:
    """A DTensor's layout record is the sender's: one that is malformed, or names a
    mesh or placement this process cannot build, is refused naming the item."""
    import torch.distributed as dist

    from extensions.errors import UnsafeCheckpointError
    from storage.ops import transport as module

    monkeypatch.setattr(module, "record", lambda value, path: ("d", [("w", ("t", layout))]))
    transport = storage.StorageTransport(str(tmp_path), rank=0)
    transport.send_checkpoint([1], 1, {"w": torch.ones(4)}, timedelta(seconds=60))
    monkeypatch.undo()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(UnsafeCheckpointError, match="item 'w'.*DTensor"):
            transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=5))
    finally:
        dist.destroy_process_group()
