"""The dcp-storage command: each subcommand through ``python -m storage`` as a user runs
it (a handful of subprocesses, each pays the torch import), variations in-process."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import pickle
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.zstd import ZStandard
from storage.cli import main
from tests.support.distributed import gloo_group, spawn

KEY = bytes(range(32))
KEYS_ENV = f"k1={KEY.hex()}"


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "ids": torch.arange(5000)},
        "optim": {"lr": 0.1, "step": step},
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 32), "ids": torch.zeros(5000, dtype=torch.int64)},
        "optim": {"lr": 0.0, "step": 0},
    }


def cli(*args: str, keys: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DCP_STORAGE_KEYS=KEYS_ENV if keys else "")
    return subprocess.run(
        [sys.executable, "-m", "storage", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """step-1 and step-2 committed (zstd), step-3 the leftover of a crashed save."""
    run = tmp_path / "run"
    mgr = storage.CheckpointManager(str(run), transforms=[ZStandard(level=1)])
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    (run / "step-3").mkdir()
    (run / "step-3" / "__0_0-dead.distcp").write_bytes(b"partial")
    return run


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "Warning" not in line and line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("dcp-storage: error: "), stderr
    return lines[0]


# --- through a subprocess -------------------------------------------------------------


def test_demo_still_works(tmp_path: Path) -> None:
    proc = cli("demo", "--steps", "1", "--dir", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    assert figures["equal"] is True and figures["ratio"] > 1.0


def test_ls_lists_committed_and_interrupted_saves(root: Path) -> None:
    proc = cli("ls", str(root))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()[1:-1]}
    assert rows == {"step-1": "committed", "step-2": "committed", "step-3": "uncommitted"}
    assert proc.stdout.splitlines()[-1] == "latest: step-2"
    assert proc.stderr.strip() == ""  # no progress bar output when stderr is not a tty


def test_inspect_shows_items(root: Path) -> None:
    proc = cli("inspect", str(root / "step-2"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == [
        "ITEM",
        "SHAPE",
        "DTYPE",
        "LOGICAL",
        "STORED",
        "RATIO",
        "TRANSFORMS",
    ]
    w = next(line.split() for line in lines if line.startswith("model.w "))
    assert w[1:4] == ["64x32", "float32", "8.0"] and w[-1] == "stream.zstd/1"
    assert lines[-1].startswith("TOTAL") and "4 items" in lines[-1]


def test_verify_ok_then_bad(root: Path) -> None:
    ckpt = root / "step-2"
    proc = cli("verify", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK: 4 items verified")
    _flip_byte_of_item(ckpt, "model.w")
    proc = cli("verify", str(ckpt), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["valid"] is False and list(report["bad"]) == ["model.w"]
    assert "checksum mismatch" in report["bad"]["model.w"]
    assert sorted(report["ok"]) == ["model.ids", "optim.lr", "optim.step"]


def test_cp_transcodes_to_zstd_and_aes(root: Path, tmp_path: Path) -> None:
    dst = tmp_path / "enc"
    proc = cli(
        "cp",
        str(root / "step-2"),
        str(dst),
        "--transform",
        "zstd:5",
        "--transform",
        "aes:k1",
        keys=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "copied" in proc.stdout and "aes256gcm" in proc.stdout
    out = _blank()
    storage.load(out, str(dst), keys={"k1": KEY})
    assert torch.equal(out["model"]["w"], _state(2)["model"]["w"])
    assert out["optim"] == {"lr": 0.1, "step": 2}
    with pytest.raises(Exception, match="k1"):
        storage.load(_blank(), str(dst))  # really encrypted


@pytest.mark.parametrize("spec", ["weights", "weights:compact"])
def test_cp_transcodes_to_the_weight_codec(root: Path, tmp_path: Path, spec: str) -> None:
    dst = tmp_path / "weights"
    proc = cli("cp", str(root / "step-2"), str(dst), "--transform", spec)
    assert proc.returncode == 0, proc.stderr
    assert "dcp_storage.weights" in proc.stdout
    out = _blank()
    storage.load(out, str(dst))
    assert torch.equal(out["model"]["w"], _state(2)["model"]["w"])
    assert out["optim"] == {"lr": 0.1, "step": 2}


def test_rm_removes_a_checkpoint(root: Path) -> None:
    proc = cli("rm", str(root / "step-1"))
    assert proc.returncode == 0, proc.stderr
    assert not (root / "step-1").exists()
    assert storage.CheckpointManager(str(root)).steps() == [2]


def test_gc_prunes_and_cleans(root: Path) -> None:
    old = time.time() - 7200
    os.utime(root / "step-3" / "__0_0-dead.distcp", (old, old))
    (root / "notes").mkdir()
    proc = cli("gc", str(root), "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert "removed step-1 (retention)" in proc.stdout
    assert "removed step-3 (interrupted save)" in proc.stdout
    assert sorted(os.listdir(root)) == [".dcp-latest", "notes", "step-2"]


def test_error_is_one_line(tmp_path: Path) -> None:
    proc = cli("inspect", str(tmp_path / "missing"))
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert str(tmp_path / "missing") in line and "does not exist" in line
    assert proc.stdout == ""


class _RunsCode:
    """Unpickled, it would create ``marker``: what makes the metadata holding it refused."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_refused_checkpoint_is_one_error_line_in_every_command(tmp_path: Path) -> None:
    """``inspect``, ``verify``, ``cp`` and ``rm`` of a checkpoint whose metadata is
    refused print the refusal alone. They used to print a warning first, that because
    it cannot be read none of the checkpoints beside it "is deleted while it stands" -
    though three of them delete nothing - and ``rm``'s error did not say the checkpoint
    itself was kept."""
    ckpt, marker = tmp_path / "refused", tmp_path / "ran"
    storage.save({"w": torch.ones(4)}, str(ckpt))
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file
    metadata.planner_data = _RunsCode(marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    files = sorted(os.listdir(ckpt))
    for command, *rest in (["inspect"], ["verify"], ["cp", str(tmp_path / "copy")], ["rm"]):
        proc = cli(command, str(ckpt), *rest)
        assert proc.returncode == 1, (command, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, (command, proc.stderr)
        assert lines[0].startswith("dcp-storage: error: "), (command, proc.stderr)
        assert f"{ckpt}/.metadata" in lines[0] and "posix.system" in lines[0], lines[0]
        assert ("delete" in lines[0]) == (command == "rm"), (command, lines[0])
    assert sorted(os.listdir(ckpt)) == files
    assert not (tmp_path / "copy").exists() and not marker.exists()


# --- in-process variations --------------------------------------------------------------


def _flip_byte_of_item(ckpt: Path, fqn: str) -> None:
    from storage.checkpoint import storage_format as fmt

    meta = fmt.load_metadata((ckpt / ".metadata").read_bytes(), str(ckpt))
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_bad_input_says_so(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["ls", str(empty)]) == 1
    assert "holds no checkpoints" in capsys.readouterr().err
    for command in ("inspect", "verify"):
        assert main([command, str(root / "step-3")]) == 1
        err = capsys.readouterr().err
        assert "step-3 is not a committed checkpoint" in err and err.count("\n") == 1
    assert main(["inspect", str(root)]) == 1
    assert "dcp-storage ls" in capsys.readouterr().err  # points at the right command
    assert main(["rm", str(root / "step-3")]) == 1
    assert "Refusing to delete" in capsys.readouterr().err
    assert (root / "step-3" / "__0_0-dead.distcp").exists()
    assert main(["cp", str(root / "step-1"), str(tmp_path / "x"), "--transform", "lz5"]) == 1
    assert "unknown --transform 'lz5'" in capsys.readouterr().err
    assert main(["cp", str(root / "step-1"), str(tmp_path / "x"), "--transform", "aes:nokey"]) == 1
    assert "no key for key id 'nokey'" in capsys.readouterr().err
    # A key typed where its id goes (or as a transform) never reaches the terminal or a
    # log: the message names its length only.
    key = base64.b64encode(bytes(range(32))).decode()
    for spec in (f"aes:{key}", key):
        assert main(["cp", str(root / "step-1"), str(tmp_path / "x"), "--transform", spec]) == 1
        err = capsys.readouterr().err
        assert key not in err and key[:20] not in err and "characters" in err


def test_ls_json_and_non_step_checkpoints(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage.save(_state(9), str(root / "best"))
    assert main(["ls", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["latest"] == 2
    names = {c["name"]: c for c in data["checkpoints"]}
    assert set(names) == {"step-1", "step-2", "step-3", "best"}
    assert names["step-3"]["committed"] is False and names["best"]["step"] is None
    assert names["step-2"]["size"] == sum(p.stat().st_size for p in (root / "step-2").iterdir())
    assert main(["ls", str(root / "step-2")]) == 0  # a checkpoint itself lists as "."
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == [".", "committed"]


def test_inspect_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(root / "step-1"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    items = {i["item"]: i for i in data["items"]}
    assert items["model.w"]["shape"] == [64, 32] and items["model.w"]["logical"] == 64 * 32 * 4
    assert items["model.ids"]["dtype"] == "int64"
    assert items["optim.lr"]["dtype"] is None and items["optim.lr"]["logical"] is None
    assert data["total"]["stored"] == sum(i["stored"] for i in data["items"])
    assert data["total"]["ratio"] > 1.0


def test_cp_refuses_committed_destination_and_keeps_bytes(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "copy"
    assert main(["cp", str(root / "step-1"), str(dst)]) == 0
    capsys.readouterr()
    meta_before = (dst / ".metadata").read_bytes()
    assert main(["cp", str(root / "step-2"), str(dst)]) == 1
    assert "already holds a committed checkpoint" in capsys.readouterr().err
    assert (dst / ".metadata").read_bytes() == meta_before
    old_files = {p.name for p in dst.iterdir()}
    assert main(["cp", str(root / "step-2"), str(dst), "--overwrite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["transforms"] == ["stream.zstd/1"]
    # The replaced checkpoint's data files are gone, the new ones are there.
    assert not ({p.name for p in dst.iterdir()} & (old_files - {".metadata"}))
    out = _blank()
    storage.load(out, str(dst))
    assert torch.equal(out["model"]["w"], _state(2)["model"]["w"])
    # Without --transform the stored bytes are copied as they are (same sizes).
    src_sizes = sorted(p.stat().st_size for p in (root / "step-2").glob("*.distcp"))
    assert sorted(p.stat().st_size for p in dst.glob("*.distcp")) == src_sizes


def test_cp_to_memory_backend_and_back_plain(root: Path, tmp_path: Path) -> None:
    from storage.ops.copy import copy_checkpoint
    from storage.ops.describe import describe

    mem = storage.MemoryFileSystem()
    src_fs = storage.LocalFileSystem()
    copy_checkpoint(src_fs, str(root / "step-2"), mem, "bucket/ck", transforms=[])
    assert {r.transforms == [] for r in describe(mem, "bucket/ck").items} == {True}
    copy_checkpoint(mem, "bucket/ck", src_fs, str(tmp_path / "back"), transforms=[ZStandard()])
    out = _blank()
    storage.load(out, str(tmp_path / "back"))
    assert torch.equal(out["model"]["ids"], torch.arange(5000))


def test_key_file_and_gc_nothing_to_do(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.delenv("DCP_STORAGE_KEYS", raising=False)
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"k1": KEY.hex()}))
    key_file.chmod(0o600)  # private, as documented
    enc = tmp_path / "enc"
    args = ["cp", str(root / "step-1"), str(enc), "--transform", "aes:k1"]
    assert main([*args, "--key-file", str(key_file)]) == 0
    assert main(["verify", str(enc)]) == 1  # no key: the items cannot be authenticated
    assert "no key was given" in capsys.readouterr().out
    assert main(["verify", str(enc), "--key-file", str(key_file)]) == 0
    capsys.readouterr()
    before = sorted(os.listdir(root))
    assert main(["gc", str(root), "--keep-last", "5"]) == 0  # step-3 is fresh: kept
    assert "nothing to do" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == before


def _stderr_on_a_tty(argv: list[str], monkeypatch: Any) -> bytes:
    master, replica = pty.openpty()
    # A real terminal has a size; tqdm draws nothing on a 0-column one.
    fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    shown = b""
    try:
        with os.fdopen(replica, "w") as tty:
            with monkeypatch.context() as patch:
                patch.setattr(sys, "stderr", tty)
                assert main(argv) == 0
            tty.flush()
            while select.select([master], [], [], 0.2)[0]:
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                shown += chunk
    finally:
        os.close(master)
    return shown


def test_progress_bar_only_on_a_terminal(root: Path, monkeypatch: Any) -> None:
    shown = _stderr_on_a_tty(["verify", str(root / "step-1")], monkeypatch)
    assert b"verify:" in shown and b"%" in shown
    assert _stderr_on_a_tty(["verify", str(root / "step-1"), "--quiet"], monkeypatch) == b""


def test_cp_local_to_s3_with_zstd_and_aes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.servers import create_bucket, moto_endpoint

    endpoint = moto_endpoint()
    create_bucket(endpoint, "cli-bucket")
    dst = f"s3://cli-bucket/ck-{os.getpid()}-{time.time_ns()}"
    options = [
        f"--storage-option=endpoint_url={endpoint}",
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
    ]
    proc = cli(
        "cp",
        str(root / "step-2"),
        dst,
        "--transform",
        "zstd",
        "--transform",
        "aes:k1",
        *options,
        keys=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert main(["ls", dst.rsplit("/", 1)[0], *options, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert {c["name"]: c["committed"] for c in listed}[dst.rsplit("/", 1)[1]] is True
    assert main(["verify", dst, *options, "--json"]) == 1  # no key here
    capsys.readouterr()
    out = _blank()
    storage.load(
        out,
        dst,
        keys={"k1": KEY},
        storage_options={"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
    )
    assert torch.equal(out["model"]["w"], _state(2)["model"]["w"])


def _sharded_full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {"w": torch.randn(8, 6, generator=gen), "emb": torch.randn(10, 4, generator=gen)}


def _save_sharded(rank: int, store: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        full = _sharded_full()
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        storage.save(dict(state, step=3), path, transforms=[ZStandard()])


def test_sharded_checkpoint_inspect_verify_cp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(tmp_path / "sharded")
    spawn(_save_sharded, args=(str(tmp_path / "store"), src), nprocs=2, join=True)
    assert main(["inspect", src, "--json"]) == 0
    items = {i["item"]: i for i in json.loads(capsys.readouterr().out)["items"]}
    assert items["w@[4, 0]"]["shape"] == [4, 6] and items["w"]["shape"] == [4, 6]
    assert items["emb@[5, 0]"]["logical"] == 5 * 4 * 4
    dst = str(tmp_path / "copy")
    assert main(["cp", src, dst, "--transform", "shuffle", "--transform", "zstd:3"]) == 0
    assert main(["verify", dst, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert len(report["ok"]) == 5 and not report["unchecksummed"]
    out: dict[str, Any] = {"w": torch.zeros(8, 6), "emb": torch.zeros(10, 4), "step": 0}
    storage.load(out, dst)
    full = _sharded_full()
    assert torch.equal(out["w"], full["w"]) and torch.equal(out["emb"], full["emb"])
    assert out["step"] == 3


def test_stock_checkpoint_verify_and_cp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    golden = Path(__file__).parents[1] / "golden" / "stock-zstd"
    assert main(["verify", str(golden), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["unchecksummed"] == sorted(report["ok"])
    dst = tmp_path / "ours"
    assert main(["cp", str(golden), str(dst), "--transform", "none"]) == 0
    assert main(["verify", str(dst), "--json"]) == 0
    capsys.readouterr()
    expected = torch.load(golden.parent / "expected.pt", weights_only=True)
    out = {
        k: (v.clone().zero_() if isinstance(v, torch.Tensor) else v) for k, v in expected.items()
    }
    out["optim"] = {"step": torch.tensor(0.0), "lr": 0.0, "betas": [0.0, 0.0]}
    storage.load(out, str(dst))
    assert torch.equal(out["layer.weight"], expected["layer.weight"])
    assert out["optim"]["betas"] == [0.9, 0.999]


# --- gc and the uploads of killed saves ----------------------------

_KILLED_SAVE = """
import sys, torch, storage
options = {"endpoint_url": sys.argv[2], "key": "testing", "secret": "testing"}
fs = storage.S3FileSystem(storage_options=options, part_size=5 << 20)
storage.save({"w": torch.randn(3 << 20)}, sys.argv[1], filesystem=fs)  # 12 MiB: 3 parts
"""


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_gc_finds_and_aborts_the_uploads_of_a_killed_save(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a save killed mid-upload left its multipart upload open (its parts billed,
    invisible to every listing) and nothing reported it."""
    import uuid

    from tests.support.servers import (
        FaultProxy,
        ServerUnavailable,
        boto3_client,
        create_bucket,
        open_uploads,
        s3_endpoint,
    )

    try:
        endpoint = s3_endpoint(server)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, "cli-uploads")
    prefix = f"{uuid.uuid4().hex}/run"
    root = f"s3://cli-uploads/{prefix}"
    s3 = boto3_client(endpoint)
    with FaultProxy(endpoint) as proxy:
        proxy.add("delay", method="POST", path=r"uploadId=", delay=300.0)  # never completes
        save = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, f"{root}/step-1", proxy.url])
        try:
            deadline = time.monotonic() + 120
            while not any(m == "POST" and "uploadId=" in t for m, t in proxy.arrivals):
                assert save.poll() is None and time.monotonic() < deadline, "the save never began"
                time.sleep(0.2)
        finally:
            save.kill()  # mid-save: every part is up, the upload is never completed
            save.wait()
    assert len(open_uploads(s3, "cli-uploads", prefix)) == 1
    # Not a checkpoint file: not gc's to report or abort.
    s3.create_multipart_upload(Bucket="cli-uploads", Key=f"{prefix}/notes.bin")
    options = [
        f"--storage-option=endpoint_url={endpoint}",
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
    ]
    gc = ["gc", root, "--keep-last", "1", *options, "--json"]
    if server == "seaweedfs":  # moto dates every upload 2010-11-10: all look stale
        assert main([*gc, "--abort-uploads"]) == 0  # the default grace: too young
        assert json.loads(capsys.readouterr().out)["uploads"] == []
    # The killed save's heartbeat keeps its upload for the heartbeat's lifetime ...
    assert main([*gc, "--grace", "0", "--abort-uploads"]) == 0
    assert json.loads(capsys.readouterr().out)["uploads"] == []
    from storage.checkpoint import heartbeat

    monkeypatch.setattr(heartbeat, "LIFETIME", 0.0)  # ... as if that had passed
    assert main([*gc, "--grace", "0"]) == 0
    listed = json.loads(capsys.readouterr().out)["uploads"]
    assert [u["url"] for u in listed] == [f"{root}/step-1/" + _only_data_file(s3, prefix)]
    assert listed[0]["aborted"] is False and open_uploads(s3, "cli-uploads", prefix)
    assert main([*gc, "--grace", "0", "--abort-uploads"]) == 0
    assert json.loads(capsys.readouterr().out)["uploads"][0]["aborted"] is True
    assert open_uploads(s3, "cli-uploads", prefix) == [f"{prefix}/notes.bin"]


def _only_data_file(s3: Any, prefix: str) -> str:
    listing = s3.list_multipart_uploads(Bucket="cli-uploads", Prefix=prefix)
    (key,) = [u["Key"] for u in listing["Uploads"] if u["Key"].endswith(".distcp")]
    return str(key).rsplit("/", 1)[1]


# --- gc and the partial files of killed copies -------------------------------------------

_KILLED_CP = """
import sys
from storage import LocalFileSystem
from storage.ops.copy import copy_checkpoint
from tests.support.gated_fs import GatedFileSystem
copy_checkpoint(LocalFileSystem(), sys.argv[1], GatedFileSystem(sys.argv[3]), sys.argv[2])
"""


@pytest.mark.parametrize("where", ["step-1", "."])
def test_gc_lists_and_removes_the_partial_file_of_a_copy_killed_mid_file(
    tmp_path: Path,
    where: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``cp`` killed with kill -9 in the middle of a data file, then retried: the
    partial file stays beside the committed copy, named by no metadata. Before, gc
    neither listed it (not even with --dry-run) nor swept it where the copy is the root
    itself; now both list it and gc removes it, and the copy still loads bit-exact."""
    from storage.checkpoint import heartbeat
    from tests.support.gated_fs import wait_for

    src, gate = tmp_path / "src", tmp_path / "gate"
    gate.mkdir()
    state = {"w": torch.randn(1 << 18), "b": torch.arange(10)}
    storage.save(state, src)
    root = tmp_path / "root"
    dst = root / where
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=repo)
    cp = subprocess.Popen([sys.executable, "-c", _KILLED_CP, src, dst, gate], env=env)
    try:
        wait_for(gate / "started")
    finally:
        cp.kill()  # SIGKILL: no cleanup runs
        cp.wait()
    (partial,) = [p.name for p in dst.glob("*.distcp")]
    assert main(["cp", str(src), str(dst)]) == 0
    capsys.readouterr()
    # The killed copy's heartbeat stays live for its lifetime: as if that had passed.
    monkeypatch.setattr(heartbeat, "LIFETIME", 0.0)
    gc = ["gc", str(root), "--keep-last", "5", "--grace", "0", "--json"]
    assert main([*gc, "--dry-run"]) == 0
    listed = json.loads(capsys.readouterr().out)["orphans"]
    assert sorted(Path(u).name for u in listed if u.endswith(".distcp")) == [partial]
    assert (dst / partial).exists()
    assert main(gc) == 0
    assert partial in [Path(u).name for u in json.loads(capsys.readouterr().out)["orphans"]]
    assert not (dst / partial).exists()
    assert not [p for p in dst.iterdir() if p.name.startswith(".heartbeat-")]
    out = {"w": torch.zeros(1 << 18), "b": torch.zeros(10, dtype=torch.int64)}
    storage.load(out, dst)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def test_gc_removes_what_a_copy_killed_into_a_directory_of_its_own_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``cp`` to a directory not named ``step-<N>`` killed with kill -9 mid-file, and
    not retried. Before, nothing removed its data files: ``rm`` refuses a directory
    without metadata and points at ``gc``, and ``gc`` on that directory (or its parent)
    found nothing to do. Now ``gc`` on it removes them, by the rule for interrupted
    saves: only checkpoint files, no live heartbeat, all older than the grace."""
    from storage.checkpoint import heartbeat
    from tests.support.gated_fs import wait_for

    src, gate, dst = tmp_path / "src", tmp_path / "gate", tmp_path / "exports" / "final"
    gate.mkdir()
    storage.save({"w": torch.randn(1 << 18)}, src)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cp = subprocess.Popen([sys.executable, "-c", _KILLED_CP, src, dst, gate], env=env)
    try:
        wait_for(gate / "started")
    finally:
        cp.kill()  # SIGKILL: no cleanup runs
        cp.wait()
    (partial,) = [p.name for p in dst.glob("*.distcp")]
    assert main(["rm", str(dst)]) != 0  # not a checkpoint: it points at gc
    assert "dcp-storage gc" in capsys.readouterr().err
    gc = ["gc", str(dst), "--keep-last", "1", "--json"]
    assert main(gc) == 0  # within the grace: it may be a copy still running
    assert json.loads(capsys.readouterr().out)["orphans"] == []
    monkeypatch.setattr(heartbeat, "LIFETIME", 0.0)  # as if the heartbeat's life had passed
    assert main([*gc, "--grace", "0"]) == 0
    removed = [Path(u).name for u in json.loads(capsys.readouterr().out)["orphans"]]
    assert partial in removed
    assert list(dst.iterdir()) == []


# --- gc --abort-uploads and a save in flight ----------------------------------------------


def test_gc_abort_uploads_spares_a_live_save_on_a_store_that_misdates_uploads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """moto dates every multipart upload 2010-11-10. Before, ``gc --abort-uploads``
    trusted that date, aborted the upload of a save held mid-upload, and the save
    failed; now the save's heartbeat protects it and it commits, while an abandoned
    upload (no heartbeat, or a stale one) is still aborted."""
    import contextlib
    import json as _json
    import threading
    import uuid

    from storage.checkpoint import heartbeat
    from tests.support.servers import (
        ServerUnavailable,
        boto3_client,
        create_bucket,
        open_uploads,
        s3_endpoint,
    )

    try:
        endpoint = s3_endpoint("moto")
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    create_bucket(endpoint, "cli-live")
    prefix = f"{uuid.uuid4().hex}/run"
    root = f"s3://cli-live/{prefix}"
    s3 = boto3_client(endpoint)
    reached, release = threading.Event(), threading.Event()
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}

    class Held(storage.S3FileSystem):  # type: ignore[misc,valid-type]
        """Holds each data file after 6 MiB: its first 5 MiB part is up by then."""

        @contextlib.contextmanager
        def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Any:
            with super().create_stream(path, mode, sync=sync) as out:
                yield _HeldAfter(out, 6 << 20, reached, release) if "w" in mode else out

    fs = Held(storage_options=options, part_size=5 << 20)
    state = {"w": torch.randn(3 << 20)}  # 12 MiB: a multipart upload
    errors: list[BaseException] = []

    def save() -> None:
        try:
            storage.save(state, f"{root}/step-1", filesystem=fs)
        except BaseException as exc:
            errors.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert reached.wait(120), "the save never got 6 MiB in"
        deadline = time.monotonic() + 120
        while not open_uploads(s3, "cli-live", prefix):
            assert time.monotonic() < deadline, "the save's upload never began"
            time.sleep(0.05)
        # Abandoned: an upload with no heartbeat, and one beside a heartbeat long dead.
        s3.create_multipart_upload(Bucket="cli-live", Key=f"{prefix}/step-2/__0_0-dead.distcp")
        s3.create_multipart_upload(Bucket="cli-live", Key=f"{prefix}/step-3/__0_0-dead.distcp")
        s3.put_object(
            Bucket="cli-live",
            Key=f"{prefix}/step-3/{heartbeat.name_of('dead')}",
            Body=_json.dumps({"time": 1.0}).encode(),
        )
        cli_options = [f"--storage-option={k}={v}" for k, v in options.items()]
        gc = ["gc", root, "--keep-last", "5", "--grace", "0", "--abort-uploads", "--json"]
        assert main([*gc, *cli_options]) == 0
        aborted = [u["url"] for u in _json.loads(capsys.readouterr().out)["uploads"]]
        assert sorted(aborted) == [
            f"{root}/step-2/__0_0-dead.distcp",
            f"{root}/step-3/__0_0-dead.distcp",
        ]
    finally:
        release.set()
        saver.join(300)
    assert not errors, errors
    out = {"w": torch.zeros(3 << 20)}
    storage.load(out, f"{root}/step-1", storage_options=options)
    assert torch.equal(out["w"], state["w"])
    assert open_uploads(s3, "cli-live", prefix) == []
    keys = s3.list_objects_v2(Bucket="cli-live", Prefix=f"{prefix}/step-1/")["Contents"]
    assert not [k["Key"] for k in keys if heartbeat.PREFIX in k["Key"]]  # removed at the end


class _HeldAfter:
    """A write stream that, once ``after`` bytes went through, sets ``reached`` and
    waits for ``release`` (at most 300 s)."""

    def __init__(self, inner: Any, after: int, reached: Any, release: Any) -> None:
        self.inner, self.left, self.reached, self.release = inner, after, reached, release

    def write(self, data: Any) -> int:
        n = int(self.inner.write(data))
        self.left -= n
        if self.left <= 0 and not self.reached.is_set():
            self.reached.set()
            self.release.wait(300)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_verify_of_a_damaged_item_whose_name_holds_a_line_break_cannot_forge_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An item's name is the checkpoint's to choose: one holding a line break used to
    print as two lines of the report, the second one the name's forged "OK: ..." line."""
    name = "w\nOK: 1 items verified"
    storage.save({name: torch.ones(64)}, str(tmp_path / "ckpt"))
    _flip_byte_of_item(tmp_path / "ckpt", name)
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("BAD: 1 of 1") and not any(line.startswith("OK:") for line in lines)
    assert lines[1].startswith("  w\\nOK: 1 items verified: ")
