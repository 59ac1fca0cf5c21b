"""The persist worker's staging buffers against their neighbours: another user on the
host, another process of this user that truncates them, a child made with ``fork``, a
training process or a worker killed with ``kill -9``. The buffers are sealed anonymous
memory (``memfd``, :mod:`storage.checkpoint.persist._shm`): nothing names them, nothing
can resize them, and the kernel frees them with their last mapping.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import errno
import mmap
import os
import pwd
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from storage.checkpoint.persist import _pool, _shm
from tests.support.process_identity import kill, running, wait_gone

ROOT = Path(__file__).resolve().parents[2]
BIG = {"w": torch.ones(256, 256)}  # 256 KiB: staged in a segment, not by value


def _run(script: str, *args: str, timeout: float = 180) -> str:
    """Run ``script`` in a fresh interpreter from the repository; returns its stdout and
    fails with everything it printed when it does not exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _segments_of(pid: int) -> list[str]:
    """The ``/proc/PID/map_files`` entries of process ``pid``'s staging segments: a way
    to reach a segment from outside (root; ``/proc/PID/fd`` is the other)."""
    with open(f"/proc/{pid}/maps") as maps:
        return [
            f"/proc/{pid}/map_files/{line.split()[0]}"
            for line in maps
            if f"/memfd:{_shm.MEMFD_NAME}" in line
        ]


def _open_segments(pid: int) -> list[int]:
    """Descriptors of process ``pid``'s segments opened read-write as another process
    would (skips where this process may not: ``map_files`` needs CAP_SYS_ADMIN)."""
    fds = []
    for path in _segments_of(pid):
        try:
            fds.append(os.open(path, os.O_RDWR))
        except PermissionError:
            for fd in fds:
                os.close(fd)
            pytest.skip("opening /proc/PID/map_files needs CAP_SYS_ADMIN")
    return fds


def test_a_segment_is_sealed_and_has_no_name() -> None:
    """Before, segments were files in ``/dev/shm``: another process of this user (a
    cleaner) could truncate one while the training process copied into it, killing it
    with SIGBUS, or remove it (RemoveIPC at logout), or another user take its name. A
    segment is now a memfd, sealed against shrinking and growing before it is mapped:
    no name anywhere, and ``ftruncate`` fails with EPERM."""
    segment = _shm.Segment("0", 1 << 20)
    try:
        for size in (0, 4096, 2 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(segment.fd, size)
        assert os.fstat(segment.fd).st_size == 1 << 20
        assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:")
        with pytest.raises(PermissionError):  # the seals themselves are final
            import fcntl

            fcntl.fcntl(segment.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        segment.reserve()
        segment.map[-1] = 7  # the last byte: no SIGBUS
    finally:
        segment.close()


def test_a_truncation_during_a_save_fails_and_the_save_commits_what_was_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something of this user truncates every staging segment of the training process
    and of its worker (through ``/proc/PID/map_files``) between the stage and the
    worker's reads. Before, the
    worker read the truncated pages as zeros (short of a page: committed, checksummed)
    or died of SIGBUS, and a truncation during the stage killed the training process.
    Each truncation now fails with EPERM; the save commits exactly what was staged."""
    import storage
    from storage.checkpoint import persist

    path = tmp_path / "ckpt"
    state = {"w": torch.ones(256, 256), "v": torch.full((512, 512), 3.0)}
    answers: list[str] = []
    try:
        storage.async_save(state, path, persist="process").result()  # the worker maps them
        write_staged = persist.write_staged

        def truncating(*args: object) -> object:
            worker = persist.worker().pid
            assert worker is not None
            for fd in _open_segments(os.getpid()) + _open_segments(worker):
                try:
                    os.ftruncate(fd, 0)
                    answers.append("truncated")
                except OSError as exc:
                    answers.append(errno.errorcode[exc.errno])
                finally:
                    os.close(fd)
            return write_staged(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(persist, "write_staged", truncating)
        state["w"].fill_(2.0)
        storage.async_save(state, path, persist="process").result()
        assert len(answers) >= 4  # two segments, in both processes
        assert set(answers) == {"EPERM"}, answers
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        storage.load(loaded, path)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
    finally:
        persist.worker().close()


def test_another_user_cannot_reach_the_segments() -> None:
    """Before, another user could list ``/dev/shm``, learn the pool's name and take the
    names of its segments in advance. Segments now have no name: the only ways in are
    ``/proc/PID/fd`` and ``/proc/PID/map_files`` of a process that holds one, which the
    kernel refuses to another user (its ``/proc/PID/maps`` too)."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second user")
    nobody = pwd.getpwnam("nobody").pw_uid
    pool = _pool.StagingPool()
    try:
        pool.stage(BIG)
        fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
        memfds = [p for p in fds if os.path.exists(p) and "/memfd:" in os.readlink(p)]
        paths = [
            *_segments_of(os.getpid()),
            *(p.replace("self", str(os.getpid())) for p in memfds),
            f"/proc/{os.getpid()}/maps",
        ]
        assert len(paths) >= 2
        child = os.fork()
        if child == 0:  # only system calls here, then _exit: safe in a forked child
            code = 0
            try:
                os.setuid(nobody)
                for path in paths:
                    try:
                        os.close(os.open(path, os.O_RDONLY))
                        code = 1  # reached
                    except PermissionError:
                        pass
            except BaseException:  # noqa: BLE001 - reported by the exit code
                code = 2
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        pool.close()


def test_the_worker_maps_only_sealed_segments() -> None:
    """The worker maps what arrives over its socket only when it carries the seals the
    training process puts on every segment: an unsealed memory file could be truncated
    under the worker's reads (SIGBUS). Refused ones are left out: a save reading one
    fails naming it."""
    ours, theirs = socket.socketpair()
    segment = _shm.Segment("sealed", mmap.PAGESIZE)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, mmap.PAGESIZE)
    try:
        _shm.send_segments(ours.fileno(), [segment.fd, unsealed])
        maps = _shm.receive_segments(theirs.fileno(), ["sealed", "unsealed"])
        assert sorted(maps) == ["sealed"] and len(maps["sealed"]) == mmap.PAGESIZE
    finally:
        segment.close()
        os.close(unsealed)
        ours.close()
        theirs.close()


def test_a_segment_the_worker_cannot_map_is_left_out_and_the_worker_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before Python 3.13 each mapping holds a descriptor of its own: the worker may
    receive a segment and have no descriptor left to map it. Before: that error left
    the worker's serving loop as a lost socket, and the worker exited, failing every
    save it was writing. Now the segment is left out (a save reading it fails, naming
    it) and the others are mapped."""
    ours, theirs = socket.socketpair()
    segments = [_shm.Segment(name, mmap.PAGESIZE) for name in ("first", "second")]
    real_map = _shm._map

    def map_or_run_out(fd: int, size: int) -> mmap.mmap:
        if len(maps_made) == 1:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        maps_made.append(fd)
        return real_map(fd, size)

    maps_made: list[int] = []
    monkeypatch.setattr(_shm, "_map", map_or_run_out)
    try:
        _shm.send_segments(ours.fileno(), [s.fd for s in segments])
        maps = _shm.receive_segments(theirs.fileno(), ["first", "second"])
        assert sorted(maps) == ["first"]
    finally:
        for segment in segments:
            segment.close()
        ours.close()
        theirs.close()


_FORK = """
import os, sys, torch, storage
from storage.checkpoint import persist
torch.set_num_threads(1)  # as in DataLoader workers: OpenMP's pool does not survive fork
state = {"w": torch.ones(256, 256)}
storage.async_save(state, sys.argv[1] + "/1", persist="process").result()
pool = persist.worker().pool
before = pool.live()
child = os.fork()
if child == 0:
    # A DataLoader worker or a helper: it saves something of its own, then exits
    # normally, running the atexit hooks it inherited.
    storage.save({"c": torch.zeros(256, 256)}, sys.argv[1] + "/child")
    sys.exit(0)
_, status = os.waitpid(child, 0)
assert status == 0, status
state["w"] += 1
storage.async_save(state, sys.argv[1] + "/2", persist="process").result()
assert persist.worker().pool is pool and pool.live() == before  # the same buffers
print("ok")
"""


def test_a_forked_child_that_exits_leaves_its_parents_buffers_alone(tmp_path: Path) -> None:
    """A child made with ``os.fork`` inherits the pool and runs the inherited atexit hook
    when it exits (before, with named segments, that hook unlinked its parent's live
    segments and the parent's next save failed). A child's own save starts its own
    worker and buffers; the parent's next save copies into its own, as before."""
    assert _run(_FORK, str(tmp_path)).split() == ["ok"]
    loaded = {"w": torch.zeros(256, 256)}
    import storage

    storage.load(loaded, tmp_path / "2")
    assert torch.equal(loaded["w"], torch.full((256, 256), 2.0))


#: The end of a script whose thread holds a lock of the pool (it set ``held`` and waits
#: for ``done``): fork, the child exits at once through the atexit hooks it inherited
#: (they close the pool), and the parent checks it did, within a bound on a failure only.
FORK_AND_EXIT = """
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
"""

_FORK_WHILE_LOCATING = (
    """
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
"""
    + FORK_AND_EXIT
    + """pool.close()
print("ok")
"""
)


def test_a_child_forked_while_a_save_thread_holds_the_pool_exits(tmp_path: Path) -> None:
    """The training thread forks (DataLoader workers for the next epoch) while DCP's save
    thread holds the pool's lock, locating the tensors it hands to the worker. Before,
    the child inherited the lock held, with no thread to release it, and its exit hung
    for ever in the atexit hook closing the pool."""
    assert _run(_FORK_WHILE_LOCATING).split() == ["ok"]


_SAVER = """
import os, signal, sys, torch, storage
from storage.checkpoint import persist
from tests.support.process_identity import start_time
storage.async_save({"w": torch.ones(256, 256)}, sys.argv[1], persist="process").result()
worker = persist.worker()
# What this process and its worker map from /dev/shm (a listing of /dev/shm would also
# show what other processes on the host make meanwhile, tests running beside this one).
made = 0
for pid in ("self", worker.pid):
    with open(f"/proc/{pid}/maps") as maps:
        made += sum("/dev/shm/" in line for line in maps)
print(worker.pid, start_time(worker.pid), made, flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_trainer_that_exits_or_is_killed_leaves_nothing_and_its_worker_stops(
    tmp_path: Path, how: str
) -> None:
    """Before, ``kill -9`` of a training process (and of its worker) left its segments
    in ``/dev/shm`` (144 MB in one test) until the next process of the user staged,
    and for good if none did. Segments are now named nowhere (the save made no file in
    ``/dev/shm``) and go with their last mapping: the worker, which exits when its
    training process is gone."""
    argv = [sys.executable, "-c", textwrap.dedent(_SAVER), str(tmp_path / "ckpt"), how]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=180)
    expected = 0 if how == "exit" else -signal.SIGKILL
    assert proc.returncode == expected, f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    pid, started, made = proc.stdout.split()
    assert made == "0"
    # The worker by pid and start time: its pid, once free, may soon name another process.
    assert wait_gone(int(pid), started, timeout=60), "the worker outlived its trainer"
    import storage

    loaded = {"w": torch.zeros(256, 256)}
    storage.load(loaded, tmp_path / "ckpt")  # committed before the kill
    assert torch.equal(loaded["w"], torch.ones(256, 256))


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


_MANY_TENSORS = """
import resource, sys, torch, storage
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < 1024:
    print("skip")
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a launcher's low soft limit
state = {f"t{i}": torch.full((64, 256), float(i)) for i in range(400)}  # 64 KiB each
storage.async_save(state, sys.argv[1], persist="process").result()
print("ok")
"""


def test_a_state_of_more_tensors_than_the_soft_open_file_limit_stages_through_the_worker(
    tmp_path: Path,
) -> None:
    """Before Python 3.13 each mapped segment holds a descriptor, in the training process
    and in the worker: with a soft limit of 256 (the hard one far above, as most hosts
    set them), a state of 400 tensors failed to stage. The limit is raised to the hard
    one where it is met, in both."""
    out = _run(_MANY_TENSORS, str(tmp_path / "ckpt")).split()
    if out == ["skip"]:
        pytest.skip("the hard open-file limit is below 1024 here")
    assert out == ["ok"]
    import storage

    loaded = {f"t{i}": torch.zeros(64, 256) for i in range(400)}
    storage.load(loaded, tmp_path / "ckpt")
    assert all(
        torch.equal(t, torch.full((64, 256), float(i))) for i, t in enumerate(loaded.values())
    )


def test_a_module_planted_in_the_trainers_working_directory_is_never_imported(
    tmp_path: Path,
) -> None:
    """Before, the worker was started as ``python -c``, which puts the working directory
    first on ``sys.path``, before the package and the standard library: a neighbour who
    can write the directory the job runs in (a shared scratch or project directory)
    planted ``traceback.py`` there, and the worker ran it as the training user at its
    first save, though the training script itself (``python train.py``: its own
    directory first) never looked there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "ran"
    (shared / "traceback.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            import storage
            storage.async_save({"w": torch.ones(256, 256)}, sys.argv[1], persist="process").result()
            print("saved")
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        cwd=shared,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert not marker.exists(), "the worker imported a module from the working directory"
    assert (tmp_path / "ckpt" / ".metadata").exists()


_FORKER = """
import os, signal, sys, time, torch, storage
from storage.checkpoint import persist
from tests.support.process_identity import start_time
storage.async_save({"w": torch.ones(256, 256)}, sys.argv[1], persist="process").result()
worker = persist.worker().pid
child = os.fork()
if child == 0:  # a child of the trainer's that outlives it (the test ends it)
    time.sleep(300)
    os._exit(0)
print(worker, start_time(worker), child, start_time(child), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_stops_with_its_trainer_whatever_children_the_trainer_forked(
    tmp_path: Path,
) -> None:
    """Before, a child the training process made with ``fork`` kept its copy of the
    socket to the worker: the training process killed, the worker went on (writing a
    save no one would commit, holding its mappings) for as long as that child lived."""
    out = tmp_path / "out"
    with out.open("w") as stdout:
        argv = [sys.executable, "-c", textwrap.dedent(_FORKER), str(tmp_path / "ckpt")]
        proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.DEVNULL, cwd=ROOT)
        assert proc.wait(timeout=180) == -signal.SIGKILL
    # Each process by pid and start time: a pid, once free, may soon name another process.
    worker_pid, worker_started, child_pid, child_started = out.read_text().split()
    try:
        assert wait_gone(int(worker_pid), worker_started, timeout=60), (
            "the worker outlived its trainer"
        )
        assert running(int(child_pid), child_started)  # the child lived on all along
    finally:
        kill(int(child_pid), child_started)
