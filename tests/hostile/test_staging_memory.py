"""The persist worker's staging buffers in ``/dev/shm`` against its neighbours: another
user on the host, a job in another PID namespace sharing ``/dev/shm``, a child made with
``fork``, and a training process killed with ``kill -9``.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from extensions.errors import CheckpointStorageError
from storage.checkpoint.persist import _pool, _shm

ROOT = Path(__file__).resolve().parents[2]
BIG = {"w": torch.ones(256, 256)}  # 256 KiB: staged in a segment, not by value


def _listing(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(_shm.shm_dir()) if n.startswith(prefix))


def _run(script: str, *args: str, timeout: float = 180, **kwargs: object) -> str:
    """Run ``script`` in a fresh interpreter from the repository; returns its stdout and
    fails with everything it printed when it does not exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        **kwargs,  # type: ignore[call-overload]
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _nobody() -> int:
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second user")
    return pwd.getpwnam("nobody").pw_uid


def _plant(name: str, owner: int) -> Path:
    """A file in the shared-memory directory, owned by ``owner``, mode 0600."""
    path = Path(_shm.shm_dir(), name)
    path.write_bytes(b"not yours")
    os.chown(path, owner, owner)
    path.chmod(0o600)
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_names_taken_in_advance_by_another_user_are_skipped() -> None:
    """Before, segments were named ``dcp-storage-UID-PID-N``: another user who created
    those names first made every save of this process fail with a raw FileExistsError."""
    other = _nobody()
    planted = [_plant(f"dcp-storage-{os.getuid()}-{os.getpid()}-{n}", other) for n in range(16)]
    pool = _pool.StagingPool()
    try:
        staged, _ = pool.stage(BIG)
        assert torch.equal(staged["w"], BIG["w"])
        where = pool.locate(staged["w"])
        assert where is not None and where[0].startswith(pool.name)
        assert all(p.read_bytes() == b"not yours" for p in planted)  # nor touched
    finally:
        pool.close()
        for p in planted:
            p.unlink()


def test_a_random_name_that_is_taken_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone who lists the directory sees a pool's name and may create its next
    segment's name first: the segment takes another name instead of failing."""
    pool = _pool.StagingPool()
    try:
        tokens = iter(["00" * 8, "11" * 8])
        taken = Path(_shm.shm_dir(), f"{pool.name}-{'00' * 8}")
        taken.write_bytes(b"squatter")
        monkeypatch.setattr(_shm.secrets, "token_hex", lambda n: next(tokens))
        staged, _ = pool.stage(BIG)
        assert pool.locate(staged["w"]) == (f"{pool.name}-{'11' * 8}", 0)
        assert taken.read_bytes() == b"squatter"
        taken.unlink()
    finally:
        pool.close()


def test_another_users_file_named_like_a_dead_process_of_ours_is_left_alone(
    tmp_path: Path,
) -> None:
    """Before, the sweep of dead processes' segments unlinked any file named like one of
    this user's: as that user it got EPERM (sticky ``/dev/shm``; only FileNotFoundError
    was caught) and every ``persist="process"`` save failed - the asynchronous default;
    as root it deleted the other user's file. It now judges only files this user owns."""
    other = _nobody()
    planted = _plant(f"dcp-storage-{os.getuid()}-{_dead_pid()}-0", owner=other)
    try:
        assert _run(_SAVE, str(tmp_path / "ckpt")).split() == ["saved"]
        assert planted.read_bytes() == b"not yours"
    finally:
        planted.unlink()


_SAVE = """
import sys, torch, storage
storage.async_save({"w": torch.ones(256, 256)}, sys.argv[1], persist="process").result()
print("saved")
"""


_SWEEP = """
from storage.checkpoint.persist import _shm
print(" ".join(_shm.sweep()) or "-")
"""


def test_a_live_pool_is_not_swept_from_another_pid_namespace() -> None:
    """A job in another PID namespace sharing ``/dev/shm`` (``--ipc=host``) cannot see
    this process's pid. Before, the sweep took "no such pid" for "dead" and deleted the
    segments of a live trainer, losing its saves in flight; ownership is now a lock the
    owner holds, which the kernel keeps across namespaces."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    pool = _pool.StagingPool()
    try:
        staged, _ = pool.stage(BIG)
        before = _listing(pool.name)
        assert len(before) == 2  # the lock file and one segment
        argv = ["unshare", "--pid", "--fork", sys.executable, "-c", _SWEEP]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert pool.name not in proc.stdout
        assert _listing(pool.name) == before
        assert torch.equal(pool.stage(BIG)[0]["w"], staged["w"])
    finally:
        pool.close()
    assert _listing(pool.name) == []


_FORK = """
import os, sys, torch, storage
from storage.checkpoint import persist
torch.set_num_threads(1)  # as in DataLoader workers: OpenMP's pool does not survive fork
state = {"w": torch.ones(256, 256)}
storage.async_save(state, sys.argv[1] + "/1", persist="process").result()
pool = persist.worker().pool
before = sorted(n for n in os.listdir("/dev/shm") if n.startswith(pool.name))
child = os.fork()
if child == 0:
    # A DataLoader worker or a helper: it saves something of its own, then exits
    # normally, running the atexit hooks it inherited.
    storage.save({"c": torch.zeros(256, 256)}, sys.argv[1] + "/child")
    sys.exit(0)
_, status = os.waitpid(child, 0)
assert status == 0, status
after = sorted(n for n in os.listdir("/dev/shm") if n.startswith(pool.name))
assert after == before, (before, after)
state["w"] += 1
storage.async_save(state, sys.argv[1] + "/2", persist="process").result()
print("ok")
"""


def test_a_forked_child_that_exits_leaves_its_parents_buffers_alone(tmp_path: Path) -> None:
    """Before, a child made with ``os.fork`` ran the inherited atexit hook when it exited
    and unlinked its parent's live segments; the parent's next save failed with a raw
    FileNotFoundError. A child's own save starts its own worker and buffers."""
    if _shm.shm_dir() != "/dev/shm":
        pytest.skip("no /dev/shm")
    assert _run(_FORK, str(tmp_path)).split() == ["ok"]
    loaded = {"w": torch.zeros(256, 256)}
    import storage

    storage.load(loaded, tmp_path / "2")
    assert torch.equal(loaded["w"], torch.full((256, 256), 2.0))


_FORK_WHILE_LOCATING = """
import os, sys, threading, time, torch
from storage.checkpoint.persist import _pool
torch.set_num_threads(1)  # as in DataLoader workers: OpenMP's pool does not survive fork
pool = _pool.StagingPool()
pool.stage({"w": torch.ones(256, 256)})
held, done = threading.Event(), threading.Event()
def locating():  # DCP's save thread, finding a staged tensor's segment (pool.locate)
    with pool._lock:
        held.set()
        done.wait()
thread = threading.Thread(target=locating)
thread.start()
held.wait()
child = os.fork()
if child == 0:
    sys.exit(0)  # runs the atexit hooks it inherited: they close the pool
done.set()
thread.join()
deadline = time.monotonic() + 60  # bounds a failure only
while True:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        break
    if time.monotonic() > deadline:
        os.kill(child, 9)
        sys.exit("the child hung at exit")
    time.sleep(0.05)
assert status == 0, status
pool.close()
print("ok")
"""


def test_a_child_forked_while_a_save_thread_holds_the_pool_exits(tmp_path: Path) -> None:
    """The training thread forks (DataLoader workers for the next epoch) while DCP's save
    thread holds the pool's lock, locating the tensors it hands to the worker. Before,
    the child inherited the lock held, with no thread to release it, and its exit hung
    for ever in the atexit hook closing the pool."""
    assert _run(_FORK_WHILE_LOCATING).split() == ["ok"]


_SAVER = """
import os, signal, sys, torch, storage
from storage.checkpoint import persist
storage.async_save({"w": torch.ones(256, 256)}, sys.argv[1], persist="process").result()
worker = persist.worker()
print(worker.pid, worker.pool.name, flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
if sys.argv[2] == "kill both":
    os.kill(worker.pid, signal.SIGKILL)
    try:
        os.waitpid(worker.pid, 0)
    except ChildProcessError:
        pass  # the handle's reader thread reaped it first
os.kill(os.getpid(), signal.SIGKILL)
"""


def _run_saver(tmp_path: Path, how: str) -> tuple[int, str]:
    """A training process that saves once, then exits or is killed; its worker's pid
    and its pool's name."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SAVER), str(tmp_path / "ckpt"), how],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    expected = 0 if how == "exit" else -signal.SIGKILL
    assert proc.returncode == expected, f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    fields = proc.stdout.split()
    assert len(fields) == 2, f"the saver printed {proc.stdout!r}\n{proc.stderr}"
    return int(fields[0]), fields[1]


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _empty(prefix: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while _listing(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _listing(prefix)


def test_buffers_are_removed_at_exit_and_the_worker_stops(tmp_path: Path) -> None:
    worker_pid, pool = _run_saver(tmp_path, "exit")
    assert _listing(pool) == []
    assert _gone(worker_pid)


def test_a_killed_trainers_buffers_are_removed_by_its_worker(tmp_path: Path) -> None:
    """Before, ``kill -9`` of a training process left its segments (144 MB in one test)
    until the next process of the user staged, and for good if none did: the worker,
    which sees the death, now removes them before it exits."""
    worker_pid, pool = _run_saver(tmp_path, "kill")
    assert _gone(worker_pid)
    assert _empty(pool), _listing(pool)


def test_buffers_left_by_a_killed_trainer_and_worker_are_removed_by_the_next_pool(
    tmp_path: Path,
) -> None:
    worker_pid, pool = _run_saver(tmp_path, "kill both")
    assert _gone(worker_pid)
    _pool.StagingPool().close()  # nobody was left to remove them: the next pool does
    assert _listing(pool) == []


_MANAGER_ONLY = """
import os, sys, torch, storage
from storage.checkpoint import persist
torch.set_num_threads(1)  # as in DataLoader workers: OpenMP's pool does not survive fork
mgr = storage.CheckpointManager(sys.argv[1], persist="process")
mgr.prepare({"w": torch.ones(256, 256)})
worker = persist.worker()
child = os.fork()
if child == 0:
    # The parent's worker and buffers are not the child's: it has none until it saves.
    os._exit(0 if persist._worker is None else 3)
_, status = os.waitpid(child, 0)
assert status == 0, status
print(worker.pid, worker.pool.name, flush=True)
"""


def test_a_manager_that_never_saved_leaves_no_buffers_and_no_worker(tmp_path: Path) -> None:
    """A manager starts its worker and buffers when it is made: a process that exits
    without saving (and a child it forked, which inherits no live pool) must leave
    neither behind."""
    if _shm.shm_dir() != "/dev/shm":
        pytest.skip("no /dev/shm")
    out = _run(_MANAGER_ONLY, str(tmp_path / "root"))
    fields = out.split()
    assert len(fields) == 2, out
    assert _gone(int(fields[0]))
    assert _listing(fields[1]) == []


def test_a_segment_removed_from_under_the_pool_is_made_again() -> None:
    """Something else removed the pool's files (systemd-logind's RemoveIPC at logout, a
    cleaner of old files in /dev/shm, another pool's sweep once the lock file was
    gone). Before, the pool kept staging into the removed segment: a worker that had
    not mapped it yet (``prepare`` made it, or the worker restarted) failed every save
    from then on with a bare FileNotFoundError naming it."""
    from storage.checkpoint import persist

    handle = persist.Worker()
    try:
        state = {"w": torch.randn(256, 256)}
        handle.reserve(state)  # made and touched, never sent to the worker yet
        assert handle.pool is not None
        for name in _listing(handle.pool.name):
            os.unlink(Path(_shm.shm_dir(), name))
        staged, lease = handle.stage(state)
        try:
            assert handle.pool.live() and all(
                Path(_shm.shm_dir(), name).exists() for name in handle.pool.live()
            )
            ref = persist.item_ref(handle.pool, _tensor_item(), staged["w"])
            assert ref[0] == "shm"
            assert torch.equal(handle.call(_rebuilt, ref).result(timeout=120), state["w"])
        finally:
            lease.release()
    finally:
        handle.close()


def _tensor_item() -> object:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex("w"), type=WriteItemType.TENSOR)


def _rebuilt(ref: tuple[object, ...]) -> torch.Tensor:
    """The tensor the worker reads for ``ref``, copied out of the segment."""
    from storage.checkpoint.persist._child import rebuild

    data = rebuild(ref)
    assert isinstance(data, torch.Tensor)
    return data.clone()


def test_a_lock_file_removed_from_under_the_pool_is_made_again() -> None:
    """Only the lock file removed (a cleaner of old files: the lock is never written
    after it is made). Before, the next pool this user made (another job's) took the
    live pool for a dead one and removed its segments."""
    first = _pool.StagingPool()
    try:
        staged, _ = first.stage(BIG)
        os.unlink(Path(_shm.shm_dir(), f"{first.name}.lock"))
        staged, _ = first.stage(BIG)  # the next save's stage makes it again
        second = _pool.StagingPool()  # sweeps this user's dead pools first
        second.close()
        assert len(_listing(first.name)) == 2  # its segment and its lock file
        assert torch.equal(staged["w"], BIG["w"])
    finally:
        first.close()


def test_a_removed_segments_name_taken_by_another_user_is_not_read() -> None:
    """RemoveIPC (or a cleaner) removed the pool's files, and another user, who can list
    ``/dev/shm``, created a file under a segment's name. Before, the pool judged its
    segments by name only, kept staging into the removed one, and the worker mapped the
    other user's file by that name: the checkpoint held that user's bytes, under a
    checksum the worker computed over them."""
    other = _nobody()
    from storage.checkpoint import persist

    handle = persist.Worker()
    planted: list[Path] = []
    try:
        state = {"w": torch.randn(256, 256)}
        handle.reserve(state)  # made and touched, never sent to the worker yet
        assert handle.pool is not None
        names = _listing(handle.pool.name)
        for name in names:
            os.unlink(Path(_shm.shm_dir(), name))
        for name in names:
            if not name.endswith(".lock"):
                path = Path(_shm.shm_dir(), name)
                path.write_bytes(bytes(state["w"].nbytes))  # zeros, the size of the tensor
                os.chown(path, other, other)
                path.chmod(0o666)
                planted.append(path)
        staged, lease = handle.stage(state)
        try:
            ref = persist.item_ref(handle.pool, _tensor_item(), staged["w"])
            assert ref[0] == "shm" and Path(_shm.shm_dir(), ref[1]) not in planted
            assert torch.equal(handle.call(_rebuilt, ref).result(timeout=120), state["w"])
        finally:
            lease.release()
        assert all(p.read_bytes() == bytes(state["w"].nbytes) for p in planted)
    finally:
        handle.close()
        for p in planted:
            assert p.exists()  # another user's file: never removed
            p.unlink()


def test_the_worker_refuses_to_map_another_users_file() -> None:
    """The worker maps segments by the name the training process sends; a file of that
    name owned by another user (the segment was removed and the name taken in between)
    is refused with an error naming it, never read into a checkpoint."""
    other = _nobody()
    name = f"dcp-storage-{os.getuid()}-{os.getpid()}-{'ab' * 12}-{'cd' * 8}"
    path = _plant(name, other)
    try:
        path.chmod(0o666)
        with pytest.raises(CheckpointStorageError, match="not a staging segment of this user"):
            _shm.map_segment(name, (os.stat(path).st_ino, path.stat().st_size))
    finally:
        path.unlink()


def test_a_pool_never_removes_another_users_file_that_took_its_lock_files_name() -> None:
    """The lock file was removed (a cleaner) and another user created a file under its
    name. Before, closing the pool unlinked whatever held that name: as root, the other
    user's file."""
    other = _nobody()
    pool = _pool.StagingPool()
    planted = None
    try:
        os.unlink(Path(_shm.shm_dir(), f"{pool.name}.lock"))
        planted = _plant(f"{pool.name}.lock", other)
    finally:
        pool.close()
    assert planted is not None and planted.read_bytes() == b"not yours"
    planted.unlink()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_warming_the_worker_while_a_save_runs_freezes_none_of_its_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker freezes what it imported when a manager warms it; where a save is in
    flight meanwhile (a manager for another storage made during it), the save's objects
    must stay collectable: frozen, a cycle among them would never be freed."""
    import gc
    import weakref

    from storage.checkpoint.persist import _child

    in_flight = _Cycle()  # an object of the running save, in a reference cycle
    gone = weakref.ref(in_flight)
    monkeypatch.setattr(_child, "_calls_open", 2)  # the save's call and warm's own
    try:
        _child.warm(None)  # type: ignore[arg-type]
        del in_flight
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


_TRUNCATE_THEN_SAVE = """
import os, sys, torch, storage
from storage.checkpoint import persist
from storage.checkpoint.persist import _shm
state = {"w": torch.ones(256, 256)}
storage.async_save(state, sys.argv[1] + "/1", persist="process").result()
truncated = sorted(persist.worker().pool.live())
for name in truncated:  # another process of this user (a cleaner) empties them
    os.truncate(os.path.join(_shm.shm_dir(), name), 0)
state["w"] += 1
storage.async_save(state, sys.argv[1] + "/2", persist="process").result()
assert not set(truncated) & set(persist.worker().pool.live())
print("saved")
"""


def test_a_segment_truncated_between_saves_is_made_again_not_copied_into(
    tmp_path: Path,
) -> None:
    """Something of this user truncated a staging segment between two saves. Before,
    the next stage copied into the pool's mapping of it, past the file's end, and the
    training process died of SIGBUS; the pool now judges its segments by size too, and
    makes a truncated one again."""
    assert _run(_TRUNCATE_THEN_SAVE, str(tmp_path)).split() == ["saved"]
    import storage

    loaded = {"w": torch.zeros(256, 256)}
    storage.load(loaded, tmp_path / "2")
    assert torch.equal(loaded["w"], torch.full((256, 256), 2.0))


def test_a_segment_truncated_between_stage_and_write_fails_that_save_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something of this user truncated a segment after the stage, before the worker
    read it. Before, a worker that had mapped it at an earlier save read the bytes past
    the new end of the file as zeros (short of a page) and committed them, checksummed;
    or died of SIGBUS (a page or more). The worker now checks each segment's size
    before reading it: the save fails naming the checkpoint, the item and the segment,
    the committed checkpoint stays, and the next save stages afresh."""
    import storage
    from storage.checkpoint import persist

    path = tmp_path / "ckpt"
    nbytes = 256 * 256 * 4
    state = {"w": torch.ones(256, 256)}  # the same tensors at every save, as in training
    try:
        storage.async_save(state, path, persist="process").result()  # the worker maps it
        write_staged = persist.write_staged

        def truncating(*args: object) -> object:
            pool = persist.worker().pool
            assert pool is not None
            for name in pool.live():  # short of the last page: no SIGBUS, zeros
                os.truncate(Path(_shm.shm_dir(), name), nbytes - 100)
            return write_staged(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(persist, "write_staged", truncating)
        state["w"].fill_(2.0)
        with pytest.raises(
            CheckpointStorageError,
            match=rf"saving .*ckpt, item w: staging segment .* was truncated to {nbytes - 100} "
            rf"bytes after {nbytes} were staged into it.*the next one stages afresh",
        ):
            storage.async_save(state, path, persist="process").result()
        monkeypatch.undo()
        loaded = {"w": torch.zeros(256, 256)}
        storage.load(loaded, path)
        assert torch.equal(loaded["w"], torch.ones(256, 256))  # the committed one
        state["w"].fill_(3.0)
        storage.async_save(state, path, persist="process").result()
        storage.load(loaded, path)
        assert torch.equal(loaded["w"], state["w"])
    finally:
        persist.worker().close()


@pytest.mark.parametrize("how", ["removed", "replaced by a link"])
def test_a_segment_removed_between_stage_and_write_fails_that_save_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A segment the worker has not mapped yet was removed after the stage (RemoveIPC at
    logout, a cleaner), or a link put in its place. Before, the save failed with a bare
    FileNotFoundError (or ELOOP) naming a file in /dev/shm, not the checkpoint, the item
    or what to do."""
    import storage
    from storage.checkpoint import persist

    path = tmp_path / "ckpt"
    links: list[Path] = []
    try:
        storage.async_save({"w": torch.ones(256, 256)}, path, persist="process").result()
        write_staged = persist.write_staged

        def removing(*args: object) -> object:
            pool = persist.worker().pool
            assert pool is not None
            for name in pool.live():
                segment = Path(_shm.shm_dir(), name)
                segment.unlink()
                if how != "removed":
                    segment.symlink_to(tmp_path / "elsewhere")
                    links.append(segment)
            return write_staged(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(persist, "write_staged", removing)
        with pytest.raises(
            CheckpointStorageError,
            match=r"saving .*ckpt, item w: cannot open staging segment .*: something removed "
            r"it after the stage.*the next one stages afresh",
        ):
            # A new tensor: a new segment, which the worker has not mapped.
            storage.async_save({"w": torch.full((256, 256), 2.0)}, path, persist="process").result()
        monkeypatch.undo()
        loaded = {"w": torch.zeros(256, 256)}
        storage.load(loaded, path)
        assert torch.equal(loaded["w"], torch.ones(256, 256))  # the committed one
        storage.async_save({"w": torch.full((256, 256), 3.0)}, path, persist="process").result()
        storage.load(loaded, path)
        assert torch.equal(loaded["w"], torch.full((256, 256), 3.0))
    finally:
        persist.worker().close()
        for link in links:
            link.unlink()


_FORK_THEN_DIE = """
import os, signal, sys, torch, storage
from storage.checkpoint import persist
torch.set_num_threads(1)  # as in DataLoader workers: OpenMP's pool does not survive fork
state = {"w": torch.ones(256, 256)} if sys.argv[2] == "big" else {"b": torch.ones(4)}
if sys.argv[2] == "big":
    storage.async_save(state, sys.argv[1], persist="process").result()
else:  # a manager starts the worker and its pool: no segment (small tensors go by value)
    mgr = storage.CheckpointManager(sys.argv[1], persist="process")
worker = persist.worker()
if sys.argv[3] == "fork" and os.fork() == 0:
    # A child that outlives its parent (a DataLoader worker, for a while): it holds
    # the pool's lock, and has dropped its copy of the worker's socket.
    os.close(worker._conn.fileno())
    sys.stdin.read()  # until the test closes it
    os._exit(0)
print(worker.pid, worker.pool.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _kill_trainer(tmp_path: Path, state: str, fork: str) -> tuple[int, str, subprocess.Popen[str]]:
    """A training process that starts its worker and pool, maybe forks a child that
    outlives it, then is killed: its worker's pid, its pool's name, and the process
    (whose stdin the child reads until it is closed)."""
    argv = [sys.executable, "-c", textwrap.dedent(_FORK_THEN_DIE), str(tmp_path / "c"), state]
    proc = subprocess.Popen(
        [*argv, fork], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    fields = proc.stdout.readline().split()
    assert proc.wait(timeout=180) == -signal.SIGKILL
    assert len(fields) == 2, fields
    return int(fields[0]), fields[1], proc


def test_a_killed_trainers_buffers_are_removed_while_a_child_it_forked_lives(
    tmp_path: Path,
) -> None:
    """The training process is killed while a child it forked lives on, holding the
    pool's lock but not the worker's socket. Before, the worker saw its trainer die,
    swept, found the lock held and left the segments (a copy of the state in
    ``/dev/shm``) behind when it exited, until the next pool this user made. The worker
    now removes its trainer's pool by name: nothing else owns it."""
    worker_pid, pool, proc = _kill_trainer(tmp_path, "big", "fork")
    try:
        assert _gone(worker_pid)
        assert _listing(pool) == []
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the child exits


def test_a_killed_trainer_that_staged_nothing_leaves_no_lock_file(tmp_path: Path) -> None:
    """A manager's training process killed before any tensor went to a segment. Before,
    its worker's sweep left the pool's lock file (no segments, younger than a minute:
    a pool being born, for all the sweep knew): one file more per crash until a pool of
    this user made a minute later swept it."""
    worker_pid, pool, proc = _kill_trainer(tmp_path, "small", "no fork")
    assert _gone(worker_pid)
    assert _listing(pool) == []


def test_a_lock_file_comes_back_though_a_neighbour_took_a_name_it_could_use() -> None:
    """The lock file was removed (RemoveIPC), and a neighbour who listed the directory
    created ``{pool}.lock.new``. Before, the pool made its lock file again under that
    one fixed name: the creation failed, silently, at every stage, and another pool of
    this user then took the live pool for a dead one and removed its segments."""
    first = _pool.StagingPool()
    squat = Path(_shm.shm_dir(), f"{first.name}.lock.new")
    try:
        first.stage(BIG)
        os.unlink(Path(_shm.shm_dir(), f"{first.name}.lock"))
        squat.symlink_to("/nonexistent")
        staged, _ = first.stage(BIG)
        _pool.StagingPool().close()  # sweeps this user's dead pools first
        assert len(_listing(f"{first.name}-")) == 1  # its segment
        assert Path(_shm.shm_dir(), f"{first.name}.lock").is_file()
        assert torch.equal(staged["w"], BIG["w"])
    finally:
        first.close()
        squat.unlink()
