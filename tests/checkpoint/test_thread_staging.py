"""Staging buffers kept between asynchronous saves that persist in threads by default
(``persist=None`` where the training processes fill the cores): reused while free, a
fresh copy while the previous save still writes from them, freed by every save that
ends, failed or not, and none of it for ``persist="thread"`` named."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import extensions
import storage
from storage.checkpoint import persist, staging
from tests.checkpoint.test_worker import Gate, Refuses, _Passthrough, big_state, loaded, wait_for
from tests.support.trees import assert_tree_equal


class RecordsPid(Gate):
    """Identity on the bytes; writes the pid of the process that encodes into ``dir/pid``."""

    @staticmethod
    def registry_name() -> str:
        return "test.records-pid"

    @staticmethod
    def from_descriptor(version: str) -> RecordsPid:
        return RecordsPid()

    def get_descriptor(self) -> str:
        return "test.records-pid/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        Path(self.gate_dir, "pid").write_text(str(os.getpid()))
        return _Passthrough(output)  # type: ignore[return-value]


extensions.register(RecordsPid)


@pytest.fixture
def cores_full(monkeypatch: pytest.MonkeyPatch) -> staging.LocalStaging:
    """As many training processes on this host as cores (torchrun's LOCAL_WORLD_SIZE),
    so the default persists in threads; the process's buffers, free."""
    if staging.local_staging() is None:
        pytest.skip("torch < 2.8 has no StateDictStager")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(persist.usable_cpus()))
    assert persist.default_mode() == "thread"
    local = staging.local_staging()
    assert local is not None and local._free.is_set()
    return local


def staged_pointer(local: staging.LocalStaging, state: dict[str, Any]) -> tuple[int, Any]:
    staged, lease = local.stage(state)
    assert torch.equal(staged["w"], state["w"])
    return staged["w"].data_ptr(), lease


def test_a_free_buffer_is_reused_and_a_held_one_is_not_overwritten(
    cores_full: staging.LocalStaging,
) -> None:
    state = big_state()
    first, lease = staged_pointer(cores_full, state)
    assert lease is not None
    held, none = staged_pointer(cores_full, state)  # the first still holds its buffers
    assert none is None and held != first
    lease.release()
    again, lease = staged_pointer(cores_full, state)
    assert again == first  # the same buffers, refreshed
    lease.release()


def test_successive_saves_write_each_its_own_state(
    tmp_path: Path, cores_full: staging.LocalStaging
) -> None:
    state = big_state()
    first = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    storage.async_save(state, tmp_path / "1", transforms=[RecordsPid(str(tmp_path))]).result()
    assert (tmp_path / "pid").read_text() == str(os.getpid())  # written here, in a thread
    assert cores_full._free.is_set()  # the save is done with its buffers
    state["w"].add_(1.0)  # trained in place
    storage.async_save(state, tmp_path / "2").result()
    assert_tree_equal(first, loaded(tmp_path / "1", first))
    assert_tree_equal(state, loaded(tmp_path / "2", state))


def test_a_save_while_the_previous_writes_copies_afresh_without_waiting(
    tmp_path: Path, cores_full: staging.LocalStaging
) -> None:
    state = big_state()
    first = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    gate = tmp_path / "gate"
    gate.mkdir()
    fut1 = storage.async_save(state, tmp_path / "1", transforms=[Gate(str(gate))])
    try:
        wait_for(gate / "started")  # the first save writes from the kept buffers now
        state["w"].add_(1.0)
        second: list[Any] = []
        saver = threading.Thread(
            target=lambda: second.append(storage.async_save(state, tmp_path / "2"))
        )
        saver.start()
        saver.join(120)  # bounded: a save that waited for the gate would hang here
        assert not saver.is_alive(), "the second save waited for the first one's buffers"
        second[0].result(timeout=120)
    finally:
        (gate / "open").touch()
    fut1.result(timeout=120)
    assert_tree_equal(first, loaded(tmp_path / "1", first))
    assert_tree_equal(state, loaded(tmp_path / "2", state))
    assert cores_full._free.is_set()


def test_a_failed_save_frees_the_buffers(tmp_path: Path, cores_full: staging.LocalStaging) -> None:
    state = big_state()
    with pytest.raises(Exception, match="refuses every item"):
        storage.async_save(state, tmp_path / "bad", transforms=[Refuses()]).result(timeout=120)
    assert cores_full._free.is_set()
    assert not (tmp_path / "bad" / ".metadata").exists()
    first, lease = staged_pointer(cores_full, state)
    assert lease is not None
    lease.release()


def test_thread_mode_by_name_keeps_no_buffers(
    tmp_path: Path, cores_full: staging.LocalStaging
) -> None:
    writer = storage.CheckpointWriter(tmp_path / "a", persist="thread")
    state = big_state()
    writer.stage(state)
    assert writer._lease is None and cores_full._free.is_set()
    writer.close()


def wait_exit(pid: int, timeout: float) -> int:
    """The exit code of child ``pid``; killed (and failed) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child {pid} did not exit within {timeout} s")


def test_a_forked_child_starts_without_the_parents_buffers(
    cores_full: staging.LocalStaging,
) -> None:
    _, lease = staged_pointer(cores_full, big_state())  # held while the child forks
    try:
        pid = os.fork()
        if pid == 0:  # the child: its own, free buffers
            code = 1
            try:
                torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
                local = staging.local_staging()
                if local is None or local is cores_full:
                    code = 2
                else:
                    _, child_lease = staged_pointer(local, big_state(1))
                    code = 0 if child_lease is not None else 3
            finally:
                os._exit(code)
        assert wait_exit(pid, timeout=120) == 0
    finally:
        assert lease is not None
        lease.release()


def test_a_tensor_resized_in_place_between_saves_is_staged_whole(
    tmp_path: Path, cores_full: staging.LocalStaging
) -> None:
    """torch's storage cache raised an AssertionError for a storage resized in place
    since the save before (``resize_`` keeps the storage object)."""
    state = big_state()
    storage.async_save(state, tmp_path / "1").result()
    state["w"].resize_(512, 256).normal_()  # grows its storage in place
    storage.async_save(state, tmp_path / "2").result()
    assert_tree_equal(state, loaded(tmp_path / "2", state))
    assert cores_full._free.is_set()


def test_a_writer_s_cached_buffers_take_a_tensor_resized_in_place(tmp_path: Path) -> None:
    """The same with ``cache_staged_state_dict`` (the writer keeps its own buffers): the
    second save raised torch's AssertionError."""
    state = big_state()
    writer = storage.CheckpointWriter(
        tmp_path / "1", persist="thread", cache_staged_state_dict=True
    )
    dcp.async_save(state, storage_writer=writer).result()
    state["w"].resize_(512, 256).normal_()
    dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / "2").result()
    assert_tree_equal(state, loaded(tmp_path / "2", state))


def test_buffers_of_cpu_tensors_are_not_pinned_on_a_cuda_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CUDA host the kept buffers of CUDA tensors are page-locked, those of CPU
    tensors not: nothing copies them to or from a device, and torch's stager, which
    pins every buffer, locked host memory for nothing and made a CUDA context in a
    process that may use none. CUDA is reported present, torch's pinning recorded.
    (Buffers whose pinning CUDA refuses: tests/checkpoint/test_cuda_staging.py.)"""
    import torch.cuda._pin_memory_utils as pin_memory_utils

    pinned: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pin_memory_utils, "pin_memory", lambda address, n: pinned.append(n))
    state = big_state()
    staged, lease = staging.LocalStaging().stage(state)
    assert lease is not None and torch.equal(staged["w"], state["w"])
    lease.release()
    cached = storage.CheckpointWriter(tmp_path, persist="thread", cache_staged_state_dict=True)
    assert torch.equal(cached.stage(state)["w"], state["w"])  # type: ignore[index]
    cached.close()
    assert pinned == []
