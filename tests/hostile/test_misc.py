"""Races and edge cases in the registry, the backends, the manager and the CLI. Each
test says what would happen without the fix it guards."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extensions import ExtensionRegistry
from extensions import registry as registry_module
from storage.backends._local import LocalFileSystem

# --- 13: entry-point plugins are loaded once, and every registry sees them ------------


@pytest.fixture
def fresh_plugin_scan() -> Iterator[None]:
    """Forget the process-wide plugin scan for one test, and restore it after."""
    saved = dict(registry_module._global)
    loaded = registry_module._entry_points_loaded
    registry_module._entry_points_loaded = False
    yield
    registry_module._global.clear()
    registry_module._global.update(saved)
    registry_module._entry_points_loaded = loaded


def _install_fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    """An installed distribution advertising one transform; ``body`` runs on import."""
    module = f"acme_race_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(body)
        + textwrap.dedent(
            """
            from extensions import StreamTransformExtension

            class Plugin(StreamTransformExtension):
                @staticmethod
                def registry_name():
                    return "acme.race"

                @staticmethod
                def from_descriptor(version):
                    return Plugin()

                def get_descriptor(self):
                    return "acme.race/1"

                def transform_to(self, output):
                    return output

                def transform_from(self, input):
                    return input
            """
        )
    )
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[dcp_storage.transforms]\nrace = {module}:Plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def test_registries_built_in_threads_all_see_the_installed_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugin_scan: None
) -> None:
    # Without the fix the first thread marked the scan done before scanning, so the
    # others built registries without the plugin (3 of 4 in the reproduction)
    # and `dcp-storage verify` failed items with "unknown transform 'acme.race'".
    # The plugin's import holds the scan open until the other threads have finished
    # (the bug) or for half a second (the fix: they wait for the scan, so they cannot
    # finish first); the wait only bounds how long a correct run takes.
    gate = types.ModuleType("acme_race_gate")
    gate.others_done = threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "acme_race_gate", gate)
    _install_fake_plugin(
        tmp_path, monkeypatch, "import acme_race_gate\nacme_race_gate.others_done.wait(0.5)\n"
    )
    scans = []
    real_entry_points = registry_module.importlib_metadata.entry_points

    def counting_entry_points(**kwargs: Any) -> Any:
        scans.append(kwargs)
        return real_entry_points(**kwargs)

    monkeypatch.setattr(
        registry_module,
        "importlib_metadata",
        types.SimpleNamespace(entry_points=counting_entry_points),
    )
    threads_n = 4
    start = threading.Barrier(threads_n)
    lock = threading.Lock()
    seen: list[bool] = []

    def build() -> None:
        start.wait()
        names = ExtensionRegistry().names()
        with lock:
            seen.append("acme.race" in names)
            if len(seen) == threads_n - 1:
                gate.others_done.set()  # type: ignore[attr-defined]

    threads = [threading.Thread(target=build) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * threads_n
    assert len(scans) == 1  # the scan runs once per process, not once per registry
    ExtensionRegistry()
    assert len(scans) == 1


# --- 15: the star import works without the optional client libraries ------------------

_WITHOUT_CLIENTS = """
import sys
for name in ("s3fs", "gcsfs", "fsspec"):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from storage import *
from storage.backends import *
import storage
assert "S3FileSystem" in dir(storage)
extras = {"S3FileSystem": "s3", "GCSFileSystem": "gcs", "FsspecFileSystem": "fsspec"}
for name, extra in extras.items():
    try:
        getattr(storage, name)
    except storage.MissingDependencyError as exc:
        assert f"dcp-storage[{extra}]" in str(exc), exc
    else:
        raise AssertionError(f"storage.{name} resolved without its client library")
print("ok", CheckpointManager.__name__, LocalFileSystem.__name__)
"""


def test_star_import_without_cloud_clients() -> None:
    # Without the fix __all__ listed the lazy cloud backends, so the star import
    # resolved each one and died with MissingDependencyError (no s3fs) on import.
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_CLIENTS],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "CheckpointManager", "LocalFileSystem"]


# --- 18: shared state of a backend is created once, however many threads ask at once ---


class _SecondComer:
    """Holds the first caller until a second one arrives (the race made certain), or
    for half a second when none can (the fix: the others wait for the first)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()
        self._second = threading.Event()

    def arrive(self) -> None:
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self._second.wait(0.5)
        else:
            self._second.set()


def _together(n: int, fn: Any) -> list[Any]:
    """Run ``fn`` in ``n`` threads released at once; returns their results."""
    start = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        start.wait()
        results[i] = fn()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_fsspec_client_is_created_once_under_concurrent_first_use() -> None:
    # Without the fix every thread that saw no client yet built its own (each with its
    # own connection pool and retry settings), and the last one won.
    from fsspec.implementations.memory import MemoryFileSystem as FsspecMemory

    from storage.backends._fsspec import FsspecFileSystem

    gate = _SecondComer()

    class Gated(FsspecFileSystem):
        def _make_client(self, protocol: str, options: dict[str, Any]) -> Any:
            gate.arrive()
            return FsspecMemory(skip_instance_cache=True)

    fs = Gated(protocol="memory")
    clients = _together(4, lambda: fs.fs)
    assert gate.calls == 1
    assert all(c is clients[0] for c in clients)


def test_s3_upload_slots_are_one_semaphore_under_concurrent_first_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the fix the first uploads to run at once each built a client, with upload
    # slots of its own, so together they could have max_concurrency parts in flight each.
    from storage.backends.s3 import _filesystem as s3_module

    fs = s3_module.S3FileSystem(max_concurrency=2)
    gate = _SecondComer()
    real = s3_module.S3Client

    def gated(*args: Any, **kwargs: Any) -> Any:
        gate.arrive()
        return real(*args, **kwargs)

    monkeypatch.setattr(s3_module, "S3Client", gated)
    clients = _together(4, lambda: fs.client)
    assert gate.calls == 1
    assert all(c is clients[0] for c in clients)
    assert all(c.slots is clients[0].slots for c in clients)


# --- 14: dcpmem://NAME/... is one process-wide store per NAME -------------------------


def test_memory_url_save_then_load_meet_in_one_named_store() -> None:
    # Without the fix every resolution of a dcpmem:// URL made a new, empty store: the
    # load found no checkpoint, and each save's bytes stayed in memory for good.
    import torch

    import storage
    from storage import MemoryFileSystem

    name = f"run-{uuid.uuid4().hex[:8]}"
    url = f"dcpmem://{name}/ckpt"
    storage.save({"w": torch.arange(4.0)}, url)
    target = {"w": torch.zeros(4)}
    storage.load(target, url)
    assert torch.equal(target["w"], torch.arange(4.0))
    fs, path = storage.filesystem_from_url(url)
    assert fs.url(path) == url  # names round-trip
    MemoryFileSystem.drop_store(name)
    assert name not in MemoryFileSystem._stores
    with pytest.raises(storage.CheckpointNotFoundError):
        storage.load(target, url)
    MemoryFileSystem.drop_store(name)  # the load's lookup made an empty one
    with pytest.raises(ValueError, match="name the store"):
        storage.filesystem_from_url("dcpmem:///ckpt")


def test_unnamed_memory_store_is_freed_with_its_instance() -> None:
    # Without the fix every MemoryFileSystem() stayed listed (and its bytes held) for
    # the life of the process.
    import gc

    from storage import MemoryFileSystem

    fs = MemoryFileSystem()
    fs.write_atomic(fs.init_path("dcpmem://x/a"), b"payload")
    name = fs.name
    assert fs.url("x/a") == f"dcpmem://{name}/x/a"
    del fs
    gc.collect()
    assert name not in MemoryFileSystem._stores


def test_gc_ages_a_planted_heartbeat_that_is_no_json_by_its_file_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a heartbeat file of 3 KiB of "[" (anyone who can write under the root can
    # plant one) made the JSON decoder raise RecursionError, which escaped gc, cleanup
    # and the upload sweep: every `dcp-storage gc` of the root failed with a traceback
    # and nothing was ever cleaned up again.
    import os

    import torch

    from storage import CheckpointManager

    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(2)})
    (root / "step-2").mkdir()
    planted = root / "step-2" / ".heartbeat-abc123"
    planted.write_text("[" * 3000)
    os.utime(planted, (1_000_000, 1_000_000))  # its file time: long dead
    code, out = _run_cli(capsys, "gc", str(root), "--keep-last", "5", "--grace", "60")
    assert code == 0 and "step-2" in out
    assert not (root / "step-2").exists() and mgr.steps() == [1]


# --- 17: checkpoints committed by rank-local metadata are checkpoints everywhere ------


def _rank_local_checkpoint(path: Path) -> dict[int, dict[str, Any]]:
    """A checkpoint as two ranks leave it with ``use_collectives=False``: each rank's
    ``__{rank}.metadata`` and data files, no global ``.metadata``. Returns each rank's
    state."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.support.rank_local import RankWriter

    states = {}
    for rank in (0, 1):
        state = {"w": torch.arange(16.0) + 100 * rank, "meta": {"rank": rank}}
        dcp.save(state, storage_writer=RankWriter(rank, path), no_dist=True, use_collectives=False)
        states[rank] = state
    names = sorted(p.name for p in path.iterdir())
    assert "__0.metadata" in names and "__1.metadata" in names and ".metadata" not in names
    return states


def test_manager_lists_and_loads_rank_local_checkpoints(tmp_path: Path) -> None:
    # Without the fix the manager looked for .metadata only: no steps, latest() None,
    # and load() said there was no committed checkpoint.
    import torch

    from storage import CheckpointManager

    states = _rank_local_checkpoint(tmp_path / "run" / "step-4")
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.steps() == [4] and mgr.latest() == 4
    assert [e.committed for e in mgr.entries()] == [True]
    target = {"w": torch.zeros(16), "meta": {"rank": -1}}
    assert mgr.load(target) == 4
    assert torch.equal(target["w"], states[0]["w"])  # this process is rank 0
    assert mgr.load(target, step=4) == 4


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    from storage.cli import main

    code = main(list(args))
    return code, capsys.readouterr().out


def test_cli_sees_every_rank_of_a_rank_local_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the fix ls listed step-4 as uncommitted, and inspect, verify and cp
    # refused it as "not a committed checkpoint: it has no .metadata".
    import json

    import torch

    import storage

    ckpt = tmp_path / "run" / "step-4"
    states = _rank_local_checkpoint(ckpt)
    code, out = _run_cli(capsys, "ls", "--json", str(tmp_path / "run"))
    listing = json.loads(out)
    assert code == 0 and listing["latest"] == 4
    assert [c["committed"] for c in listing["checkpoints"]] == [True]

    code, out = _run_cli(capsys, "inspect", "--json", str(ckpt))
    items = {row["item"] for row in json.loads(out)["items"]}
    assert code == 0 and {"rank 0: w", "rank 1: w"} <= items and len(items) == 4

    code, out = _run_cli(capsys, "verify", "--json", str(ckpt))
    report = json.loads(out)
    assert code == 0 and report["valid"] and "rank 1: w" in report["ok"]

    copy = tmp_path / "copy"
    code, _ = _run_cli(capsys, "cp", str(ckpt), str(copy))
    assert code == 0
    names = sorted(p.name for p in copy.iterdir())
    assert {"__0.metadata", "__1.metadata"} <= set(names) and ".metadata" not in names
    assert sum(n.startswith("__1_") for n in names) >= 1  # rank 1's data came along
    target = {"w": torch.zeros(16), "meta": {"rank": -1}}
    storage.load(target, copy)
    assert torch.equal(target["w"], states[0]["w"])
    code, out = _run_cli(capsys, "verify", "--json", str(copy))
    assert code == 0 and len(json.loads(out)["ok"]) == len(report["ok"])

    # A flipped byte in rank 1's data is found and named by rank.
    data = next(p for p in ckpt.iterdir() if p.name.startswith("__1_"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, out = _run_cli(capsys, "verify", "--json", str(ckpt))
    assert code == 1 and any(k.startswith("rank 1: ") for k in json.loads(out)["bad"])


def test_cp_transcodes_an_encrypted_rank_local_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: cp decoded and re-encoded the items of a checkpoint committed by rank-local
    # metadata under the name "rank 0: w", which is how messages name them, not the name
    # the writer bound the ciphertext to ("w"): every encrypted item failed
    # authentication ("belong to another item") and the checkpoint could not be
    # transcoded, re-keyed or decrypted by cp at all.
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    import storage
    from extensions import AES256GCM

    key = bytes(range(32))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k": key.hex()}))
    keys.chmod(0o600)  # private, as documented
    ckpt, copy = tmp_path / "step-4", tmp_path / "copy"
    state = {"w": torch.arange(16.0), "n": 3}
    writer = storage.CheckpointWriter(ckpt, transforms=[AES256GCM(key=key, key_id="k")])
    dcp.save(state, storage_writer=writer, no_dist=True, use_collectives=False)
    assert ".metadata" not in {p.name for p in ckpt.iterdir()}
    code, _ = _run_cli(
        capsys, "cp", str(ckpt), str(copy), "--key-file", str(keys),
        "--transform", "zstd", "--transform", "aes:k",
    )  # fmt: skip
    assert code == 0
    target = {"w": torch.zeros(16), "n": -1}
    storage.load(target, copy, keys={"k": key})
    assert torch.equal(target["w"], state["w"]) and target["n"] == 3
    code, out = _run_cli(capsys, "verify", "--json", str(copy), "--key-file", str(keys))
    assert code == 0 and json.loads(out)["valid"]


# --- 16: every rank loads the step rank 0 picked, after this manager's own save -------


class _HidesStep2(LocalFileSystem):
    """A listing that lags behind: step-2 is committed but not listed yet."""

    def ls(self, path: str) -> list[str]:
        return [n for n in super().ls(path) if n != "step-2"]


def _load_latest_worker(rank: int, store: str, root: str) -> None:
    import torch

    from storage import CheckpointManager
    from tests.support.distributed import gloo_group

    with gloo_group(rank, 2, store):
        mgr = CheckpointManager(root, filesystem=_HidesStep2() if rank == 1 else None)
        target = {"w": torch.zeros(4)}
        step = mgr.load(target)
        assert step == 2, f"rank {rank} loaded step {step}"
        assert torch.equal(target["w"], torch.full((4,), 2.0))


def test_ranks_load_the_step_rank_zero_picked(tmp_path: Path) -> None:
    # Without the fix each rank took its own latest(): rank 1, whose listing did not
    # show step-2 yet, loaded step 1 while rank 0 loaded step 2.
    import torch

    from storage import CheckpointManager
    from tests.support.distributed import spawn

    mgr = CheckpointManager(tmp_path / "run")
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    spawn(
        _load_latest_worker,
        args=(str(tmp_path / "store"), str(tmp_path / "run")),
        nprocs=2,
        join=True,
    )


def test_load_waits_for_the_managers_own_async_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the fix load() listed the steps while this manager's own save of step 2
    # was still in flight, and loaded step 1. The save's metadata write is held until
    # the manager waits, so without the fix step 2 cannot be committed when load lists.
    import torch

    from storage import CheckpointManager

    release = threading.Event()

    class Gated(LocalFileSystem):
        def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
            if "step-2" in path:
                assert release.wait(60), "the gate was never opened"
            super().write_atomic(path, data, exclusive=exclusive)

    mgr = CheckpointManager(tmp_path / "run", filesystem=Gated())
    mgr.save(1, {"w": torch.full((4,), 1.0)})
    future = mgr.save(2, {"w": torch.full((4,), 2.0)}, blocking=False)
    assert future is not None
    real_wait = mgr.root_tier.wait  # what load() waits on: the saves straight to the root

    def open_gate_then_wait() -> None:
        release.set()
        real_wait()

    monkeypatch.setattr(mgr.root_tier, "wait", open_gate_then_wait)
    target = {"w": torch.zeros(4)}
    try:
        step = mgr.load(target)
    finally:
        release.set()
        real_wait()
    future.result()
    assert step == 2 and torch.equal(target["w"], torch.full((4,), 2.0))


# --- a sender's DTensor layout in a receiver's messages -------------------------------


def test_a_senders_mesh_record_enters_a_message_quoted_and_bounded() -> None:
    # Without the quoting a received record's mesh ranks (up to 2**20 of them) and
    # dimension names (any strings, any length) were formatted into the message whole.
    import torch

    from storage.ops.transport_dtensor import rebuild

    names = ["\x1b[2J" + "n" * 100_000]
    record = ["cpu", list(range(1 << 16)), names, [["R"]], [4], [1], False]
    with pytest.raises(RuntimeError, match="slice of a device mesh") as info:
        rebuild(torch.zeros(4), record, "ckpt: item 'w'")
    message = str(info.value)
    assert len(message) < 1000 and "\x1b" not in message
